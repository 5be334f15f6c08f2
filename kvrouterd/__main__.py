"""``python -m kvrouterd``: the same command line as the ``kvrouterd`` script."""

import sys

from .cli import main

sys.exit(main())
