"""One registry builds every policy; bad specs fail naming the policy and the field."""

from __future__ import annotations

import random

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.policies import registry
from kvrouterd.policies.base import EvictionPolicy, RoutingPolicy


def test_core_policies_are_registered():
    assert {"random", "round_robin", "least_loaded", "cache_aware"} <= set(registry.names("routing"))
    assert "lru" in registry.names("eviction")


@pytest.mark.parametrize("name", registry.names("routing"))
def test_every_routing_policy_builds_with_defaults(name):
    policy = registry.build("routing", name, random.Random(0))
    assert isinstance(policy, RoutingPolicy) and policy.name == name


@pytest.mark.parametrize("name", registry.names("eviction"))
def test_every_eviction_policy_builds_with_defaults(name):
    policy = registry.build("eviction", name, random.Random(0))
    assert isinstance(policy, EvictionPolicy) and policy.name == name


def test_parameters_are_typed_and_validated():
    p = registry.build("routing", {"name": "cache_aware", "cache_threshold": 1, "balance_abs_threshold": 8})
    assert p.params.cache_threshold == 1.0 and isinstance(p.params.cache_threshold, float)
    with pytest.raises(ConfigError, match="cache_aware.cache_threshold"):
        registry.build("routing", {"name": "cache_aware", "cache_threshold": "high"})
    with pytest.raises(ConfigError, match="balance_rel_threshold"):
        registry.build("routing", {"name": "cache_aware", "balance_rel_threshold": 0.5})
    with pytest.raises(ConfigError, match="load_metric"):
        registry.build("routing", {"name": "cache_aware", "load_metric": "vibes"})
    with pytest.raises(ConfigError, match="needs a 'name'"):
        registry.build("routing", {"cache_threshold": 0.5})


def test_describe_lists_defaults_and_help():
    rows = {name: (default, help_text) for name, default, help_text in registry.describe("routing", "cache_aware")}
    assert rows["cache_threshold"][0] == 0.3 and rows["cache_threshold"][1]
