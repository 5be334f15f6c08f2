"""The sample envoy.yaml in docs/envoy.md is a valid Envoy bootstrap that does what the doc says."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from envoy.config.bootstrap.v3 import bootstrap_pb2
from envoy.config.cluster.v3 import cluster_pb2
from envoy.extensions.filters.http.ext_proc.v3 import ext_proc_pb2, processing_mode_pb2
from envoy.extensions.filters.http.router.v3 import router_pb2  # noqa: F401 - registers the Any type
from envoy.extensions.filters.network.http_connection_manager.v3 import http_connection_manager_pb2 as hcm_pb2
from envoy.extensions.upstreams.http.v3 import http_protocol_options_pb2  # noqa: F401 - registers the Any type
from google.protobuf import json_format

from kvrouterd.config import parse_config
from kvrouterd.server.ext_proc import DESTINATION_ENDPOINT_HEADER, EXT_PROC_SERVICE

DOC = Path(__file__).resolve().parents[3] / "docs" / "envoy.md"


def _yaml_blocks() -> list[dict]:
    return [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", DOC.read_text(), re.DOTALL)]


def test_sample_envoy_yaml_is_a_valid_bootstrap_with_the_protocol_modes():
    (envoy,) = [b for b in _yaml_blocks() if "static_resources" in b]
    boot = json_format.ParseDict(envoy, bootstrap_pb2.Bootstrap())  # unknown or misspelt fields raise
    hcm = hcm_pb2.HttpConnectionManager()
    boot.static_resources.listeners[0].filter_chains[0].filters[0].typed_config.Unpack(hcm)
    ext = ext_proc_pb2.ExternalProcessor()
    assert hcm.http_filters[0].typed_config.Unpack(ext)
    mode, pm = ext.processing_mode, processing_mode_pb2.ProcessingMode
    assert mode.request_header_mode == pm.SEND and mode.response_header_mode == pm.SEND
    assert mode.request_body_mode == pm.FULL_DUPLEX_STREAMED and mode.request_trailer_mode == pm.SEND
    clusters = {c.name: c for c in boot.static_resources.clusters}
    dst = clusters["original_destination_cluster"]
    assert dst.type == cluster_pb2.Cluster.ORIGINAL_DST and dst.lb_policy == cluster_pb2.Cluster.CLUSTER_PROVIDED
    assert dst.original_dst_lb_config.use_http_header
    assert dst.original_dst_lb_config.http_header_name == DESTINATION_ENDPOINT_HEADER
    assert ext.grpc_service.envoy_grpc.cluster_name in clusters
    health = clusters[ext.grpc_service.envoy_grpc.cluster_name].health_checks[0]
    assert health.grpc_health_check.service_name == EXT_PROC_SERVICE


def test_sample_kvrouterd_config_is_valid_and_sends_one_endpoint():
    (cfg,) = [b for b in _yaml_blocks() if "ext_proc" in b]
    config = parse_config(cfg)
    assert config.ext_proc.enabled and config.ext_proc.max_endpoints == 1
