"""Workloads: the Mooncake loader and its time scaling, and the seeded generators' shapes."""

from __future__ import annotations

import itertools
import json
import random
from collections import Counter

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.protocols import TaskCategory
from kvrouterd.sim.workloads import (
    GENERATORS,
    build_workload,
    gsp,
    load_mooncake,
    scale_to_rate,
)


def write_trace(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


def test_mooncake_loader_and_rate_scaling(tmp_path):
    trace = write_trace(tmp_path / "t.jsonl", [
        {"timestamp": 0, "input_length": 1000, "output_length": 5, "hash_ids": [0, 1]},
        {"timestamp": 500, "input_length": 1500, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2000, "input_length": 600, "output_length": 5, "hash_ids": [0, 3]},
    ])
    wl = load_mooncake(trace)
    assert wl.block_tokens == 512 and len(wl.requests) == 3
    assert [r.arrival_s for r in wl.requests] == [0.0, 0.5, 2.0]
    assert wl.requests[1].session_id == wl.requests[0].session_id != wl.requests[2].session_id
    fast = scale_to_rate(wl, 4.0)  # 2 gaps in 0.5 s
    assert [r.arrival_s for r in fast.requests] == pytest.approx([0.0, 0.125, 0.5])
    capped = load_mooncake(trace, max_input_tokens=512)
    assert capped.requests[1].block_ids == (0,) and capped.requests[1].input_tokens == 512


def test_mooncake_loader_names_the_bad_line(tmp_path):
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1, "hash_ids": "x"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2"):
        load_mooncake(trace)


def test_gsp_matches_the_lbgr_appendix():
    wl = gsp(random.Random(0), groups=10, queries_per_group=4, prefix_ratio=0.5, block_tokens=64, order="round_robin")
    assert len(wl.requests) == 40
    # round-robin: one query per group per turn, lengths cycling over groups
    assert [r.input_tokens for r in wl.requests[:6]] == [512, 1024, 2048, 4096, 8192, 512]
    g0 = [r for r in wl.requests if r.session_id.startswith("g0q")]
    shared = 512 * 0.5 // 64
    assert len({r.block_ids[: int(shared)] for r in g0}) == 1
    assert len({r.block_ids[int(shared)] for r in g0}) == 4  # the rest differs per query
    times = [r.arrival_s for r in wl.requests]
    assert times == sorted(times)


@pytest.mark.parametrize("name", sorted(GENERATORS))
def test_generators_are_seeded_prefix_trees_with_labels(name):
    a = build_workload(name, 3, 5.0, limit=400)
    b = build_workload(name, 3, 5.0, limit=400)
    assert [(r.arrival_s, r.block_ids) for r in a.requests] == [(r.arrival_s, r.block_ids) for r in b.requests]
    parent: dict[int, int | None] = {}
    for r in a.requests:
        assert len(r.block_ids) == -(-r.input_tokens // a.block_tokens)
        assert r.session_id and r.task is not TaskCategory.UNSPECIFIED
        prev = None
        for h in r.block_ids:
            assert parent.setdefault(h, prev) == prev  # an id always has the same parent
            prev = h


def test_multi_turn_rounds_reuse_the_previous_prompt():
    wl = build_workload("chat", 0, 5.0)
    by_session = Counter(r.session_id for r in wl.requests)
    assert set(by_session.values()) <= {2, 4, 6, 8}
    sid = next(s for s, n in by_session.items() if n >= 4)
    turns = [r for r in wl.requests if r.session_id == sid]
    for prev, cur in itertools.pairwise(turns):
        full = prev.input_tokens // wl.block_tokens
        assert cur.block_ids[:full] == prev.block_ids[:full]
        assert cur.input_tokens > prev.input_tokens


def test_mixes_follow_the_multi_turn_share():
    shares = []
    for name in ("mix1", "mix2", "mix3"):
        wl = build_workload(name, 0, 4.0)
        multi = sum(r.task in (TaskCategory.CHAT, TaskCategory.AGENTIC) for r in wl.requests)
        shares.append(multi / len(wl.requests))
    assert shares[0] == pytest.approx(0.8, abs=0.03)
    assert shares[1] == pytest.approx(0.5, abs=0.03)
    assert shares[2] == pytest.approx(0.2, abs=0.03)


def test_mix_inter_turn_gaps_follow_unicaches_fits():
    import math
    import statistics

    wl = build_workload("mix1", 0, 4.0)
    turns: dict[tuple[TaskCategory, str], list[float]] = {}
    for r in wl.requests:
        if r.task in (TaskCategory.CHAT, TaskCategory.AGENTIC):
            turns.setdefault((r.task, r.session_id), []).append(r.arrival_s)
    for task, mu, sigma in ((TaskCategory.CHAT, 4.15, 0.971), (TaskCategory.AGENTIC, 1.81, 1.092)):
        logs = [math.log(b - a) for (t, _), ts in turns.items() if t is task for a, b in itertools.pairwise(ts)]
        # a window cuts the longest gaps of sessions that would run past its end: a small bias down
        assert statistics.mean(logs) == pytest.approx(mu, abs=0.25)
        assert statistics.stdev(logs) == pytest.approx(sigma, abs=0.15)
    assert max(r.arrival_s for r in wl.requests) < len(wl.requests) / 4.0 + 1e-9


def test_toolagent_prompts_are_zipf_skewed():
    wl = build_workload("toolagent", 0, 8.0, requests=2000)
    tools = Counter(r.block_ids[0] for r in wl.requests)
    top, *_ = tools.most_common()
    assert top[1] / len(wl.requests) > 0.25


def test_toolagent_shaped_like_dualmaps_table_1():
    wl = build_workload("toolagent", 0, 30.0, requests=3000, tool_tokens=[2048, 4096, 8192],
                        user_tokens=[1024, 6144], output_tokens=182)
    counts = Counter(b for r in wl.requests for b in r.block_ids)
    shared = sum(sum(counts[b] > 1 for b in r.block_ids) for r in wl.requests) * wl.block_tokens
    total = sum(r.input_tokens for r in wl.requests)
    assert 7000 < total / len(wl.requests) < 9500  # Table 1: 8,596 tokens
    assert 0.45 < shared / total < 0.65  # Table 1: 59% prefix caching ratio
    assert {r.output_tokens for r in wl.requests} == {182}
    for bad in ({"user_tokens": [10]}, {"user_tokens": [50, 10]}, {"tool_tokens": []}):
        with pytest.raises(ConfigError, match=next(iter(bad))):
            build_workload("toolagent", 0, 30.0, requests=10, **bad)


def test_unknown_workload_and_bad_params():
    with pytest.raises(ConfigError, match="unknown workload"):
        build_workload("nope", 0)
    with pytest.raises(ConfigError, match="prefix_ratio"):
        build_workload("gsp", 0, prefix_ratio=2.0)
    with pytest.raises(ConfigError, match="workload gsp"):
        build_workload("gsp", 0, bogus=1)


def test_longchat_has_tlrus_heavy_tailed_conversations():
    import statistics

    wl = build_workload("longchat", 0)  # T-LRU's defaults: Zipf(2) turns over 1..40, 200-token prompts
    turns = Counter(r.session_id for r in wl.requests)
    assert len(turns) == 800 and max(turns.values()) <= 40
    share = Counter(turns.values())
    # Zipf(2): P(1 turn) / P(2 turns) = 4; a heavy tail of long conversations carries many requests
    assert share[1] / share[2] == pytest.approx(4.0, rel=0.25)
    assert statistics.mean(turns.values()) == pytest.approx(wl.params["mean_turns"], rel=0.15)
    assert sum(n for n in turns.values() if n >= 10) / len(wl.requests) > 0.2
    # turns arrive at about ``rate`` without rescaling (the gaps stay as drawn)
    assert len(wl.requests) / wl.duration_s == pytest.approx(0.5, rel=0.15)
    sid = max(turns, key=turns.__getitem__)
    convo = [r for r in wl.requests if r.session_id == sid]
    for prev, cur in itertools.pairwise(convo):
        # each turn sends the history back: the previous prompt, its answer, then 200 new tokens
        assert cur.input_tokens == prev.input_tokens + 300 + 200
        full = prev.input_tokens // wl.block_tokens
        assert cur.block_ids[:full] == prev.block_ids[:full]
        # the answer's blocks are the ones the next prompt carries (what --cache-decode stores)
        assert cur.block_ids[full:full + len(prev.output_block_ids)] == prev.output_block_ids


def test_longchat_prompt_lengths_log_normal_around_the_mean():
    import statistics

    wl = build_workload("longchat", 1, user_tokens=200, user_tokens_sigma=1.0, max_turns=1)
    lengths = [r.input_tokens for r in wl.requests]  # one turn each: the prompt is the user's
    assert statistics.mean(lengths) == pytest.approx(200, rel=0.15)
    assert statistics.median(lengths) < 150 < max(lengths) / 4  # skewed: median e^-0.5 of the mean
    with pytest.raises(ConfigError, match="max_turns"):
        build_workload("longchat", 0, max_turns=0)
