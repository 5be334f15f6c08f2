"""Workloads for ``kvrouterd sim cluster``: a real trace, or seeded generators.

Every workload is a list of ``SimRequest`` in arrival order, in the Mooncake trace's shape:
a prompt of ``input_tokens`` tokens cut into blocks of ``block_tokens`` tokens, each named
by an integer id. Equal ids at the same position mean an identical prefix block, and an id
always has the same parent, so the ids of a workload form a prefix tree (the last block may
be partial, as in the trace). The simulator turns ids into the router's block keys.

Sources (``build_workload``):

- ``mooncake``: a Mooncake-format JSONL trace (``timestamp`` ms, ``input_length``,
  ``output_length``, ``hash_ids`` of 512-token blocks). ``rate`` rescales its timestamps so
  the mean arrival rate becomes ``rate`` requests/s (shape of the arrival process kept).
  Sessions: the trace has no session ids; requests sharing their second block share a
  conversation (block 0 is a system prompt every request shares), so it names the session.
- ``gsp``: the generated-shared-prefix benchmark of the LBGR paper (appendix A): ``groups``
  (128) x ``queries_per_group`` (32) queries; a group's prompts share the first
  ``prefix_ratio`` (0.5) of their length and differ after; lengths cycle 512, 1024, 2048,
  4096, 8192 tokens over groups; ``order`` random or round_robin (one query per group per
  turn, the worst case for LRU); ``output_tokens`` 4; Poisson arrivals (12 req/s).
- ``chat``: multi-turn chat (LBGR appendix A's ShareGPT/UltraChat setting): ``clients`` (128),
  each with rounds drawn from {2, 4, 6, 8}; each round adds a ``user_tokens`` (1024) input to
  the history of the previous prompt and its answer (``output_tokens`` 128); think time
  between rounds log-normal (median ``think_median_s`` 20 s, sigma 1.0); sessions start
  Poisson; the whole trace is then rescaled to ``rate``.
- ``longchat``: long multi-turn chat with heavy-tailed conversation lengths, the setting of
  the tail-optimized LRU paper (section 6.1: WildChat conversations replayed turn by turn;
  appendix F: conversations start Poisson, turns within one follow exponential gaps). Turns
  per conversation are Zipf(``turns_zipf_s`` = 2) over 1..``max_turns`` (40): mean 2.6, most
  conversations one or two turns, a third of the requests from conversations of 10+ turns,
  the heterogeneity of lengths LRU is blind to (section 1). ``conversations`` (800) start
  Poisson at ``rate`` (0.5 req/s) / mean turns, so turns arrive at ``rate`` without rescaling;
  gaps between a conversation's turns are exponential with mean ``turn_gap_s`` (20 s; the
  paper replays WildChat's timestamps and gives no figure). Each turn adds a user prompt of
  ``user_tokens`` (200, WildChat's mean prompt, section 6.2) tokens, log-normal with that
  mean and ``user_tokens_sigma`` (0 = constant, the fixed prompt length of the paper's
  appendix C model), to the history of earlier prompts and answers of ``output_tokens`` (300;
  the paper gives none). Answers carry ``output_block_ids`` for ``--cache-decode`` (the
  paper's vLLM caches them).
- ``docqa``: long-document QA (LBGR appendix A's Loogle setting): ``documents`` (512, as the
  paper samples) truncated to 1k, 2k, 4k or 8k tokens, ``questions_per_doc`` (8) questions of
  32-128 tokens each, random or round_robin order, Poisson arrivals.
- ``toolagent``: tool/agent traffic (the case DualMap targets): ``tools`` (128) system prompts
  of 1k-8k tokens drawn Zipf(``zipf_s`` = 1.2), so a few are very hot (the top one takes
  ~28% of requests) over a long cold tail, each followed by a unique 256-2048-token user
  part; Poisson arrivals. With a short catalogue (e.g. 16 tools) every worker's cache holds
  every prompt and routing hardly matters; the cold tail is what makes affinity pay.
  ``tool_tokens`` (the lengths a tool prompt is drawn from) and ``user_tokens`` ([min, max]
  of the unique part) shape it: ``tool_tokens=[2048,4096,8192] user_tokens=[1024,6144]
  output_tokens=182`` matches DualMap's Table 1 for Mooncake's Tool&Agent trace (mean input
  ~8.4k tokens vs 8,596; ~57% of it a shared tool prompt vs a 59% prefix caching ratio;
  182 output tokens).
- ``mix1`` / ``mix2`` / ``mix3``: UniCache's heterogeneous traces #1-#3 (section 5: 80%, 50%,
  20% of requests multi-turn). Multi-turn tasks are chat (CHAT) and agentic sessions
  (AGENTIC, a shared agent prompt plus a growing history); single-turn tasks are
  untemplated prompts (UNTEMPLATED), programming and tool-use prompts on a few templates and
  document QA (TEMPLATED). Every request carries its task category and a session id.
  Inter-turn gaps are log-normal with UniCache's fits (section 6.1): chat ``chat_gap_mu``
  4.15, ``chat_gap_sigma`` 0.971 (median 63 s), agentic ``agent_gap_mu`` 1.81,
  ``agent_gap_sigma`` 1.092 (median 6.1 s), in log-seconds. Sessions and single-turn
  requests start uniformly over ``requests / rate`` seconds and the trace is that window
  (a session still going at its end is cut), so the rate is met without rescaling the gaps.

Generators use ``block_tokens`` = 64 by default: smaller blocks follow shared-prefix
boundaries more closely, larger ones simulate faster (a block straddling the end of a shared
prefix is unique to its request).
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError
from ..protocols import TaskCategory

__all__ = [
    "GENERATORS",
    "SimRequest",
    "Workload",
    "build_workload",
    "doc_qa",
    "gsp",
    "heterogeneous_mix",
    "load_mooncake",
    "long_chat",
    "multi_turn_chat",
    "scale_to_rate",
    "tool_agent",
]

MOONCAKE_BLOCK_TOKENS = 512
GSP_LENGTHS = (512, 1024, 2048, 4096, 8192)


@dataclass(slots=True)
class SimRequest:
    arrival_s: float
    input_tokens: int
    output_tokens: int
    block_ids: tuple[int, ...]
    session_id: str = ""
    task: TaskCategory = TaskCategory.UNSPECIFIED
    #: ids of the full blocks prompt + output fill beyond the prompt's full blocks, for an
    #: engine that caches generated tokens (``EngineParams.cache_decode``); a session's next
    #: prompt carries the same ids for its answer. Empty when the source does not say.
    output_block_ids: tuple[int, ...] = ()


@dataclass
class Workload:
    name: str
    block_tokens: int
    requests: list[SimRequest]
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def duration_s(self) -> float:
        return self.requests[-1].arrival_s - self.requests[0].arrival_s if self.requests else 0.0

    def unique_blocks(self) -> int:
        seen: set[int] = set()
        for r in self.requests:
            seen.update(r.block_ids)
        return len(seen)

    def total_blocks(self) -> int:
        return sum(len(r.block_ids) for r in self.requests)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---- the Mooncake trace ------------------------------------------------------------------

def _mooncake_record(path: str | Path, lineno: int, line: str, max_input_tokens: int) -> SimRequest | None:
    if not line.strip():
        return None
    try:
        rec = json.loads(line)
        ids = rec["hash_ids"]
        if not isinstance(ids, list) or not all(isinstance(h, int) and h >= 0 for h in ids):
            raise ValueError("hash_ids must be a list of non-negative integers")
        inp = int(rec.get("input_length", 0)) or len(ids) * MOONCAKE_BLOCK_TOKENS
        out = int(rec.get("output_length", 0))
        ts = float(rec.get("timestamp", 0)) / 1000.0
    except (ValueError, KeyError, TypeError) as exc:
        raise ConfigError(f"{path}:{lineno}: not a Mooncake trace record ({exc})") from None
    if not ids:
        return None
    if max_input_tokens and inp > max_input_tokens:
        inp = max_input_tokens
        ids = ids[: _ceil_div(inp, MOONCAKE_BLOCK_TOKENS)]
    session = str(ids[1]) if len(ids) > 1 else f"s{lineno}"
    return SimRequest(ts, inp, max(out, 1), tuple(ids), session, TaskCategory.CHAT)


def load_mooncake(path: str | Path, limit: int = 0, max_input_tokens: int = 0) -> Workload:
    """A Mooncake-format trace, in file order. Raises ConfigError naming a malformed line.

    ``max_input_tokens`` caps prompts (DualMap caps them at 20,480 tokens for its 7B model),
    dropping the blocks beyond the cap.
    """
    requests: list[SimRequest] = []
    try:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if limit and len(requests) >= limit:
                    break
                req = _mooncake_record(path, lineno, line, max_input_tokens)
                if req is not None:
                    requests.append(req)
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from None
    if not requests:
        raise ConfigError(f"trace {path} holds no requests")
    requests.sort(key=lambda r: r.arrival_s)  # stable: file order among equal timestamps
    return Workload("mooncake", MOONCAKE_BLOCK_TOKENS, requests, {"path": str(path), "limit": limit})


def scale_to_rate(workload: Workload, rate: float) -> Workload:
    """The same requests with arrival times scaled so the mean rate is ``rate`` req/s."""
    if rate <= 0:
        raise ConfigError(f"rate must be > 0, got {rate}")
    reqs = workload.requests
    if len(reqs) < 2 or workload.duration_s <= 0:
        return workload
    t0 = reqs[0].arrival_s
    factor = (len(reqs) - 1) / rate / workload.duration_s
    scaled = [SimRequest((r.arrival_s - t0) * factor, r.input_tokens, r.output_tokens, r.block_ids,
                         r.session_id, r.task, r.output_block_ids) for r in reqs]
    return Workload(workload.name, workload.block_tokens, scaled, {**workload.params, "rate": rate})


# ---- building blocks for generators ------------------------------------------------------

class _Ids:
    """Fresh block ids; a prompt is a list of token segments, each owning its ids."""

    def __init__(self, start: int = 0) -> None:
        self.next = start

    def take(self, n: int) -> list[int]:
        start = self.next
        self.next += n
        return list(range(start, start + n))


class _Prompt:
    """A growing prompt: ``ids`` of its full blocks and a partial tail of ``tail`` tokens.

    Appending tokens makes the partial tail (if any) part of a new block, so it gets a
    fresh id: the content of that block changed.
    """

    __slots__ = ("bs", "full", "tokens")

    def __init__(self, bs: int, full: Sequence[int] = (), tokens: int = 0) -> None:
        self.bs = bs
        self.full = list(full)
        self.tokens = tokens

    def extend(self, ids: _Ids, tokens: int) -> _Prompt:
        total = self.tokens + tokens
        keep = self.tokens // self.bs
        full = self.full[:keep] + ids.take(total // self.bs - keep)
        return _Prompt(self.bs, full, total)

    def block_ids(self, ids: _Ids) -> tuple[int, ...]:
        """All block ids, the partial tail getting a fresh one (nobody can share it)."""
        if self.tokens % self.bs:
            return tuple(self.full + ids.take(1))
        return tuple(self.full)


#: single-turn answers take ids from their own range, so prompts keep the ids they had before
#: answers had any (and every seeded workload its exact blocks)
_OUTPUT_IDS_START = 1 << 48


def _output_ids(ids: _Ids, prompt: _Prompt, output_tokens: int) -> tuple[int, ...]:
    """Fresh ids for the full blocks a single-turn answer fills (nobody sends them again)."""
    return tuple(prompt.extend(ids, output_tokens).full[prompt.tokens // prompt.bs:])


def _poisson(rng: random.Random, n: int, rate: float) -> list[float]:
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def _check(name: str, value: float, low: float, high: float = math.inf) -> None:
    if not low <= value <= high:
        raise ConfigError(f"{name} must be in [{low}, {high}], got {value}")


def _zipf_weights(n: int, s: float) -> list[float]:
    return [1.0 / (k + 1) ** s for k in range(n)]


# ---- generators --------------------------------------------------------------------------

def gsp(rng: random.Random, *, rate: float = 12.0, groups: int = 128, queries_per_group: int = 32,
        prefix_ratio: float = 0.5, order: str = "random", output_tokens: int = 4, block_tokens: int = 64,
        lengths: Sequence[int] = GSP_LENGTHS) -> Workload:
    """LBGR appendix A's generated-shared-prefix benchmark (see the module docstring)."""
    _check("prefix_ratio", prefix_ratio, 0.0, 1.0)
    _check("groups", groups, 1)
    _check("queries_per_group", queries_per_group, 1)
    if order not in ("random", "round_robin"):
        raise ConfigError(f"order must be random or round_robin, got {order!r}")
    ids = _Ids()
    per_group: list[list[SimRequest]] = []
    for g in range(groups):
        length = lengths[g % len(lengths)]
        shared = _Prompt(block_tokens).extend(ids, int(length * prefix_ratio))
        reqs = []
        for q in range(queries_per_group):
            prompt = shared.extend(ids, length - shared.tokens)
            reqs.append(SimRequest(0.0, length, output_tokens, prompt.block_ids(ids), f"g{g}q{q}", TaskCategory.TEMPLATED))
        per_group.append(reqs)
    if order == "round_robin":
        ordered = [per_group[g][q] for q in range(queries_per_group) for g in range(groups)]
    else:
        ordered = [r for reqs in per_group for r in reqs]
        rng.shuffle(ordered)
    for r, t in zip(ordered, _poisson(rng, len(ordered), rate)):
        r.arrival_s = t
    return Workload("gsp", block_tokens, ordered, {"rate": rate, "groups": groups, "queries_per_group": queries_per_group,
                                                       "prefix_ratio": prefix_ratio, "order": order})


def _chat_session(rng: random.Random, ids: _Ids, start: float, rounds: int, bs: int, user_tokens: int,
                  output_tokens: int, think_median_s: float, session: str, task: TaskCategory,
                  system: _Prompt | None = None, think_sigma: float = 1.0) -> list[SimRequest]:
    prompt = system if system is not None else _Prompt(bs)
    t = start
    out = []
    for _ in range(rounds):
        prompt = prompt.extend(ids, user_tokens)
        asked = prompt
        block_ids = prompt.block_ids(ids)
        # the answer joins the history the next round sends back
        prompt = prompt.extend(ids, output_tokens)
        out.append(SimRequest(t, asked.tokens, output_tokens, block_ids, session, task,
                              tuple(prompt.full[asked.tokens // bs:])))
        t += rng.lognormvariate(math.log(think_median_s), think_sigma)
    return out


def multi_turn_chat(rng: random.Random, *, rate: float = 4.0, clients: int = 128, rounds: Sequence[int] = (2, 4, 6, 8),
                    user_tokens: int = 1024, output_tokens: int = 128, think_median_s: float = 20.0,
                    block_tokens: int = 64) -> Workload:
    """Multi-turn chat sessions (see the module docstring)."""
    _check("clients", clients, 1)
    ids = _Ids()
    reqs: list[SimRequest] = []
    for c, start in enumerate(_poisson(rng, clients, max(rate / 4, 1e-3))):
        reqs += _chat_session(rng, ids, start, rng.choice(list(rounds)), block_tokens, user_tokens, output_tokens,
                              think_median_s, f"c{c}", TaskCategory.CHAT)
    reqs.sort(key=lambda r: r.arrival_s)
    wl = Workload("chat", block_tokens, reqs, {"clients": clients, "user_tokens": user_tokens, "output_tokens": output_tokens})
    return scale_to_rate(wl, rate)


def long_chat(rng: random.Random, *, rate: float = 0.5, conversations: int = 800, turns_zipf_s: float = 2.0,
              max_turns: int = 40, user_tokens: int = 200, user_tokens_sigma: float = 0.0, output_tokens: int = 300,
              turn_gap_s: float = 20.0, block_tokens: int = 64) -> Workload:
    """Long multi-turn chat with heavy-tailed conversation lengths (T-LRU, see the module docstring)."""
    _check("conversations", conversations, 1)
    _check("max_turns", max_turns, 1)
    _check("turns_zipf_s", turns_zipf_s, 0.0)
    _check("user_tokens", user_tokens, 1)
    _check("user_tokens_sigma", user_tokens_sigma, 0.0)
    _check("output_tokens", output_tokens, 1)
    _check("turn_gap_s", turn_gap_s, 0.0)
    _check("rate", rate, 1e-9)
    weights = _zipf_weights(max_turns, turns_zipf_s)
    mean_turns = sum((k + 1) * w for k, w in enumerate(weights)) / sum(weights)
    # a log-normal with mean ``user_tokens`` (mu = ln(mean) - sigma^2 / 2); sigma 0 is the constant
    mu = math.log(user_tokens) - user_tokens_sigma**2 / 2
    ids = _Ids()
    bs = block_tokens
    reqs: list[SimRequest] = []
    # conversations start Poisson at rate / mean turns, so turns arrive at ``rate`` on average
    for c, start in enumerate(_poisson(rng, conversations, rate / mean_turns)):
        turns = rng.choices(range(1, max_turns + 1), weights)[0]
        prompt, t = _Prompt(bs), start
        for _ in range(turns):
            asked = prompt.extend(ids, max(1, round(rng.lognormvariate(mu, user_tokens_sigma))))
            block_ids = asked.block_ids(ids)
            prompt = asked.extend(ids, output_tokens)  # the answer joins the history the next turn sends
            reqs.append(SimRequest(t, asked.tokens, output_tokens, block_ids, f"c{c}", TaskCategory.CHAT,
                                   tuple(prompt.full[asked.tokens // bs:])))
            t += rng.expovariate(1.0 / turn_gap_s) if turn_gap_s else 0.0
    reqs.sort(key=lambda r: r.arrival_s)
    return Workload("longchat", bs, reqs, {"rate": rate, "conversations": conversations, "turns_zipf_s": turns_zipf_s,
                                           "max_turns": max_turns, "mean_turns": round(mean_turns, 3),
                                           "user_tokens": user_tokens, "output_tokens": output_tokens})


def doc_qa(rng: random.Random, *, rate: float = 8.0, documents: int = 512, questions_per_doc: int = 8,
           doc_lengths: Sequence[int] = (1024, 2048, 4096, 8192), order: str = "random", output_tokens: int = 32,
           block_tokens: int = 64) -> Workload:
    """Several questions about each long document (see the module docstring)."""
    if order not in ("random", "round_robin"):
        raise ConfigError(f"order must be random or round_robin, got {order!r}")
    ids = _Ids()
    per_doc = []
    for d in range(documents):
        doc = _Prompt(block_tokens).extend(ids, rng.choice(list(doc_lengths)))
        qs = []
        for q in range(questions_per_doc):
            p = doc.extend(ids, rng.randint(32, 128))
            qs.append(SimRequest(0.0, p.tokens, output_tokens, p.block_ids(ids), f"d{d}q{q}", TaskCategory.TEMPLATED))
        per_doc.append(qs)
    if order == "round_robin":
        ordered = [per_doc[d][q] for q in range(questions_per_doc) for d in range(documents)]
    else:
        ordered = [r for qs in per_doc for r in qs]
        rng.shuffle(ordered)
    for r, t in zip(ordered, _poisson(rng, len(ordered), rate)):
        r.arrival_s = t
    return Workload("docqa", block_tokens, ordered, {"rate": rate, "documents": documents, "order": order})


def tool_agent(rng: random.Random, *, rate: float = 8.0, requests: int = 4000, tools: int = 128, zipf_s: float = 1.2,
               output_tokens: int = 64, block_tokens: int = 64, tool_tokens: Sequence[int] = (1024, 2048, 4096, 8192),
               user_tokens: Sequence[int] = (256, 2048)) -> Workload:
    """Requests on a few Zipf-hot tool/agent system prompts (see the module docstring)."""
    _check("tools", tools, 1)
    _check("zipf_s", zipf_s, 0.0)
    if not tool_tokens or min(tool_tokens) < 1:
        raise ConfigError(f"tool_tokens must be positive lengths, got {list(tool_tokens)}")
    if len(user_tokens) != 2 or not 1 <= user_tokens[0] <= user_tokens[1]:
        raise ConfigError(f"user_tokens must be [min, max] with 1 <= min <= max, got {list(user_tokens)}")
    ids, out_ids = _Ids(), _Ids(_OUTPUT_IDS_START)
    prompts = [_Prompt(block_tokens).extend(ids, rng.choice(tuple(tool_tokens))) for _ in range(tools)]
    weights = _zipf_weights(tools, zipf_s)
    reqs = []
    for i, t in enumerate(_poisson(rng, requests, rate)):
        k = rng.choices(range(tools), weights)[0]
        p = prompts[k].extend(ids, rng.randint(user_tokens[0], user_tokens[1]))
        reqs.append(SimRequest(t, p.tokens, output_tokens, p.block_ids(ids), f"t{k}r{i}", TaskCategory.AGENTIC,
                               _output_ids(out_ids, p, output_tokens)))
    return Workload("toolagent", block_tokens, reqs, {"rate": rate, "tools": tools, "zipf_s": zipf_s})


def heterogeneous_mix(rng: random.Random, *, multi_turn_share: float = 0.8, rate: float = 4.0, requests: int = 4000,
                      templates: int = 8, block_tokens: int = 64, name: str = "mix",
                      chat_gap_mu: float = 4.15, chat_gap_sigma: float = 0.971, agent_gap_mu: float = 1.81,
                      agent_gap_sigma: float = 1.092) -> Workload:
    """UniCache-style mix of multi-turn and single-turn tasks (see the module docstring)."""
    _check("multi_turn_share", multi_turn_share, 0.0, 1.0)
    for what, sigma in (("chat_gap_sigma", chat_gap_sigma), ("agent_gap_sigma", agent_gap_sigma)):
        if not sigma > 0:
            raise ConfigError(f"{what} must be > 0, got {sigma}")
    ids, out_ids = _Ids(), _Ids(_OUTPUT_IDS_START)
    bs = block_tokens
    agent_prompt = _Prompt(bs).extend(ids, 2048)
    code_templates = [_Prompt(bs).extend(ids, rng.choice((512, 1024, 2048))) for _ in range(templates)]
    tool_templates = [_Prompt(bs).extend(ids, rng.choice((1024, 2048, 4096))) for _ in range(templates)]
    docs = [_Prompt(bs).extend(ids, rng.choice((2048, 4096, 8192))) for _ in range(4 * templates)]
    weights = _zipf_weights(templates, 1.0)
    horizon = requests / max(rate, 1e-9)
    reqs: list[SimRequest] = []
    n_multi = int(requests * multi_turn_share)
    s = 0
    while len(reqs) < n_multi:
        start = rng.uniform(0, horizon)
        rounds = rng.choice((2, 4, 6, 8))
        if rng.random() < 0.5:
            turns = _chat_session(rng, ids, start, rounds, bs, rng.randint(128, 1024), 128, math.exp(chat_gap_mu),
                                  f"chat{s}", TaskCategory.CHAT, think_sigma=chat_gap_sigma)
        else:
            turns = _chat_session(rng, ids, start, rounds, bs, rng.randint(256, 1024), 64, math.exp(agent_gap_mu),
                                  f"agent{s}", TaskCategory.AGENTIC, system=agent_prompt, think_sigma=agent_gap_sigma)
        # the trace is a window of ``horizon`` seconds: a session still going at its end is cut
        # there, so the gaps stay the fitted ones (rescaling the whole trace would shrink them)
        reqs += [r for r in turns if r.arrival_s < horizon]
        s += 1
    for i in range(requests - n_multi):
        t = rng.uniform(0, horizon)
        kind = rng.randrange(4)
        if kind == 0:
            p, task = _Prompt(bs).extend(ids, rng.randint(256, 4096)), TaskCategory.UNTEMPLATED
        elif kind == 1:
            p, task = code_templates[rng.choices(range(templates), weights)[0]].extend(ids, rng.randint(128, 1024)), TaskCategory.TEMPLATED
        elif kind == 2:
            p, task = tool_templates[rng.choices(range(templates), weights)[0]].extend(ids, rng.randint(64, 512)), TaskCategory.TEMPLATED
        else:
            p, task = rng.choice(docs).extend(ids, rng.randint(32, 128)), TaskCategory.TEMPLATED
        reqs.append(SimRequest(t, p.tokens, 64, p.block_ids(ids), f"single{i}", task, _output_ids(out_ids, p, 64)))
    reqs.sort(key=lambda r: r.arrival_s)
    # every request falls in [0, horizon), horizon = requests / rate: the mean rate is ``rate``
    return Workload(name, bs, reqs, {"multi_turn_share": multi_turn_share, "requests": len(reqs)})


GENERATORS: dict[str, Callable[..., Workload]] = {
    "gsp": gsp,
    "chat": multi_turn_chat,
    "longchat": long_chat,
    "docqa": doc_qa,
    "toolagent": tool_agent,
    "mix1": lambda rng, **kw: heterogeneous_mix(rng, multi_turn_share=0.8, name="mix1", **kw),
    "mix2": lambda rng, **kw: heterogeneous_mix(rng, multi_turn_share=0.5, name="mix2", **kw),
    "mix3": lambda rng, **kw: heterogeneous_mix(rng, multi_turn_share=0.2, name="mix3", **kw),
}


def build_workload(name: str, seed: int, rate: float | None = None, *, trace: str | Path | None = None,
                   limit: int = 0, max_input_tokens: int = 0, **params: Any) -> Workload:
    """The named workload for one seed and rate (None = the trace's own rate / the default)."""
    if name == "mooncake":
        if trace is None:
            raise ConfigError("the mooncake workload needs --trace FILE")
        wl = load_mooncake(trace, limit, max_input_tokens)
        return scale_to_rate(wl, rate) if rate else wl
    gen = GENERATORS.get(name)
    if gen is None:
        raise ConfigError(f"unknown workload {name!r}; known: mooncake, {', '.join(GENERATORS)}")
    if rate is not None:
        params["rate"] = rate
    try:
        wl = gen(random.Random(seed), **params)
    except TypeError as exc:
        raise ConfigError(f"workload {name}: {exc}") from None
    if limit:
        wl.requests = wl.requests[:limit]
    return wl
