"""Whether the native fast path (``_native.c``: block-key hashing and the match walk) is in use.

It also provides ``U64Map``, the compact engine-hash -> key map (``u64_map``), a fast
``array('Q', ...)`` for engine hashes (``u64_array``), and a cheap
constructor for frozen slotted dataclasses built on every event (``positional_constructor``).

The extension is built by ``pip install`` when a C compiler is present and is optional: without
it the same functions run in pure Python with identical results, only slower (about 65 us more
per 4,000-token Route). ``KVROUTERD_PURE_PYTHON=1`` turns it off, to rule it out when debugging
or to measure the difference. ``kvrouterd bench`` and the startup log say which one runs.
"""

from __future__ import annotations

import dataclasses
import os
from array import array
from collections.abc import Callable, Iterable, MutableMapping
from types import ModuleType
from typing import Any, TypeVar

__all__ = ["DISABLE_ENV", "block_table", "disabled", "module", "positional_constructor", "status", "u64_array", "u64_map"]

T = TypeVar("T")

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


def u64_map(expected: int = 0) -> MutableMapping[int, int]:
    """An empty map of uint64 -> uint64: the native U64Map (~24 bytes an entry) or a dict
    (~77). Both raise OverflowError/TypeError for keys or values outside 0 <= x < 2**64 only
    in the native case, so callers validate ranges first. ``expected``: entries the native map
    takes before its table first grows (a dict cannot be sized ahead). The native map grows
    incrementally (no insert moves more than ``MIGRATE_SLOTS`` old slots' entries); a dict
    grows all at once, as CPython does (issue #16 item 1: ~10 ms at 350k entries)."""
    if module is not None:
        return module.U64Map(expected)  # type: ignore[no-any-return]
    return {}


def u64_array(values: Iterable[int]) -> array:
    """``array('Q', values)``, raising what it raises (OverflowError for a value outside
    0 <= x < 2**64). Natively for a tuple or list of ints: ~10 ns an item instead of array's
    ~65, for the engine hashes of every stored event (``EventApplier._prepare_stored``)."""
    if module is not None:
        packed = module.u64_array(values)
        if packed is not None:
            return packed  # type: ignore[no-any-return]
    return array("Q", values)


def block_table() -> MutableMapping[int, Any]:
    """An empty map of uint64 key -> Block for RadixIndex: the native BlockTable (~24 bytes an
    entry instead of a dict's ~41 plus an int object per key, and read by the native match walk
    with its memory latency overlapped) or a dict. Keys outside 0 <= key < 2**64 are rejected
    with OverflowError by the native table; block keys are xxh3-64 values, so never are. The
    native table grows incrementally, the dict all at once (docs/operations/performance.md, "The native
    tables grow without a stall")."""
    if module is not None:
        return module.BlockTable()  # type: ignore[no-any-return]
    return {}


def positional_constructor(cls: type[T]) -> Callable[..., T]:
    """``cls`` itself, called with every field positionally in declaration order, or natively
    the same object built without the dataclass ``__init__`` (``_native.c``: slots_filler).

    A frozen dataclass's ``__init__`` stores each field through ``object.__setattr__``: ~1.9 us
    for ``Stored``'s ten, on every stored event PublishEvents converts; the native filler sets
    the slots directly (~0.15 us). Only for a ``@dataclass(slots=True)`` whose fields are all
    ``__init__`` arguments and that has no ``__post_init__``, so the two build equal objects."""
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if not all(f.init for f in fields) or hasattr(cls, "__post_init__") or "__slots__" not in vars(cls):
        raise TypeError(f"{cls.__name__}: not a slotted dataclass whose __init__ only stores its fields")
    if module is None:
        return cls
    return module.slots_filler(cls, tuple(f.name for f in fields))  # type: ignore[no-any-return]
