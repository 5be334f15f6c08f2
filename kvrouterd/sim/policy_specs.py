"""The policy specs a simulated run builds its router and engines from: the config's, ``--set``, the engines' cost model.

Policy parameters come from the config file: a run of routing policy NAME uses the config's
``routing`` spec if its name is NAME, else an ``extra_routing`` entry named NAME, else the
policy's defaults (likewise ``eviction``); ``--set NAME.FIELD=VALUE`` overrides one field
(``policy_spec``). ``profiled_spec`` then fills in what the spec leaves unset of the
engines' cost model, for the policies that estimate time.

The clairvoyant ``belady`` eviction (``sim.belady``) is the simulator's alone: the registry
reserves its name, and ``build_eviction`` builds it for an engine from the workload's future
(``NextUse``), every other eviction policy from the registry.
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from ..config import Config
from ..errors import ConfigError
from ..policies import registry
from ..policies.base import EvictionPolicy, NoParams
from ..policies.eviction.tlru import TLRUParams
from ..policies.latency import LATENCY_FIELDS, LatencyModel, LatencyParams
from ..policies.routing.compose import ComposeParams
from . import belady
from .engine import EngineParams

__all__ = ["build_eviction", "policy_spec", "profiled_spec", "simulator_only"]


def simulator_only(kind: str, spec: Mapping[str, Any]) -> bool:
    """Whether ``spec`` names a policy only the simulator builds (``belady``)."""
    return kind == "eviction" and spec.get("name") == belady.NAME


def _check_simulator_only(spec: Mapping[str, Any]) -> None:
    extra = sorted(set(spec) - {"name"})
    if extra:
        raise ConfigError(f"eviction policy {belady.NAME!r}: unknown parameter {extra[0]!r}; it has none")


def build_eviction(spec: Mapping[str, Any], rng: random.Random, future: belady.NextUse | None) -> EvictionPolicy:
    """An engine's eviction policy: ``belady`` over ``future`` (the run's ``NextUse``), any other
    from the registry."""
    if simulator_only("eviction", spec):
        _check_simulator_only(spec)
        if future is None:
            raise ConfigError(f"eviction policy {belady.NAME!r} needs the workload's future (NextUse)")
        return belady.BeladyEviction(NoParams(), rng, future)
    return registry.build("eviction", spec, rng)  # type: ignore[no-any-return]


def policy_spec(cfg: Config, kind: str, name: str, overrides: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The spec to build policy ``name`` with: the config's, else defaults, plus --set overrides."""
    spec: dict[str, Any] = {"name": name}
    if kind == "routing":
        for s in (cfg.routing, *cfg.extra_routing):
            if s.get("name") == name:
                spec = dict(s)
                break
    elif cfg.eviction.get("name") == name:
        spec = dict(cfg.eviction)
    spec.update((overrides or {}).get(name, {}))
    if simulator_only(kind, spec):
        _check_simulator_only(spec)
    else:
        registry.build(kind, spec)  # type: ignore[arg-type]  # fail now, naming the field
    return spec


def profiled_spec(kind: str, spec: Mapping[str, Any], engine: EngineParams, block_tokens: int) -> dict[str, Any]:
    """``spec`` with the engines' cost model filled in wherever the policy estimates time and
    the spec (config or ``--set``) leaves it unset, so routers judge the engines they route to
    as DualMap's does its profiled GPU (section 3.2):

    - a policy whose Params are ``LatencyParams`` (dualmap, min_ttft, preble) gets the
      engines' ``prefill_model`` and its coefficients (``EngineParams.latency_fields``) and
      ``calibrate: false``: every time-estimating policy judges workers by the same fixed
      profile, as DualMap does by default. Left on, min-TTFT's and Preble's online fit
      misjudged workers under queueing (docs/results.md, 10.2), so a comparison measured
      the fit, not the policy; a spec (config or ``--set``) may still turn it on;
    - ``tlru`` gets ``alpha`` (``prefill_ms_per_block``) as the engines' cost per block of a
      prompt that just meets its threshold ``xi``: ``xi / (tokens prefilled in xi / block)``
      (T-LRU section 1: ``xi / alpha`` uncached blocks meet the threshold); under the linear
      model that is exactly ``ms_per_1k * block_tokens / 1000``;
    - ``compose`` passes both of its inner policies through the same.

    LBGR is left in the paper's per-1k-token unit read as ms (``engine_ms_per_1k`` unset), as
    the published router runs: there its residual stays at its floor and LBGR is Cost + P.
    Given the engines' speed (``--set lbgr.engine_ms_per_1k=40``) its per-worker residual
    learns in real ms from completions that arrive seconds late and herds (Mooncake
    conversation, 8 workers, cache 30%, 3,000 requests, 15 req/s: SLO 30.1% against 97.1%;
    97.4% with ``residual_scope: fleet``), so profiling it would measure that flaw, not the
    knowledge. Policies that estimate no time (cache_aware, dynamo, llm_d, kv_cost,
    cache_affinity, least_loaded) need nothing.
    """
    out = dict(spec)
    if simulator_only(kind, out):
        return out  # belady estimates no time
    name = out["name"]
    params = registry.params_class(kind, name)  # type: ignore[arg-type]
    hardware = engine.latency_fields()
    if issubclass(params, LatencyParams):
        for key in LATENCY_FIELDS:
            out.setdefault(key, hardware[key])
        out.setdefault("calibrate", False)
    if kind == "eviction" and name == "tlru" and "prefill_ms_per_block" not in out:
        xi = float(out.get("latency_threshold_ms", TLRUParams().latency_threshold_ms))
        model = LatencyModel(LatencyParams(**hardware, calibrate=False))
        tokens = model.tokens_within(xi)
        out["prefill_ms_per_block"] = (xi * block_tokens / tokens if tokens > 0
                                       else model.prefill_ms(block_tokens))
    if kind == "routing" and name == "compose":
        defaults = ComposeParams()
        for role in ("candidates", "scorer"):
            inner = {"name": out.get(role, getattr(defaults, role)), **out.get(f"{role}_params", {})}
            profiled = profiled_spec(kind, inner, engine, block_tokens)
            del profiled["name"]
            out[f"{role}_params"] = profiled
    return out
