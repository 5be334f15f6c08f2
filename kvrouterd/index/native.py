"""Whether the native fast path (``_native.c``: block-key hashing and the match walk) is in use.

The extension is built by ``pip install`` when a C compiler is present and is optional: without
it the same functions run in pure Python with identical results, only slower (about 65 us more
per 4,000-token Route). ``KVROUTERD_PURE_PYTHON=1`` turns it off, to rule it out when debugging
or to measure the difference. ``kvrouterd bench`` and the startup log say which one runs.
"""

from __future__ import annotations

import os
from types import ModuleType

__all__ = ["DISABLE_ENV", "disabled", "module", "status"]

#: set to 1/true/yes to run the pure-Python implementations even when the extension is built
DISABLE_ENV = "KVROUTERD_PURE_PYTHON"


#: True when DISABLE_ENV asks for pure Python
disabled = os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def _load() -> tuple[ModuleType | None, str]:
    if disabled:
        return None, f"pure Python ({DISABLE_ENV} is set)"
    try:
        from . import _native
    except ImportError:
        return None, "pure Python (the C extension kvrouterd.index._native is not built)"
    return _native, "native (kvrouterd.index._native)"


#: the extension module, or None when the pure-Python path runs
module, status = _load()
