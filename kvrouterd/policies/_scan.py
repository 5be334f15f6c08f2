"""One pass over a decision's candidates: who holds the longest cached prefix, and the load spread.

Prefix-affinity policies (``cache_aware``) need, for every Route and every candidate, its cached
prefix (``MatchResult.overlaps``) and its load. As a bytecode loop that is most of a decision
over 64 workers; the native fast path (``index/_native.c: prefix_scan``) does the same pass in
C, reading each candidate's load by slot from its registry's array (``index.workers``) and,
given the candidates' ``CandidateSlots``, their slots from one array too. This module's
``scan_candidates_py`` (and ``tied_candidates_py``, the candidates tied with the best on prefix
and load, ``prefix_ties``; ``fewest_counted_at_load_py``, the least loaded counted fewest,
``fewest_counted_at_load``; ``least_loaded_index_py``, least_loaded's choice,
``least_loaded_pick``) is the reference: tests hold the two to identical results, and it runs
wherever the extension is not built or declines (``NotImplemented``: a depth or load that is not
a 64-bit int).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from itertools import repeat
from operator import attrgetter, itemgetter
from typing import Any

from ..index import native

__all__ = ["ANY_DEPTH", "fewest_counted_at_load", "fewest_counted_at_load_py", "fewest_counted_py",
           "least_loaded_index", "least_loaded_index_py", "scan_candidates", "scan_candidates_py", "tied_candidates",
           "tied_candidates_py"]

#: (best_i, best_depth, min_i, min_load, max_load)
Scan = tuple[int, int, int, int, int]
#: ``tied_candidates``' depth for ties on load alone, whatever each candidate holds
ANY_DEPTH = -1


def scan_candidates_py(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str,
                       slots: Any = None) -> Scan:
    """``best_i``: the candidate holding the longest prefix (``overlaps[c.slot]``, 0 if absent),
    ties to the lower load (attribute ``load_attr``), then the lower index; ``best_depth`` its
    prefix; ``min_i``: the first candidate with the lowest load; ``min_load``, ``max_load``.
    ``candidates`` must not be empty (ValueError). ``slots``: the candidates' native
    ``CandidateSlots`` (``RoutingContext.candidate_slots``), which the native scan reads instead
    of each candidate; the same answer, so here it is not read."""
    if not candidates:
        raise ValueError("no candidates")
    get = overlaps.get
    best_i = min_i = 0
    best_depth, best_load = -1, 0
    min_load = max_load = getattr(candidates[0], load_attr)
    for i, w in enumerate(candidates):
        depth = get(w.slot, 0)
        load = getattr(w, load_attr)
        if depth > best_depth or (depth == best_depth and load < best_load):
            best_i, best_depth, best_load = i, depth, load
        if load < min_load:
            min_i, min_load = i, load
        elif load > max_load:
            max_load = load
    return best_i, best_depth, min_i, min_load, max_load


def tied_candidates_py(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str, start: int,
                       depth: int, load: int, slots: Any = None) -> list[int]:
    """The indices from ``start`` on of the candidates whose prefix (``overlaps[c.slot]``, 0 if
    absent) is ``depth`` (any, for a negative ``depth``: ``ANY_DEPTH``) and whose load (attribute
    ``load_attr``) is ``load``, in order.
    A negative ``start`` is refused (ValueError). ``slots``: the candidates' ``CandidateSlots``,
    from whose slot map the native pass reads the walk's entries of ``depth`` instead of every
    candidate; the same answer, so here it is not read."""
    if start < 0:
        raise ValueError("start must be >= 0")
    if depth < 0:
        return [i for i in range(start, len(candidates)) if getattr(candidates[i], load_attr) == load]
    get = overlaps.get
    return [i for i in range(start, len(candidates))
            if get(candidates[i].slot, 0) == depth and getattr(candidates[i], load_attr) == load]


_ID = attrgetter("id")


def fewest_counted_py(candidates: Sequence[Any], ties: list[int], counts: Mapping[str, int]) -> int:
    """Of the candidates at the indices ``ties`` (in order), the first whose id has the fewest
    ``counts`` (absent: 0): cache_aware's tie-break among the least loaded. ``ties`` must not
    be empty (ValueError)."""
    if not ties:
        raise ValueError("no ties")
    tied = [candidates[i] for i in ties] if len(ties) == 1 else itemgetter(*ties)(candidates)
    counted = list(map(counts.get, map(_ID, tied), repeat(0, len(ties))))
    return ties[counted.index(min(counted))]


def fewest_counted_at_load_py(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str, start: int,
                              load: int, counts: Mapping[str, int], slots: Any = None, slot_counts: Any = None,
                              slot_owners: Any = None) -> int:
    """Of the candidates from ``start`` on whose load (attribute ``load_attr``) is ``load``, the
    first whose id has the fewest ``counts``: the ties on load alone (``tied_candidates_py``),
    then the one of them counted fewest. ValueError when none is at that load. ``slots`` as for
    ``tied_candidates_py``, and ``slot_counts`` / ``slot_owners`` (the same counts kept by slot,
    equal to ``counts[w.id]`` wherever ``slot_owners[slot]`` is ``w``, which the native pass
    reads instead of looking ids up) never change the answer: not read here."""
    return fewest_counted_py(candidates, tied_candidates_py(candidates, overlaps, load_attr, start, ANY_DEPTH, load),
                             counts)


#: least_loaded's order of preference, its tuples built in C
_LEAST_LOADED_ORDER = attrgetter("pending_prefill_tokens", "inflight_requests", "reported_queue", "slot")


def least_loaded_index_py(candidates: Sequence[Any], slots: Any = None) -> int:
    """The index of least_loaded's choice: the fewest pending prefill tokens, then in-flight
    requests, then engine-reported queued requests, then the lowest slot (the first of equals).
    ``candidates`` must not be empty. ``slots`` (their ``CandidateSlots``, which the native pass
    reads the loads by) never changes the answer: not read here."""
    keys = list(map(_LEAST_LOADED_ORDER, candidates))
    return keys.index(min(keys))


def _least_loaded_index_native(candidates: Sequence[Any], slots: Any = None) -> int:
    result = _native_least_loaded(candidates, slots) if slots is not None else NotImplemented
    if result is NotImplemented:
        return least_loaded_index_py(candidates)
    return result  # type: ignore[no-any-return]


def _fewest_counted_at_load_native(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str, start: int,
                                   load: int, counts: Mapping[str, int], slots: Any = None, slot_counts: Any = None,
                                   slot_owners: Any = None) -> int:
    result = _native_fewest(candidates, overlaps, load_attr, start, load, counts, slots, slot_counts, slot_owners)
    if result is NotImplemented:
        return fewest_counted_at_load_py(candidates, overlaps, load_attr, start, load, counts)
    return result  # type: ignore[no-any-return]


def _scan_candidates_native(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str,
                            slots: Any = None) -> Scan:
    result = _native_scan(candidates, overlaps, load_attr, slots)
    if result is NotImplemented:
        return scan_candidates_py(candidates, overlaps, load_attr)
    return result  # type: ignore[no-any-return]


def _tied_candidates_native(candidates: Sequence[Any], overlaps: Mapping[int, int], load_attr: str, start: int,
                            depth: int, load: int, slots: Any = None) -> list[int]:
    result = _native_ties(candidates, overlaps, load_attr, start, depth, load, slots)
    if result is NotImplemented:
        return tied_candidates_py(candidates, overlaps, load_attr, start, depth, load)
    return result  # type: ignore[no-any-return]


if native.module is not None:
    _native_scan = native.module.prefix_scan
    _native_ties = native.module.prefix_ties
    _native_fewest = native.module.fewest_counted_at_load
    _native_least_loaded = native.module.least_loaded_pick
    scan_candidates = _scan_candidates_native
    tied_candidates = _tied_candidates_native
    fewest_counted_at_load = _fewest_counted_at_load_native
    least_loaded_index = _least_loaded_index_native
else:
    scan_candidates = scan_candidates_py
    tied_candidates = tied_candidates_py
    fewest_counted_at_load = fewest_counted_at_load_py
    least_loaded_index = least_loaded_index_py
