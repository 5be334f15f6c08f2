"""The candidate scan behind cache_aware (and its pass over the tied candidates): the native
passes compute what the Python references do.

Every Route of the default policy goes through it, so a divergence would pick a different worker
depending on how the package was built.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.policies._scan import (
    ANY_DEPTH,
    fewest_counted_at_load,
    fewest_counted_at_load_py,
    fewest_counted_py,
    scan_candidates,
    scan_candidates_py,
    tied_candidates,
    tied_candidates_py,
)


class Cand:
    __slots__ = ("inflight_requests", "pending_prefill_tokens", "slot")

    def __init__(self, slot: int, requests: int, tokens: int) -> None:
        self.slot, self.inflight_requests, self.pending_prefill_tokens = slot, requests, tokens


class DictCand:
    """Attributes in an instance dict: the native scan reads them through the generic lookup."""

    def __init__(self, slot: int, requests: int, tokens: int) -> None:
        self.slot, self.inflight_requests, self.pending_prefill_tokens = slot, requests, tokens


class SubCand(Cand):
    """A subclass of a slotted class: its members are found on the base."""

    __slots__ = ("extra",)


class PropertyCand(Cand):
    """A slot shadowed by a property further down the MRO: the property's value is what counts."""

    __slots__ = ()

    @property  # type: ignore[override]
    def inflight_requests(self) -> int:
        return _MEMBER.__get__(self) * 2 % 7  # not what the slot holds

    @inflight_requests.setter
    def inflight_requests(self, value: int) -> None:
        _MEMBER.__set__(self, value)


_MEMBER = Cand.__dict__["inflight_requests"]


class GetattributeCand(Cand):
    """A class with its own attribute lookup: member offsets must not bypass it."""

    __slots__ = ()

    def __getattribute__(self, name: str) -> object:
        value = object.__getattribute__(self, name)
        return value + 1 if name == "pending_prefill_tokens" else value


KINDS = (Cand, DictCand, SubCand, PropertyCand, GetattributeCand)


def reference(candidates, overlaps, attr):
    """The rule as cache_aware states it, written the obvious way."""
    depths = [overlaps.get(c.slot, 0) for c in candidates]
    loads = [getattr(c, attr) for c in candidates]
    best = max(range(len(candidates)), key=lambda i: (depths[i], -loads[i], -i))
    return best, depths[best], loads.index(min(loads)), min(loads), max(loads)


fleets = st.lists(st.tuples(st.integers(0, 4), st.integers(-3, 5), st.integers(-(2**70), 2**70)), min_size=1, max_size=70)


@settings(max_examples=400, deadline=None)
@given(fleet=fleets, data=st.data())
def test_scan_follows_the_rule_on_both_paths(fleet, data):
    # slotted candidates (what Worker is) are read as members natively; the other kinds, alone or
    # mixed into one fleet, must read exactly what getattr reads
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=len(fleet), max_size=len(fleet))
                      | st.sampled_from(KINDS).map(lambda kind: [kind] * len(fleet)))
    candidates = [kind(slot, requests, tokens) for kind, (slot, (_, requests, tokens)) in zip(kinds, enumerate(fleet))]
    # small depths and loads make ties common: ties must break alike
    overlaps = {slot: depth for slot, (depth, _, _) in enumerate(fleet) if depth}
    overlaps.update(data.draw(st.dictionaries(st.integers(100, 110), st.integers(1, 9), max_size=3)))  # not candidates
    for attr in ("inflight_requests", "pending_prefill_tokens"):
        expected = reference(candidates, overlaps, attr)
        assert scan_candidates_py(candidates, overlaps, attr) == expected
        assert scan_candidates(candidates, overlaps, attr) == expected


def reference_ties(candidates, overlaps, attr, start, depth, load):
    return [i for i, c in enumerate(candidates) if i >= start and (depth < 0 or overlaps.get(c.slot, 0) == depth)
            and getattr(c, attr) == load]


@settings(max_examples=400, deadline=None)
@given(fleet=fleets, data=st.data())
def test_ties_follow_the_rule_on_both_paths(fleet, data):
    kinds = data.draw(st.lists(st.sampled_from(KINDS), min_size=len(fleet), max_size=len(fleet))
                      | st.sampled_from(KINDS).map(lambda kind: [kind] * len(fleet)))
    candidates = [kind(slot, requests, tokens) for kind, (slot, (_, requests, tokens)) in zip(kinds, enumerate(fleet))]
    overlaps = {slot: depth for slot, (depth, _, _) in enumerate(fleet) if depth}
    start = data.draw(st.integers(0, len(fleet) + 1))
    for attr in ("inflight_requests", "pending_prefill_tokens"):
        # the best's depth and load, as cache_aware asks, or any other pair
        best_i, depth, _, _, _ = scan_candidates_py(candidates, overlaps, attr)
        load = getattr(candidates[best_i], attr)
        # and the least load's, at any depth (ANY_DEPTH), as its least-loaded path asks
        _, _, min_i, min_load, _ = scan_candidates_py(candidates, overlaps, attr)
        for d, ld in ((depth, load), (ANY_DEPTH, min_load),
                      (data.draw(st.integers(-1, 4)), data.draw(st.integers(-3, 5)))):
            expected = reference_ties(candidates, overlaps, attr, start, d, ld)
            assert tied_candidates_py(candidates, overlaps, attr, start, d, ld) == expected
            assert tied_candidates(candidates, overlaps, attr, start, d, ld) == expected


class Shrinking(Cand):
    """A load that empties the candidate list it is read from: the native passes must not read on."""

    __slots__ = ("fleet",)

    def __init__(self, slot: int, fleet: list[Cand]) -> None:
        self.slot, self.pending_prefill_tokens, self.fleet = slot, 0, fleet

    @property  # type: ignore[override]
    def inflight_requests(self) -> int:
        self.fleet.clear()
        return 1


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_native_passes_survive_a_getter_that_empties_the_candidates():
    fleet: list[Cand] = []
    shrinking = Shrinking(0, fleet)
    fleet.extend([Cand(1, 0, 0), shrinking, *(Cand(i, 0, 0) for i in range(2, 200))])
    assert native.module.prefix_scan(fleet, {}, "inflight_requests") == (0, 0, 0, 0, 1)
    fleet.extend([Cand(1, 0, 0), shrinking, *(Cand(i, 0, 0) for i in range(2, 200))])
    assert native.module.prefix_ties(fleet, {}, "inflight_requests", 0, 0, 0) == [0]


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_native_ties_decline_what_they_cannot_hold_exactly():
    candidates = [Cand(0, 1, 2**64), Cand(1, 1, 0)]
    assert native.module.prefix_ties(candidates, {0: 3, 1: 3}, "inflight_requests", 0, 3, 1) == [0, 1]
    assert native.module.prefix_ties(candidates, {0: 3, 1: 3}, "inflight_requests", 1, 3, 1) == [1]
    assert native.module.prefix_ties(candidates, {0: 3, 1: 3}, "inflight_requests", 5, 3, 1) == []
    assert native.module.prefix_ties(candidates, {0: 3}, "pending_prefill_tokens", 0, 3, 0) is NotImplemented
    assert native.module.prefix_ties(candidates, {0: 3.0}, "inflight_requests", 0, 3, 1) is NotImplemented
    assert native.module.prefix_ties(candidates, {0: 3}, "inflight_requests", 0, 2**64, 1) is NotImplemented
    assert tied_candidates(candidates, {0: 3}, "pending_prefill_tokens", 0, 3, 2**64) == [0]
    for ties in (native.module.prefix_ties, tied_candidates_py):
        with pytest.raises(ValueError, match="start"):
            ties(candidates, {}, "inflight_requests", -1, 0, 1)
    with pytest.raises(TypeError):
        native.module.prefix_ties(candidates, {}, "inflight_requests", 0, 0)


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_native_scan_declines_what_it_cannot_hold_exactly():
    candidates = [Cand(0, 1, 2**64), Cand(1, 2, 0)]
    assert native.module.prefix_scan(candidates, {0: 3}, "inflight_requests") == (0, 3, 0, 1, 2)
    # a load beyond 64 bits, a non-int depth, a mapping that is not a dict: the Python reference decides
    assert native.module.prefix_scan(candidates, {0: 3}, "pending_prefill_tokens") is NotImplemented
    assert native.module.prefix_scan(candidates, {0: 3.0}, "inflight_requests") is NotImplemented
    assert scan_candidates(candidates, {0: 3}, "pending_prefill_tokens") == (0, 3, 1, 0, 2**64)
    with pytest.raises(ValueError, match="no candidates"):
        native.module.prefix_scan([], {}, "inflight_requests")
    with pytest.raises(AttributeError):
        native.module.prefix_scan([object()], {}, "inflight_requests")
    unset = Cand.__new__(Cand)  # a slotted instance whose members were never set
    with pytest.raises(AttributeError, match="slot"):
        native.module.prefix_scan([Cand(0, 1, 2), unset], {}, "inflight_requests")
    unset.slot = 1
    with pytest.raises(AttributeError, match="inflight_requests"):
        native.module.prefix_scan([Cand(0, 1, 2), unset], {}, "inflight_requests")
    # a slot that is not an int (its hash could run Python code): the reference decides
    assert native.module.prefix_scan([Cand(0, 1, 2), DictCand("s", 0, 0)], {"s": 4}, "inflight_requests") is NotImplemented
    assert scan_candidates([Cand(0, 1, 2), DictCand("s", 0, 0)], {"s": 4}, "inflight_requests") == (1, 4, 1, 0, 1)


def test_python_scan_rejects_an_empty_fleet():
    with pytest.raises(ValueError, match="no candidates"):
        scan_candidates_py([], {}, "inflight_requests")


class Named:
    """A candidate with an id, as cache_aware's tie-break reads it."""

    __slots__ = ("id",)

    def __init__(self, wid: str) -> None:
        self.id = wid


class DictNamed:
    """An id in an instance dict: the native pass reads it through the generic lookup."""

    def __init__(self, wid: str) -> None:
        self.id = wid


class PropertyNamed(Named):
    """A slot shadowed by a property: the property's value is what counts."""

    __slots__ = ()

    @property  # type: ignore[override]
    def id(self) -> str:
        return _ID_MEMBER.__get__(self).upper()

    @id.setter
    def id(self, value: str) -> None:
        _ID_MEMBER.__set__(self, value)


_ID_MEMBER = Named.__dict__["id"]


class NamedCand(Cand):
    """A candidate with an id and a load, as cache_aware's least-loaded tie-break reads them."""

    __slots__ = ("id",)

    def __init__(self, wid: str, requests: int) -> None:
        super().__init__(int(wid[1:]), requests, 0)
        self.id = wid


class DictNamedCand:
    """An id and a load in an instance dict: the native pass reads them through the generic lookup."""

    def __init__(self, wid: str, requests: int) -> None:
        self.slot, self.id, self.inflight_requests, self.pending_prefill_tokens = int(wid[1:]), wid, requests, 0


class PropertyNamedCand(NamedCand):
    """An id slot shadowed by a property: the property's value is what counts."""

    __slots__ = ()

    @property  # type: ignore[override]
    def id(self) -> str:
        return _NAMED_ID.__get__(self).upper()

    @id.setter
    def id(self, value: str) -> None:
        _NAMED_ID.__set__(self, value)


_NAMED_ID = NamedCand.__dict__["id"]


@settings(max_examples=300, deadline=None)
@given(size=st.integers(1, 40), data=st.data())
def test_the_least_loaded_counted_fewest_is_the_references(size: int, data: st.DataObject) -> None:
    kinds = data.draw(st.lists(st.sampled_from((NamedCand, DictNamedCand, PropertyNamedCand)), min_size=size,
                               max_size=size))
    loads = data.draw(st.lists(st.integers(0, 2), min_size=size, max_size=size))
    candidates = [kind(f"w{i}", load) for i, (kind, load) in enumerate(zip(kinds, loads))]
    start = data.draw(st.integers(0, size - 1))
    load = data.draw(st.sampled_from(loads[start:]))
    ids = [f"w{i}" for i in range(size)] + [f"W{i}" for i in range(size)] + ["gone"]
    counts = data.draw(st.dictionaries(st.sampled_from(ids), st.integers(0, 5) | st.integers(-(2**70), 2**70),
                                       max_size=size))
    at_load = [i for i in range(start, size) if loads[i] == load]
    expected = min(at_load, key=lambda i: (counts.get(candidates[i].id, 0), i))  # fewest, then the lowest index
    assert fewest_counted_at_load_py(candidates, {}, "inflight_requests", start, load, counts) == expected
    assert fewest_counted_at_load(candidates, {}, "inflight_requests", start, load, counts) == expected
    ties = [i for i in range(size) if i in at_load]
    assert fewest_counted_py(candidates, ties, counts) == expected


@pytest.mark.skipif(native.module is None, reason=native.status)
def test_the_native_least_loaded_count_declines_what_it_cannot_hold_exactly() -> None:
    candidates = [NamedCand("a0", 0), NamedCand("b1", 1), NamedCand("c2", 0), NamedCand("d3", 0)]
    fewest = native.module.fewest_counted_at_load
    assert fewest(candidates, {}, "inflight_requests", 0, 0, {"a0": 2, "c2": 1, "d3": 1}) == 2
    assert fewest(candidates, {}, "inflight_requests", 0, 0, {}) == 0  # absent counts are 0: the first
    assert fewest(candidates, {}, "inflight_requests", 1, 0, {}) == 2  # from start on
    assert fewest(candidates, {}, "inflight_requests", 0, 1, {"b1": 9}) == 1
    assert fewest(candidates, {}, "inflight_requests", 0, 0, {"a0": 2**64}) is NotImplemented
    assert fewest(candidates, {}, "inflight_requests", 0, 0, {"a0": 1.0}) is NotImplemented
    assert fewest(candidates, {}, "inflight_requests", 0, 2**64, {}) is NotImplemented
    assert fewest(candidates, {0: 1.0}, "inflight_requests", 0, 0, {}) is NotImplemented
    assert fewest_counted_at_load(candidates, {}, "inflight_requests", 0, 0, {"a0": 2**64, "c2": 2**65, "d3": 2**66}) == 0
    for fn in (fewest, fewest_counted_at_load_py):
        with pytest.raises(ValueError, match="no ties"):
            fn(candidates, {}, "inflight_requests", 0, 5, {})
        with pytest.raises(ValueError, match="start"):
            fn(candidates, {}, "inflight_requests", -1, 0, {})
    with pytest.raises(AttributeError):
        fewest([Cand(0, 0, 0)], {}, "inflight_requests", 0, 0, {})
    with pytest.raises(TypeError, match="slots"):
        fewest(candidates, {}, "inflight_requests", 0, 0, {}, object())
    # an id read through a property (uppercased) is counted under what the property says
    shadowed = [NamedCand("a0", 0), PropertyNamedCand("b1", 0), NamedCand("c2", 0)]
    assert fewest(shadowed, {}, "inflight_requests", 0, 0, {"a0": 1, "b1": 0, "B1": 5, "c2": 1}) == 0
    assert fewest(shadowed, {}, "inflight_requests", 0, 0, {"a0": 1, "B1": 0, "c2": 1}) == 1


def test_the_tie_counted_fewest_refuses_no_ties() -> None:
    with pytest.raises(ValueError, match="no ties"):
        fewest_counted_py([Named("a")], [], {})
    with pytest.raises(IndexError):
        fewest_counted_py([Named("a")], [0, 3], {})
