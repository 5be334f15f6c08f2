"""Config sections for operations: metrics, tls, auth, reload_interval_s, and their env overrides."""

from __future__ import annotations

import pytest

from kvrouterd.config import load_config, parse_config
from kvrouterd.errors import ConfigError


def test_defaults_are_off():
    cfg = parse_config({})
    assert cfg.metrics.listen == "" and not cfg.tls.enabled and not cfg.auth.enabled
    assert cfg.auth.protect == ["RegisterWorker", "DeregisterWorker", "PublishEvents", "ReportLoad", "EvictHint", "ExportIndex"]
    assert cfg.reload_interval_s == 5.0


@pytest.mark.parametrize(
    "data,field",
    [
        ({"metrics": {"listen": "9464"}}, "metrics.listen"),
        ({"tls": {"cert_file": "a.crt"}}, "tls"),
        ({"tls": {"key_file": "a.key"}}, "tls"),
        ({"tls": {"ca_file": "ca.crt"}}, "tls.ca_file"),
        ({"tls": {"cert_file": "a", "key_file": "b", "require_client_cert": True}}, "tls.require_client_cert"),
        ({"auth": {"token_file": "t", "token_env": "T"}}, "auth"),
        ({"auth": {"token_env": "T", "protect": []}}, "auth.protect"),
        ({"auth": {"token_env": "T", "protect": ["RegisterWorker", "Rout"]}}, "auth.protect[1]"),
        ({"auth": {"tokens": "x"}}, "auth.tokens"),
        ({"reload_interval_s": -1}, "reload_interval_s"),
    ],
)
def test_bad_values_name_the_field(data, field):
    with pytest.raises(ConfigError) as err:
        parse_config(data)
    assert str(err.value).startswith(field)


def test_environment_sets_the_operations_sections():
    cfg = load_config(environ={
        "KVROUTERD_METRICS_LISTEN": "0.0.0.0:9464",
        "KVROUTERD_TLS_CERT_FILE": "/tls/tls.crt",
        "KVROUTERD_TLS_KEY_FILE": "/tls/tls.key",
        "KVROUTERD_TLS_CA_FILE": "/tls/ca.crt",
        "KVROUTERD_TLS_REQUIRE_CLIENT_CERT": "true",
        "KVROUTERD_AUTH_TOKEN_ENV": "ROUTER_TOKEN",
    })
    assert cfg.metrics.listen == "0.0.0.0:9464"
    assert cfg.tls.enabled and cfg.tls.require_client_cert and cfg.tls.ca_file == "/tls/ca.crt"
    assert cfg.auth.enabled and cfg.auth.token_env == "ROUTER_TOKEN"
