"""A worker's dispatched load has one home, and moves, leaves and is read as the plain members did.

Where the extension is built, ``Worker.inflight_requests`` and ``pending_prefill_tokens`` are
kept in the registry's ``SlotLoads`` by slot (``index.workers``); in pure Python they are
members. Both must behave alike for the ledger, tests and policies writing and reading them, and
the native candidate scan reading them by slot must answer what the Python reference does.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvrouterd.index import native
from kvrouterd.index.radix import RadixIndex
from kvrouterd.index.workers import ListScans, WorkerRegistry, WorkerSpec
from kvrouterd.policies._scan import (
    ANY_DEPTH,
    fewest_counted_at_load,
    scan_candidates,
    scan_candidates_py,
    tied_candidates,
    tied_candidates_py,
)

native_only = pytest.mark.skipif(native.module is None, reason=native.status)


def _spec(i: int) -> WorkerSpec:
    return WorkerSpec(f"w{i}", f"h{i}:1")


def test_a_load_written_is_read_back_and_is_the_workers_own():
    reg = WorkerRegistry()
    a, b = reg.add(_spec(0), 0.0), reg.add(_spec(1), 0.0)
    a.inflight_requests += 2
    a.pending_prefill_tokens = 300
    b.pending_prefill_tokens -= 5  # a test may drive it below 0: an int all the same
    assert (a.inflight_requests, a.pending_prefill_tokens) == (2, 300)
    assert (b.inflight_requests, b.pending_prefill_tokens) == (0, -5)
    if reg.loads is not None:  # the registry's store is the only copy
        assert (reg.loads.get(0, a.slot), reg.loads.get(1, a.slot), reg.loads.get(1, b.slot)) == (2, 300, -5)


def test_a_moved_worker_keeps_its_load_and_its_old_slot_holds_none():
    reg = WorkerRegistry()
    w = reg.add(_spec(0), 0.0)
    w.inflight_requests, w.pending_prefill_tokens = 3, 40
    old = w.slot
    reg.move(w, reg.next_slot())
    assert w.slot != old and (w.inflight_requests, w.pending_prefill_tokens) == (3, 40)
    reg.free_slot(old)
    again = reg.add(_spec(1), 0.0)
    assert again.slot == old and (again.inflight_requests, again.pending_prefill_tokens) == (0, 0)


def test_a_removed_worker_keeps_its_load_and_its_slots_next_worker_starts_at_zero():
    reg = WorkerRegistry()
    gone = reg.add(_spec(0), 0.0)
    gone.inflight_requests, gone.pending_prefill_tokens = 7, 70
    reg.remove("w0")
    after = reg.add(_spec(1), 0.0)
    assert after.slot == gone.slot
    assert (after.inflight_requests, after.pending_prefill_tokens) == (0, 0)
    after.inflight_requests = 1
    assert (gone.inflight_requests, gone.pending_prefill_tokens) == (7, 70)  # not the new worker's


@native_only
def test_slot_load_takes_ints_only_and_says_what_it_needs():
    reg = WorkerRegistry()
    w = reg.add(_spec(0), 0.0)
    with pytest.raises(TypeError):
        w.inflight_requests = 1.0  # type: ignore[assignment]
    with pytest.raises(OverflowError):
        w.pending_prefill_tokens = 2**63
    with pytest.raises(AttributeError):
        del w.inflight_requests
    w.inflight_requests = True  # an int subclass is an int
    assert w.inflight_requests == 1 and type(w.inflight_requests) is int

    class NoStore:
        __slots__ = ("slot",)
        load = native.module.SlotLoad(0)

    bare = NoStore()
    bare.slot = 0
    with pytest.raises(TypeError):
        bare.load
    with pytest.raises(ValueError):
        native.module.SlotLoad(2)


@native_only
def test_slot_loads_grows_and_reads_unset_slots_as_zero():
    store = native.module.SlotLoads()
    assert store.get(1, 5000) == 0
    store.move(3, 5000)  # grows to hold both
    assert store.get(0, 5000) == 0
    own = store.detach(4095)
    assert own.get(0, 4095) == 0
    with pytest.raises(ValueError):
        store.get(0, -1)
    with pytest.raises(ValueError):
        store.move(0, 1 << 20)


@native_only
def test_candidate_slots_takes_one_class_of_workers_sharing_one_store():
    reg, other = WorkerRegistry(), WorkerRegistry()
    a, b = reg.add(_spec(0), 0.0), reg.add(_spec(1), 0.0)
    assert len(native.module.CandidateSlots([a, b])) == 2
    stranger = other.add(_spec(2), 0.0)
    with pytest.raises(ValueError):  # another registry's store
        native.module.CandidateSlots([a, stranger])

    class Lookalike:
        __slots__ = ("slot", "slot_loads")

    twin = Lookalike()
    twin.slot, twin.slot_loads = 5, reg.loads
    with pytest.raises(ValueError):  # another class
        native.module.CandidateSlots([a, twin])
    with pytest.raises(TypeError):
        native.module.prefix_scan([a], {}, "inflight_requests", [0])


@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 300),
    moves=st.lists(st.integers(0, 299), max_size=4),
    holders=st.lists(st.tuples(st.integers(0, 299), st.integers(1, 6)), max_size=80),
    loads=st.lists(st.tuples(st.integers(0, 3), st.integers(0, 3)), min_size=300, max_size=300),
    subset=st.one_of(st.none(), st.sets(st.integers(0, 299), min_size=1)),
    processed=st.dictionaries(st.integers(0, 299), st.integers(0, 3), max_size=300),
)
def test_scan_over_registered_workers_answers_as_the_reference(n, moves, holders, loads, subset, processed):
    """Workers of a registry (slots up to ~300, some moved to fresh slots), their loads written
    through their attributes; cached prefixes from a real walk. The scan (native: by slot, from
    the registry's store) picks what the Python reference reads attribute by attribute; so does
    cache_aware's least-loaded tie-break, the first of the least loaded counted fewest (its
    counts by worker id, some for workers that are not candidates)."""
    reg = WorkerRegistry()
    workers = [reg.add(_spec(i), 0.0) for i in range(n)]
    for m in moves:
        if m < n:
            reg.move(workers[m], reg.next_slot())
    for w, (requests, tokens) in zip(workers, loads):
        w.inflight_requests, w.pending_prefill_tokens = requests, tokens
    index = RadixIndex()
    for w in workers:
        index.add_slot(w.slot)
    keys = list(range(1, 7))
    for i, depth in holders:
        if i < n:
            index.store(workers[i].slot, None, keys[:depth], 0.0)
    candidates = sorted((w for i, w in enumerate(workers) if subset is None or i in subset), key=lambda w: w.slot)
    if not candidates:
        return
    mask = sum(w.bit for w in candidates)
    overlaps = index.match(keys, mask).overlaps
    reference = dict(overlaps.items())
    # the selector's snapshot of their slots (native), read instead of the workers
    slots = native.module.CandidateSlots(candidates) if native.module is not None else None
    for attr in ("inflight_requests", "pending_prefill_tokens"):
        want = scan_candidates_py(candidates, reference, attr)
        assert scan_candidates(candidates, overlaps, attr) == want
        assert scan_candidates(candidates, overlaps, attr, slots) == want
        best_i, depth = want[0], want[1]
        load = getattr(candidates[best_i], attr)
        ties = tied_candidates_py(candidates, reference, attr, best_i, depth, load)
        assert tied_candidates(candidates, overlaps, attr, best_i, depth, load) == ties
        assert tied_candidates(candidates, overlaps, attr, best_i, depth, load, slots) == ties
        counts = {f"w{i}": count for i, count in processed.items()}
        min_i, min_load = want[2], want[3]
        least = tied_candidates_py(candidates, reference, attr, min_i, ANY_DEPTH, min_load)
        fewest = min(least, key=lambda i: (counts.get(candidates[i].id, 0), i))
        assert fewest_counted_at_load(candidates, overlaps, attr, min_i, min_load, counts) == fewest
        assert fewest_counted_at_load(candidates, overlaps, attr, min_i, min_load, counts, slots) == fewest


@native_only
@settings(max_examples=150, deadline=None)
@given(
    n=st.integers(1, 120),
    depths=st.lists(st.integers(0, 3), min_size=120, max_size=120),  # the deepest prefixes tie
    loads=st.lists(st.integers(0, 1), min_size=120, max_size=120),
    subset=st.sets(st.integers(0, 119), min_size=1),
    order=st.permutations(range(120)),
    twice=st.booleans(),
)
def test_scan_by_slots_finds_the_deepest_from_the_walks_last_entries(n, depths, loads, subset, order, twice):
    """The scan given CandidateSlots reads the longest prefix from the walk's deepest entries,
    mapping each entry's slot to its candidate: it answers as the reference when the walk's mask
    holds more workers than the candidates (their entries are passed over, the deepest ones
    included), when the candidates are in any order (ties go to the first, not the lowest
    slot), and when one appears twice (then every candidate is read). So do the ties with the
    best, read from the walk's entries of their depth (given a slot map)."""
    reg = WorkerRegistry()
    workers = [reg.add(_spec(i), 0.0) for i in range(n)]
    for w, load in zip(workers, loads):
        w.inflight_requests = load
    index = RadixIndex()
    for w in workers:
        index.add_slot(w.slot)
    keys = list(range(1, 7))
    for w, depth in zip(workers, depths):
        if depth:
            index.store(w.slot, None, keys[:depth], 0.0)
    candidates = [workers[i % n] for i in sorted({i % n for i in subset})]
    candidates.sort(key=lambda w: order[w.slot % 120])
    if twice:
        candidates.append(candidates[0])
    overlaps = index.match(keys, sum(w.bit for w in workers)).overlaps  # every worker, not only the candidates
    reference = dict(overlaps.items())
    want = scan_candidates_py(candidates, reference, "inflight_requests")
    slots = native.module.CandidateSlots(candidates)
    assert scan_candidates(candidates, overlaps, "inflight_requests", slots) == want
    # the ties (cache_aware's second pass) from the same entries: any depth, load and start
    for depth in range(4):
        for load in (0, 1):
            for start in sorted({0, want[0], want[0] + 1, len(candidates) // 2}):
                assert (tied_candidates(candidates, overlaps, "inflight_requests", start, depth, load, slots)
                        == tied_candidates_py(candidates, reference, "inflight_requests", start, depth, load))


def test_list_scans_answer_for_the_list_as_it_is_at_each_membership():
    """A pool's list comes back Route after Route: its mask and slots are made once per
    membership, and made again once the generation moves (a worker moved to another slot),
    or for another list, even one equal to it."""
    reg = WorkerRegistry()
    workers = [reg.add(_spec(i), 0.0) for i in range(6)]
    pool = workers[1:4]
    scans = ListScans()
    mask, slots = scans.of(pool, reg.generation)
    assert mask == sum(w.bit for w in pool)
    assert scans.of(pool, reg.generation)[1] is slots  # kept
    assert scans.of(list(pool), reg.generation)[1] is not slots or slots is None  # another list
    reg.move(pool[0], reg.next_slot())
    moved_mask, moved_slots = scans.of(pool, reg.generation)
    assert moved_mask == sum(w.bit for w in pool) != mask
    if native.module is not None:
        assert moved_slots is not slots
        index = RadixIndex()
        for w in workers:
            index.add_slot(w.slot)
        overlaps = index.match([1, 2], moved_mask).overlaps
        pool[0].inflight_requests, pool[1].inflight_requests = 5, 0  # read through the new slots
        pool[2].inflight_requests = 1
        assert scan_candidates(pool, overlaps, "inflight_requests", moved_slots) == (1, 0, 1, 0, 5)


def test_a_charge_that_does_not_convert_leaves_the_worker_as_it_was():
    """``WorkerRegistry.commit``/``charge`` convert the entry before its worker's counts move:
    a field that is not a number raises and charges nothing."""
    from kvrouterd.index.workers import InFlight

    reg = WorkerRegistry()
    w = reg.add(_spec(0), 0.0)
    with pytest.raises((TypeError, ValueError)):
        reg.commit(InFlight("r1", w.id, "many", 100, 0, 0.0, "p"))  # type: ignore[arg-type]
    assert (w.inflight_requests, w.pending_prefill_tokens, reg.inflight_count) == (0, 0, 0)
    reg.charge(w, "r1", 40, 100, 0, 0.0, "p")
    assert (w.inflight_requests, w.pending_prefill_tokens, reg.inflight("r1")) == (1, 40, InFlight("r1", w.id, 40, 100, 0, 0.0, "p"))


@settings(max_examples=200, deadline=None)
@given(n=st.integers(0, 300), moves=st.lists(st.integers(0, 299), max_size=20),
       wanted=st.sets(st.integers(0, 320)), kind=st.sampled_from((set, frozenset)))
def test_the_named_candidates_and_their_mask_are_the_references(n, moves, wanted, kind):
    """Workers of a registry, some moved to fresh slots past 300, narrowed to the ids a Route
    names (some naming no worker): the native pass keeps what the reference keeps, in order,
    with the same routing mask."""
    from kvrouterd.index.workers import named_among, named_among_py, routing_mask

    reg = WorkerRegistry()
    workers = [reg.add(_spec(i), 0.0) for i in range(n)]
    for m in moves:
        if m < n:
            reg.move(workers[m], reg.next_slot())
    candidates = sorted(workers, key=lambda w: w.slot)
    names = kind(f"w{i}" for i in wanted)
    named, mask = named_among(candidates, names)
    assert (named, mask) == named_among_py(candidates, names)
    assert named == [w for w in candidates if w.id in names] and mask == routing_mask(named)


@native_only
def test_native_named_candidates_decline_what_they_cannot_read_exactly():
    class Oddly:
        def __init__(self, wid: object, slot: object) -> None:
            self.id, self.slot = wid, slot

    module = native.module
    assert module.named_among([Oddly("a", 1)], ["a"]) is NotImplemented  # not a set
    assert module.named_among([Oddly(("a",), 1)], {("a",)}) is NotImplemented  # an id that is not a str
    assert module.named_among([Oddly("a", 1.0)], {"a"}) is NotImplemented  # a slot that is not an int
    assert module.named_among([Oddly("a", -1)], {"a"}) is NotImplemented
    assert module.named_among([Oddly("b", 1.0)], {"a"}) == ([], 0)  # a slot is read only for a named worker
    assert module.named_among([Oddly("a", 5), Oddly("b", 70)], {"a", "b"})[1] == (1 << 5) | (1 << 70)
    with pytest.raises(AttributeError):
        module.named_among([object()], {"a"})
