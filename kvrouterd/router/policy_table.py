"""The routing and eviction policies a router runs: the configured ones, those a request or hint names, and reloads.

Every policy comes from the one registry (``policies.registry``), seeded from the router's
random source in a fixed order, so the daemon and the simulator build the same objects. A
policy a request names but the configuration does not is built with default parameters on
first use and kept. A routing policy sees every worker through ``on_worker_added``, whenever
it is built.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import ConfigError, UnknownPolicy
from ..index.workers import WorkerRegistry
from ..policies import registry
from ..policies.base import EvictionPolicy, RoutingPolicy
from .settings import RouterSettings

__all__ = ["PolicyTable"]


def _spec_name(spec: Mapping[str, Any] | str) -> str:
    return spec if isinstance(spec, str) else str(spec.get("name", ""))


class PolicyTable:
    """The policy objects by name; ``eviction`` is the configured eviction policy, the one whose
    hooks see every store, access and removal."""

    def __init__(self, settings: RouterSettings, rng: random.Random, workers: WorkerRegistry) -> None:
        self._rng = rng
        self._workers = workers
        self.routing: dict[str, RoutingPolicy] = {}
        self.default_routing = _spec_name(settings.routing)
        for spec in (settings.routing, *settings.extra_routing):
            policy = registry.build("routing", spec, random.Random(rng.getrandbits(64)))
            self.routing[policy.name] = policy
        self.eviction: EvictionPolicy = registry.build("eviction", settings.eviction, random.Random(rng.getrandbits(64)))
        self.eviction_by_name: dict[str, EvictionPolicy] = {self.eviction.name: self.eviction}

    def routing_policy(self, name: str = "") -> RoutingPolicy:
        """The configured policy ``name`` (default if empty); registered-but-unconfigured
        policies are built with default parameters on first use."""
        name = name or self.default_routing
        policy = self.routing.get(name)
        if policy is None:
            if name not in registry.names("routing"):
                raise UnknownPolicy(registry.not_built("routing", name))
            policy = registry.build("routing", name, random.Random(self._rng.getrandbits(64)))
            for w in self._workers:
                policy.on_worker_added(w)
            self.routing[name] = policy
        return policy

    def eviction_policy(self, name: str = "") -> EvictionPolicy:
        if not name:
            return self.eviction
        policy = self.eviction_by_name.get(name)
        if policy is None:
            if name not in registry.names("eviction"):
                raise UnknownPolicy(registry.not_built("eviction", name))
            policy = registry.build("eviction", name, random.Random(self._rng.getrandbits(64)))
            self.eviction_by_name[name] = policy
        return policy

    def counters(self) -> dict[str, dict[str, int]]:
        """policy name -> its rule counters (``RoutingPolicyBase.counters``), policies that keep any."""
        out = {}
        for name, policy in self.routing.items():
            counts = getattr(policy, "counters", None)
            found = counts() if callable(counts) else {}
            if found:
                out[name] = found
        return out

    def reload(self, routing: Mapping[str, Any], extra_routing: Sequence[Mapping[str, Any]] = ()) -> list[str]:
        """Adopt new routing policy specs; rebuild only the policies whose parameters changed.

        All specs are validated before anything changes. A rebuilt policy starts with fresh
        learned state (latency models, decayed load) and sees every current worker through
        ``on_worker_added``; load the router commits per request is kept. Completions of
        requests the old object dispatched reach the new one, which ignores unknown ids.
        Returns the names of the policies replaced or added.
        """
        parsed = []
        for spec in (routing, *extra_routing):
            values = {"name": spec} if isinstance(spec, str) else dict(spec)
            name = values.pop("name", None)
            if not isinstance(name, str) or not name:
                raise ConfigError(f"routing policy spec needs a 'name', got {spec!r}")
            parsed.append((name, spec, registry.build_params("routing", name, values)))
        changed = []
        for name, spec, params in parsed:
            current = self.routing.get(name)
            if current is not None and getattr(current, "params", None) == params:
                continue
            policy = registry.build("routing", spec, random.Random(self._rng.getrandbits(64)))
            for w in self._workers:
                policy.on_worker_added(w)
            self.routing[name] = policy
            changed.append(name)
        self.default_routing = parsed[0][0]
        return changed

    def tick(self, now: float) -> None:
        """Periodic work for time-driven policies (load decay, hotness windows)."""
        for policy in self.routing.values():
            policy.tick(now)
