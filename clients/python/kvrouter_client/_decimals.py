"""Numbers read from text, in ASCII decimal only: the SDK's ports and advertised limits.

``str.isdigit()`` is true for ``'²'`` (which ``int()`` then refuses) and ``int()`` reads any
script's digits (``'٨٠'`` is 80), spaces and ``_``: a port or limit another program would
refuse must not pass here. (kvrouterd's own ``kvrouterd.decimals`` is the same rule; the SDK is
installed without the daemon, so it cannot import it.)
"""

from __future__ import annotations

import re

# explicit [0-9], never \d: \d matches every script's digits
_DECIMAL = re.compile(r"[0-9]+")


def parse_decimal(text: str) -> int | None:
    """``text`` as an int if it is ASCII digits only, else None."""
    if not _DECIMAL.fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None
