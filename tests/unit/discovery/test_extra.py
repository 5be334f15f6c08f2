"""Discovery's Kubernetes client is the optional ``discovery`` extra: a config that turns discovery
on without it fails at start-up and in ``config check``, naming the extra."""

from __future__ import annotations

import pytest

from kvrouterd.cli import main
from kvrouterd.config import parse_config
from kvrouterd.discovery import config as discovery_config
from kvrouterd.errors import ConfigError

ON = {"discovery": {"kubernetes": {"enabled": True, "label_selector": "app=vllm"}}}


@pytest.fixture
def without_client(monkeypatch):
    real = discovery_config.find_spec
    monkeypatch.setattr(discovery_config, "find_spec", lambda name: None if name == "kubernetes_asyncio" else real(name))


def test_discovery_without_the_extra_is_a_config_error_naming_it(without_client):
    with pytest.raises(ConfigError, match=r"^discovery\.kubernetes\.enabled: needs the 'discovery' extra.*"
                                          r"pip install 'kvrouterd\[discovery\]'"):
        parse_config(ON)
    parse_config({})  # discovery off: the client is not needed


def test_config_check_names_the_missing_extra(without_client, tmp_path, capsys):
    path = tmp_path / "kvrouterd.yaml"
    path.write_text("discovery: {kubernetes: {enabled: true, label_selector: app=vllm}}\n")
    assert main(["config", "check", str(path)]) == 2
    assert "needs the 'discovery' extra" in capsys.readouterr().err


def test_with_the_extra_installed_the_config_is_valid():
    assert parse_config(ON).discovery.kubernetes.enabled
