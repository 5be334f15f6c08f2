"""Whether the native fast path (``_native.c``: block-key hashing and the match walk) is in use.

It also provides ``U64Map``, the compact engine-hash -> key map (``u64_map``).

The extension is built by ``pip install`` when a C compiler is present and is optional: without
it the same functions run in pure Python with identical results, only slower (about 65 us more
per 4,000-token Route). ``KVROUTERD_PURE_PYTHON=1`` turns it off, to rule it out when debugging
or to measure the difference. ``kvrouterd bench`` and the startup log say which one runs.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from types import ModuleType
from typing import Any

__all__ = ["DISABLE_ENV", "block_table", "disabled", "module", "status", "u64_map"]

#: set to 1/true/yes to run the pure-Python implementations even when the extension is built
DISABLE_ENV = "KVROUTERD_PURE_PYTHON"


#: True when DISABLE_ENV asks for pure Python
disabled = os.environ.get(DISABLE_ENV, "").strip().lower() in ("1", "true", "yes")


def _load() -> tuple[ModuleType | None, str]:
    if disabled:
        return None, f"pure Python ({DISABLE_ENV} is set)"
    try:
        from . import _native  # type: ignore[attr-defined]  # a C extension: no stub
    except ImportError:
        return None, "pure Python (the C extension kvrouterd.index._native is not built)"
    return _native, "native (kvrouterd.index._native)"


#: the extension module, or None when the pure-Python path runs
module, status = _load()


def u64_map() -> MutableMapping[int, int]:
    """An empty map of uint64 -> uint64: the native U64Map (~24 bytes an entry) or a dict
    (~77). Both raise OverflowError/TypeError for keys or values outside 0 <= x < 2**64 only
    in the native case, so callers validate ranges first."""
    if module is not None:
        return module.U64Map()  # type: ignore[no-any-return]
    return {}


def block_table() -> MutableMapping[int, Any]:
    """An empty map of uint64 key -> Block for RadixIndex: the native BlockTable (~24 bytes an
    entry instead of a dict's ~41 plus an int object per key, and read by the native match walk
    with its memory latency overlapped) or a dict. Keys outside 0 <= key < 2**64 are rejected
    with OverflowError by the native table; block keys are xxh3-64 values, so never are."""
    if module is not None:
        return module.BlockTable()  # type: ignore[no-any-return]
    return {}
