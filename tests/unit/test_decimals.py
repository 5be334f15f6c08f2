"""Every number the daemon parses from text is ASCII decimal (issue #28 item 10).

``str.isdigit()`` is true for '²' (which ``int()`` refuses: an uncaught ValueError) and for
other scripts' digits (which ``int()`` reads); a port or rank one component reads as a number
and libzmq or the kernel does not must be refused where it is first read.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from types import SimpleNamespace

import pytest

from kvrouterd.config import load_config
from kvrouterd.decimals import decimal_arg, number_arg, parse_decimal, parse_number
from kvrouterd.discovery import CAPACITY_ANNOTATION, KubernetesDiscoveryConfig, pod_worker_spec
from kvrouterd.errors import ConfigError
from kvrouterd.events.zmq_config import ZmqEventsConfig
from kvrouterd.index.workers import is_host_port
from kvrouterd.server.healthcheck import find_daemon
from kvrouterd.server.snapshot import SNAPSHOT_MAGIC
from tests.unit.discovery.fake_kube import pod

#: text Python's int() or isdigit() takes that no wire format means as a number
NOT_ASCII = ["²", "٥٥٥٧", "５５５７", "8_0", " 80", "80 ", "+80", "", "-", "0x50", "80\n"]


@pytest.mark.parametrize("text", NOT_ASCII)
def test_only_ascii_digits_are_a_decimal(text):
    assert parse_decimal(text) is None


def test_decimals_and_numbers_read_as_written():
    assert parse_decimal("0") == 0 and parse_decimal("08080") == 8080
    assert parse_decimal("-3") is None and parse_decimal("-3", signed=True) == -3
    assert parse_decimal("9" * 5000) is None  # past int()'s digit limit: refused, not raised
    assert [parse_number(t) for t in ("1", "-2.5", ".5", "5.", "1e3", "+4")] == [1.0, -2.5, 0.5, 5.0, 1000.0, 4.0]
    for text in ("١٫٥", "inf", "nan", "1e999", "1_0.5", " 1", ""):
        assert parse_number(text) is None


@pytest.mark.parametrize("parse", [decimal_arg, number_arg])
def test_command_line_numbers_are_ascii_too(parse):
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=parse)
    assert parser.parse_args(["--n", "5"]).n == 5
    with pytest.raises(SystemExit):
        parser.parse_args(["--n", "٥"])


@pytest.mark.parametrize("address", ["w:٨٠٨٠", "w:²", "w:8_0", "[::1]:８０"])
def test_a_worker_address_port_is_ascii(address):
    assert not is_host_port(address)


@pytest.mark.parametrize(("variable", "value"), [("KVROUTERD_BLOCK_SIZE", "١٦"), ("KVROUTERD_BLOCK_SIZE", "--16"),
                                                 ("KVROUTERD_DEFAULT_TTFT_SLO_MS", "٢٠٠"),
                                                 ("KVROUTERD_DEFAULT_TTFT_SLO_MS", "nan"),
                                                 ("KVROUTERD_LISTEN", "127.0.0.1:٥٠٠٥١"),
                                                 ("KVROUTERD_METRICS_LISTEN", "127.0.0.1:²")])
def test_config_numbers_from_text_are_ascii(variable, value):
    with pytest.raises(ConfigError):
        load_config(environ={variable: value})


def test_config_numbers_from_text_still_read():
    cfg = load_config(environ={"KVROUTERD_BLOCK_SIZE": " 64 ", "KVROUTERD_DEFAULT_TTFT_SLO_MS": "1.5e3"})
    assert (cfg.block_size, cfg.default_ttft_slo_ms) == (64, 1500.0)


def test_lora_ids_are_ascii():
    with pytest.raises(ConfigError, match="lora_ids"):
        ZmqEventsConfig(lora_ids={"٧": "sql"}).validate()
    assert ZmqEventsConfig(lora_ids={"7": "sql"}).lora_names == {7: "sql"}


def test_discovery_ports_and_capacity_are_ascii():
    with pytest.raises(ConfigError, match="port"):
        KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="٨٠٠٠").validate("discovery")
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="8000", capacity_blocks=1000)
    spec = pod_worker_spec(pod("p", annotations={CAPACITY_ANNOTATION: "٥٠٠"}), cfg)
    assert spec is not None and spec.capacity_blocks == 1000  # the annotation is no block count: ignored
    spec = pod_worker_spec(pod("p", annotations={CAPACITY_ANNOTATION: "500"}), cfg)
    assert spec is not None and spec.capacity_blocks == 500


def test_the_healthcheck_reads_only_ascii_process_ids(tmp_path: Path):
    (tmp_path / "²").mkdir()  # int("²") raised while looking for the daemon
    (tmp_path / "self").mkdir()
    assert find_daemon(tmp_path) is None


def test_an_envoy_status_header_is_ascii():
    from kvrouterd._generated.envoy.config.core.v3 import base_pb2
    from kvrouterd._generated.envoy.service.ext_proc.v3 import external_processor_pb2 as ep

    from kvrouterd.server.ext_proc import ExtProcService, _Exchange

    service = SimpleNamespace(router=SimpleNamespace(clock=SimpleNamespace(now=lambda: 1.0)))
    for value, status in (("200", 200), ("٢٠٠", 0), ("²", 0), (" 200", 0)):
        exchange = _Exchange()
        header = base_pb2.HeaderValue(key=":status", raw_value=value.encode())
        msg = ep.ProcessingRequest(response_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=[header])))
        ExtProcService._on_response_headers(service, exchange, msg)  # type: ignore[arg-type]
        assert exchange.status == status, value


def test_a_snapshot_header_number_must_be_a_json_integer():
    import asyncio
    import json

    from kvrouterd.clock import ManualClock
    from kvrouterd.errors import InvalidRequest
    from kvrouterd.router import Router, RouterSettings
    from kvrouterd.server.snapshot import restore_snapshot

    header = json.dumps({"stream_sequence": "٣", "sequences": {}, "block_size": 16}).encode()
    data = SNAPSHOT_MAGIC + len(header).to_bytes(4, "big") + header
    with pytest.raises(InvalidRequest, match="does not parse"):
        asyncio.run(restore_snapshot(Router(RouterSettings(block_size=16), ManualClock()), data))
