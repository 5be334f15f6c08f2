"""Configuration: defaults, file, environment and flag precedence; bad values name the field."""

from __future__ import annotations

import re

import pytest

from kvrouterd.config import load_config, parse_config
from kvrouterd.errors import ConfigError


def test_embedded_defaults_are_valid():
    cfg = load_config(environ={})
    assert cfg.listen == "127.0.0.1:50051" and cfg.block_size == 16
    assert cfg.routing == {"name": "cache_aware"} and cfg.workers == []


def test_file_then_env_then_flags(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text(
        "listen: 0.0.0.0:6000\nblock_size: 32\nrouting: {name: cache_aware, cache_threshold: 0.6}\n"
        "workers:\n  - {id: a, address: 'h:1', capacity_blocks: 100, mode: events}\n"
    )
    cfg = load_config(f, environ={})
    assert cfg.block_size == 32 and cfg.routing["cache_threshold"] == 0.6
    assert cfg.workers[0].to_spec(32).mode.name == "EVENTS"
    cfg = load_config(f, environ={"KVROUTERD_LISTEN": "127.0.0.1:7000", "KVROUTERD_BLOCK_SIZE": "64"})
    assert cfg.listen == "127.0.0.1:7000" and cfg.block_size == 64
    cfg = load_config(f, {"listen": "127.0.0.1:8000"}, environ={"KVROUTERD_LISTEN": "127.0.0.1:7000"})
    assert cfg.listen == "127.0.0.1:8000"


def test_switching_policy_by_env_drops_the_old_policys_parameters(tmp_path):
    f = tmp_path / "c.yaml"
    f.write_text("routing: {name: cache_aware, cache_threshold: 0.6}\n")
    cfg = load_config(f, environ={"KVROUTERD_ROUTING_POLICY": "round_robin"})
    assert cfg.routing == {"name": "round_robin"}


@pytest.mark.parametrize(
    "data,field",
    [
        ({"listen": "nohost"}, "listen"),
        ({"block_size": 0}, "block_size"),
        ({"block_size": "big"}, "block_size"),
        ({"routing": {"name": "nope"}}, "routing"),
        ({"routing": {"name": "cache_aware", "cache_threshold": 2}}, "cache_threshold"),
        ({"routing": {"name": "cache_aware", "typo": 1}}, "typo"),
        ({"eviction": {"name": "nope"}}, "eviction"),
        ({"workers": [{"id": "a"}]}, "workers[0].address"),
        ({"workers": [{"id": "a", "address": "h:1"}, {"id": "a", "address": "h:2"}]}, "workers[1].id"),
        ({"workers": [{"id": "a", "address": "h:1", "mode": "psychic"}]}, "workers[0].mode"),
        ({"limits": {"max_message_bytes": 10}}, "limits.max_message_bytes"),
        ({"telemetry": {"traces": "carrier-pigeon"}}, "telemetry.traces"),
        ({"unknown_key": 1}, "unknown_key"),
    ],
)
def test_bad_values_fail_naming_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert field in str(err.value)


def test_unreadable_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", environ={})
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad, environ={})


@pytest.mark.parametrize(
    ("worker", "needle"),
    [
        ({"kv_events_endpoint": "http://x:1"}, "workers[0].kv_events_endpoint"),
        ({"kv_events_endpoint": "tcp://10.0.0.5"}, "numeric port"),
        ({"address": "10.0.0.5"}, "workers[0].address"),
    ],
)
def test_bad_worker_endpoints_fail_at_start_naming_the_field(worker, needle):
    from kvrouterd.config import parse_config
    from kvrouterd.errors import ConfigError

    spec = {"id": "gpu-0", "address": "10.0.0.5:8000", "mode": "events", **worker}
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_config({"workers": [spec]})


def test_a_config_workers_endpoint_outside_the_allow_list_fails_start_up():
    """Issue #16 item 2: config-file workers obey events.allowed_endpoints like RegisterWorker."""
    worker = {"id": "w", "address": "10.0.0.5:8000", "mode": "events", "kv_events_endpoint": "tcp://10.0.0.6:5557"}
    with pytest.raises(ConfigError, match=r"workers\[0\]\.kv_events_endpoint: .*not allowed by events.allowed_endpoints"):
        parse_config({"workers": [worker]})
    with pytest.raises(ConfigError, match=r"workers\[0\]\.kv_events_endpoint: .*ipc:// endpoints are refused"):
        parse_config({"workers": [{**worker, "kv_events_endpoint": "ipc:///tmp/e.sock"}]})
    cfg = parse_config({"workers": [worker], "events": {"allowed_endpoints": ["10.0.0.0/24"]}})
    assert cfg.events.allow_list.networks
    parse_config({"workers": [{**worker, "kv_events_endpoint": "ipc:///tmp/e.sock"}],
                  "events": {"allowed_endpoints": ["ipc:///tmp/*"]}})


# ---- shorthand policy names and every problem at once (issue #29 item 11) ----------------

def test_a_bare_policy_name_is_that_policy_with_its_defaults() -> None:
    from kvrouterd.config import parse_config

    cfg = parse_config({"routing": "least_loaded", "eviction": "lru", "extra_routing": ["cache_aware", {"name": "round_robin"}]})
    assert cfg.routing == {"name": "least_loaded"} and cfg.eviction == {"name": "lru"}
    assert cfg.extra_routing == [{"name": "cache_aware"}, {"name": "round_robin"}]
    # a variable naming another policy replaces the shorthand as it replaces a mapping
    assert parse_config({"routing": "least_loaded"}, {"routing.name": "cache_aware"}).routing == {"name": "cache_aware"}
    with pytest.raises(ConfigError, match="routing: .*no_such"):
        parse_config({"routing": "no_such"})


def test_every_wrong_field_is_reported_not_the_first() -> None:
    from kvrouterd.config import parse_config

    with pytest.raises(ConfigError) as info:
        parse_config({
            "listen": "nope",
            "block_size": 0,
            "limits": {"max_prompt_tokens": "many", "inflight_timeout_s": 0, "bogus": 1},
            "workers": [{"id": "a", "address": "x"}, {"id": "a", "address": "h:1", "capacity_blocks": -1}, {"id": "b"}],
            "telemetry": {"traces": "jaeger"},
        })
    fields = [p.split(":")[0] for p in info.value.problems]
    assert sorted(fields) == sorted([
        "limits.bogus", "limits.max_prompt_tokens", "workers[2].address", "telemetry.traces", "listen", "block_size",
        "workers[0].address", "workers[1].id", "workers[1].capacity_blocks", "limits.inflight_timeout_s",
    ])
    assert str(info.value) == "\n".join(info.value.problems)
    # one problem reads as before
    with pytest.raises(ConfigError) as one:
        parse_config({"block_size": 0})
    assert one.value.problems == [str(one.value)] == ["block_size: must be in [1, 4096], got 0"]
