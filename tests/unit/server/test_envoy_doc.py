"""The sample envoy.yaml in docs/envoy.md is a valid Envoy bootstrap that does what the doc says."""

from __future__ import annotations

import importlib.util
import re
import tempfile
from pathlib import Path

import pytest
import yaml
from google.protobuf import descriptor_pb2, descriptor_pool, json_format, message_factory

from kvrouterd.config import parse_config
from kvrouterd.server.ext_proc import DESTINATION_ENDPOINT_HEADER, EXT_PROC_SERVICE

REPO = Path(__file__).resolve().parents[3]
DOC = REPO / "docs" / "envoy.md"
#: the Envoy messages the sample names (the Any types in typed_config among them)
BOOTSTRAP_PROTOS = (
    "envoy/config/bootstrap/v3/bootstrap.proto",
    "envoy/config/cluster/v3/cluster.proto",
    "envoy/extensions/filters/http/ext_proc/v3/ext_proc.proto",
    "envoy/extensions/filters/http/router/v3/router.proto",
    "envoy/extensions/filters/network/http_connection_manager/v3/http_connection_manager.proto",
    "envoy/extensions/upstreams/http/v3/http_protocol_options.proto",
)


def _generate_module():
    spec = importlib.util.spec_from_file_location("proto_generate", REPO / "proto" / "generate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pool() -> descriptor_pool.DescriptorPool:
    """Envoy's bootstrap API from the vendored official protos, compiled into a pool of its own (the
    daemon ships only the ext_proc part, and a private pool cannot clash with its registrations)."""
    from grpc_tools import protoc

    gen = _generate_module()
    with tempfile.TemporaryDirectory() as out:
        descriptors = Path(out) / "bootstrap.pb"
        args = ["protoc", f"-I{gen.THIRD_PARTY}", f"-I{gen.well_known_types()}", "--include_imports",
                f"--descriptor_set_out={descriptors}", *BOOTSTRAP_PROTOS]
        assert protoc.main(args) == 0
        files = descriptor_pb2.FileDescriptorSet.FromString(descriptors.read_bytes())
    built = descriptor_pool.DescriptorPool()
    for file in files.file:
        built.Add(file)
    return built


def _message(pool: descriptor_pool.DescriptorPool, name: str):
    return message_factory.GetMessageClass(pool.FindMessageTypeByName(name))()


def _yaml_blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)]


def test_sample_envoy_yaml_is_a_valid_bootstrap_with_the_protocol_modes(pool):
    (envoy,) = [b for b in _yaml_blocks() if "static_resources" in b]
    # unknown or misspelt fields raise
    boot = json_format.ParseDict(envoy, _message(pool, "envoy.config.bootstrap.v3.Bootstrap"), descriptor_pool=pool)
    hcm = _message(pool, "envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager")
    boot.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ext = _message(pool, "envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor")
    assert hcm.http_filters[0].typed_config.Unpack(ext)
    mode = ext.processing_mode
    send = pool.FindEnumTypeByName("envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.HeaderSendMode")
    body = pool.FindEnumTypeByName("envoy.extensions.filters.http.ext_proc.v3.ProcessingMode.BodySendMode")
    assert mode.request_header_mode == send.values_by_name["SEND"].number
    assert mode.response_header_mode == send.values_by_name["SEND"].number
    assert mode.request_body_mode == body.values_by_name["FULL_DUPLEX_STREAMED"].number
    assert mode.request_trailer_mode == send.values_by_name["SEND"].number
    clusters = {c.name: c for c in boot.static_resources.clusters}
    dst = clusters["original_destination_cluster"]
    cluster = pool.FindMessageTypeByName("envoy.config.cluster.v3.Cluster")
    assert dst.type == cluster.enum_values_by_name["ORIGINAL_DST"].number
    assert dst.lb_policy == cluster.enum_values_by_name["CLUSTER_PROVIDED"].number
    assert dst.original_dst_lb_config.use_http_header
    assert dst.original_dst_lb_config.http_header_name == DESTINATION_ENDPOINT_HEADER
    assert ext.grpc_service.envoy_grpc.cluster_name in clusters
    health = clusters[ext.grpc_service.envoy_grpc.cluster_name].health_checks[0]
    assert health.grpc_health_check.service_name == EXT_PROC_SERVICE


def test_sample_kvrouterd_config_is_valid_and_sends_one_endpoint():
    (cfg,) = [b for b in _yaml_blocks() if "ext_proc" in b]
    config = parse_config(cfg)
    assert config.ext_proc.enabled and config.ext_proc.max_endpoints == 1
