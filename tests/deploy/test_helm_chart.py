"""The Helm chart, rendered and linted by Helm itself.

``helm-python-sdk`` bundles Helm's Go SDK (``helm_python.helm_sdk_version()``), so the chart is
rendered, linted and its values validated against values.schema.json by the real engine, offline
and without a ``helm`` binary. Every rendered manifest is then checked against the Kubernetes
OpenAPI schemas of the oldest version the chart supports (Chart.yaml ``kubeVersion``) and of the
newest one ``kubernetes-validate`` ships, strictly (unknown fields are errors). The config file
the ConfigMap carries is loaded by kvrouterd's own config loader.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml

from kvrouterd.config import Config, load_config

from .dockerfile import parse as parse_dockerfile

ROOT = Path(__file__).resolve().parents[2]
CHART = ROOT / "helm" / "kvrouterd"
VALUES_DIR = Path(__file__).parent / "values"
EXAMPLES = sorted(VALUES_DIR.glob("*.yaml"))
BAD_EXAMPLES = sorted((VALUES_DIR / "bad").glob("*.yaml"))
RELEASE, NAMESPACE = "kvr", "llm"

# Custom resources of the Prometheus Operator: their schemas are CRDs installed with the
# operator, not part of the Kubernetes OpenAPI that kubernetes-validate ships. They are checked
# by the tests that use them (the ServiceMonitor's selector and port, the alert expressions
# against a real scrape in test_dashboards.py), and this list is kept honest below.
CUSTOM_RESOURCES = {("monitoring.coreos.com/v1", "ServiceMonitor"), ("monitoring.coreos.com/v1", "PrometheusRule")}


def load_yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def min_kube_version() -> str:
    """The oldest Kubernetes release Chart.yaml's ``kubeVersion`` admits, as ``1.27.0``."""
    constraint = load_yaml(CHART / "Chart.yaml")["kubeVersion"]
    m = re.fullmatch(r">=\s*v?(\d+)\.(\d+)\.(\d+)(-0)?", constraint)
    assert m, f"kubeVersion {constraint!r} is not a plain lower bound"
    return f"{m[1]}.{m[2]}.{m[3]}"


KUBE_VERSIONS = [min_kube_version(), kubernetes_validate.latest_version() + ".0"]


@pytest.fixture(scope="module")
def chart() -> typing.Iterator[helm.Chart]:
    with helm.Chart.load(CHART) as c:
        yield c


def render(chart: helm.Chart, values: dict[str, Any] | None) -> dict[str, str]:
    """Template path -> rendered text, as ``helm template kvr ./helm/kvrouterd -n llm -f ...``."""
    return chart.render(values or {}, name=RELEASE, namespace=NAMESPACE, is_install=True)


def manifests(chart: helm.Chart, values: dict[str, Any] | None) -> list[dict[str, Any]]:
    out = []
    for path, text in sorted(render(chart, values).items()):
        if path.endswith(".yaml"):
            out += [doc for doc in yaml.safe_load_all(text) if doc]
    return out


def by_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


def one(docs: list[dict[str, Any]], kind: str) -> dict[str, Any]:
    (doc,) = by_kind(docs, kind)
    return doc


def deployment(docs: list[dict[str, Any]], component: str = "router") -> dict[str, Any]:
    """The replicas' Deployment (``component="bridge"``: the ZMQ bridge's, with eventBus.bridge)."""
    (d,) = [d for d in by_kind(docs, "Deployment") if d["metadata"]["labels"]["app.kubernetes.io/component"] == component]
    return d


def container(docs: list[dict[str, Any]], component: str = "router") -> dict[str, Any]:
    (c,) = deployment(docs, component)["spec"]["template"]["spec"]["containers"]
    return c


CASES = [None, *EXAMPLES]
CASE_IDS = ["defaults", *(p.stem for p in EXAMPLES)]


def case_values(case: Path | None) -> dict[str, Any] | None:
    return load_yaml(case) if case else None


# ---- Chart.yaml and lint -------------------------------------------------------------

def test_chart_yaml_is_a_valid_v2_application_chart(chart: helm.Chart) -> None:
    assert chart.metadata["apiVersion"] == "v2"
    assert chart.name == CHART.name
    assert chart.metadata["type"] == "application"
    # the default image tag is the appVersion: it must be the package version the image holds
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert chart.metadata["appVersion"] == project["version"]
    assert min_kube_version() == "1.27.0"  # native gRPC probes are GA from 1.27


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_helm_lint_is_clean(case: Path | None) -> None:
    # with values.schema.json enforced, as `helm lint --strict -f FILE` in a user's CI
    for kube_version in KUBE_VERSIONS:
        report = helm.lint(CHART, case_values(case), strict=True, namespace=NAMESPACE,
                           kube_version="v" + kube_version, skip_schema_validation=False)
        findings = [m for m in report["messages"] if m["severity"] >= 2]  # warnings and errors
        assert not findings and not report["errors"], (kube_version, findings, report["errors"])


# ---- rendered manifests against the Kubernetes schemas --------------------------------

@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_every_manifest_is_valid_kubernetes(chart: helm.Chart, case: Path | None) -> None:
    docs = manifests(chart, case_values(case))
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount"} <= {d["kind"] for d in docs}
    for doc in docs:
        where = f"{doc['kind']}/{doc['metadata']['name']}"
        assert doc["metadata"].get("namespace") in (NAMESPACE, None) or doc["kind"] in ("Role", "RoleBinding"), where
        if (doc["apiVersion"], doc["kind"]) in CUSTOM_RESOURCES:
            continue
        for kube_version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, kube_version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{where} is not valid Kubernetes {kube_version}: {exc.message} at {list(exc.path)}")


@pytest.mark.parametrize("api_version_kind", sorted(CUSTOM_RESOURCES))
def test_custom_resources_are_really_not_in_the_core_schemas(api_version_kind: tuple[str, str]) -> None:
    api_version, kind = api_version_kind
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        kubernetes_validate.validate({"apiVersion": api_version, "kind": kind, "metadata": {"name": "x"}},
                                     KUBE_VERSIONS[-1], strict=True)


def test_the_validator_catches_a_broken_manifest(chart: helm.Chart) -> None:
    router = deployment(manifests(chart, None))
    router["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(router, KUBE_VERSIONS[0], strict=True)


# ---- values.schema.json, enforced by Helm ---------------------------------------------

def test_there_are_good_and_bad_values_files() -> None:
    assert len(EXAMPLES) >= 2 and len(BAD_EXAMPLES) >= 20


@pytest.mark.parametrize("bad", BAD_EXAMPLES, ids=lambda p: p.stem)
def test_bad_values_are_rejected_by_helm(chart: helm.Chart, bad: Path) -> None:
    text = bad.read_text()
    m = re.search(r"^# rejected: (.+)$", text, re.M)
    assert m, f"{bad.name} must say what Helm reports: '# rejected: at ...'"
    values = yaml.safe_load(text)
    with pytest.raises(helm.HelmValuesError) as info:
        render(chart, values)
    assert m[1] in str(info.value), str(info.value)


def test_schema_is_draft_7(chart: helm.Chart) -> None:
    schema = chart.schema
    assert schema is not None
    jsonschema.Draft7Validator.check_schema(schema)


def test_every_schema_property_is_a_value(chart: helm.Chart) -> None:
    def walk(node: dict[str, Any], path: tuple[str, ...]) -> list[tuple[str, ...]]:
        out = []
        for key, sub in node.get("properties", {}).items():
            out.append((*path, key))
            out += walk(sub, (*path, key))
        return out

    def has(tree: Any, path: tuple[str, ...]) -> bool:
        for key in path:
            if not isinstance(tree, dict) or key not in tree:
                return False
            tree = tree[key]
        return True

    # config is open-ended by design (its keys are kvrouterd's and checked below); global is Helm's
    assert chart.schema is not None
    missing = [p for p in walk(chart.schema, ()) if p[0] not in ("config", "global") and not has(chart.values, p)]
    assert not missing, f"schema keys without a default in values.yaml: {missing}"


def _literal_args(t: Any) -> tuple[Any, ...] | None:
    return typing.get_args(t) if typing.get_origin(t) is typing.Literal else None


def _check_against(cls: Any, node: dict[str, Any], where: str) -> None:
    hints = typing.get_type_hints(cls)
    fields = {f.name for f in dataclasses.fields(cls)}
    for key, sub in node.get("properties", {}).items():
        assert key in fields, f"{where}.{key} is not a kvrouterd setting"
        t = hints[key]
        if dataclasses.is_dataclass(t):
            _check_against(t, sub, f"{where}.{key}")
        elif (allowed := _literal_args(t)) is not None:
            assert set(sub["enum"]) == set(allowed), f"{where}.{key}"
        elif t is bool:
            assert sub.get("type") == "boolean", f"{where}.{key}"
        elif t is int:
            assert sub.get("type") == "integer", f"{where}.{key}"
        elif t is float:
            assert sub.get("type") == "number", f"{where}.{key}"


def test_schema_config_section_mirrors_kvrouterd_config(chart: helm.Chart) -> None:
    assert chart.schema is not None
    node = chart.schema["properties"]["config"]
    # every section the schema describes is a kvrouterd setting of the same shape and enums
    _check_against(Config, node, "config")
    hints = typing.get_type_hints(Config)
    for name, sub in node["properties"].items():
        if dataclasses.is_dataclass(hints[name]):
            assert sub.get("additionalProperties") is False, f"config.{name} must reject unknown keys"
    # A top-level key the schema does not know yet passes it (kvrouterd rejects a truly unknown
    # one at start-up, naming it), so a new daemon setting never makes the chart uninstallable.
    chart.validate_schema({"config": {"a_future_setting": 1}})


# ---- the config file in the ConfigMap ------------------------------------------------

def config_map(docs: list[dict[str, Any]]) -> dict[str, Any]:
    """The ConfigMap holding kvrouterd's config file (another may hold the Grafana dashboard)."""
    (cm,) = [d for d in by_kind(docs, "ConfigMap") if "config.yaml" in d["data"]]
    return cm


def rendered_config(docs: list[dict[str, Any]]) -> str:
    return config_map(docs)["data"]["config.yaml"]


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_configmap_is_a_config_kvrouterd_loads(chart: helm.Chart, case: Path | None, tmp_path: Path) -> None:
    values = case_values(case)
    docs = manifests(chart, values)
    merged = chart.merge_values(values)
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(docs))
    cfg = load_config(path, environ={})
    assert cfg.block_size == merged["config"]["block_size"]
    assert cfg.discovery.kubernetes.enabled == merged["config"]["discovery"]["kubernetes"]["enabled"]
    assert cfg.metrics.listen == (f"{merged['bindAddress']}:{merged['ports']['metrics']}"
                                  if merged["metrics"]["enabled"] else "")
    assert cfg.tls.enabled is merged["tls"]["enabled"]
    assert cfg.auth.enabled is merged["auth"]["enabled"]
    # the container reads exactly that file, from a directory mount: with subPath the kubelet
    # would never update the file and the daemon could not hot-reload policy parameters
    c = container(docs)
    args = c["args"]
    assert args[args.index("--config") + 1] == "/etc/kvrouterd/config/config.yaml"
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "config"]
    assert mount == {"name": "config", "mountPath": "/etc/kvrouterd/config", "readOnly": True}
    (volume,) = [v for v in deployment(docs)["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config_map(docs)["metadata"]["name"]


def test_tls_and_auth_files_are_where_the_config_points(chart: helm.Chart, tmp_path: Path) -> None:
    values = load_yaml(VALUES_DIR / "static-tls.yaml")
    docs = manifests(chart, values)
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(docs))
    cfg = load_config(path, environ={})
    mounts = {m["name"]: m for m in container(docs)["volumeMounts"]}
    volumes = {v["name"]: v for v in deployment(docs)["spec"]["template"]["spec"]["volumes"]}
    assert mounts["tls"]["readOnly"] and mounts["auth"]["readOnly"]
    assert volumes["tls"]["secret"]["secretName"] == values["tls"]["secretName"]
    assert volumes["auth"]["secret"]["secretName"] == values["auth"]["secretName"]
    for file in (cfg.tls.cert_file, cfg.tls.key_file, cfg.tls.ca_file):
        assert Path(file).parent == Path(mounts["tls"]["mountPath"])
    assert cfg.tls.require_client_cert is True
    assert Path(cfg.auth.token_file) == Path(mounts["auth"]["mountPath"]) / "token"


def test_config_sections_the_chart_owns_are_refused_under_config(chart: helm.Chart) -> None:
    for owned in ("listen", "metrics", "tls", "auth"):
        with pytest.raises(helm.HelmValuesError):
            chart.validate_schema({"config": {owned: {}}})


def test_config_change_rolls_the_pods_only_when_asked(chart: helm.Chart) -> None:
    def annotations(values: dict[str, Any]) -> dict[str, str]:
        meta = deployment(manifests(chart, values))["spec"]["template"]["metadata"]
        return meta.get("annotations") or {}

    assert "checksum/config" not in annotations({})
    a = annotations({"rolloutOnConfigChange": True})["checksum/config"]
    b = annotations({"rolloutOnConfigChange": True, "config": {"block_size": 32}})["checksum/config"]
    assert a != b


# ---- the pod ---------------------------------------------------------------------------

def test_probes_ask_the_grpc_health_service_on_the_grpc_port(chart: helm.Chart) -> None:
    docs = manifests(chart, {"ports": {"grpc": 6000}})
    c = container(docs)
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        assert c[probe]["grpc"] == {"port": 6000, "service": ""}, probe
    assert c["args"][c["args"].index("--listen") + 1] == "0.0.0.0:6000"
    assert {"name": "grpc", "containerPort": 6000, "protocol": "TCP"} in c["ports"]
    svc_ports = {p["name"]: p for p in one(docs, "Service")["spec"]["ports"]}
    assert svc_ports["grpc"]["targetPort"] == "grpc" and svc_ports["metrics"]["targetPort"] == "metrics"


def test_with_tls_the_probe_dials_the_grpc_port_over_tls(chart: helm.Chart) -> None:
    values = load_yaml(VALUES_DIR / "static-tls.yaml")
    values["ports"] = {"grpc": 6000}
    c = container(manifests(chart, values))
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["python", "-c"], probe
        script = command[2]
        assert "'127.0.0.1:6000'" in script and "ssl_channel_credentials" in script
        assert f"('grpc.ssl_target_name_override', '{values['tls']['serverName']}')" in script
        assert "/etc/kvrouterd/tls/tls.key" in script  # mTLS: the server's own pair is the client cert
        compile(script, probe, "exec")


def test_security_context_defaults_lock_the_pod_down(chart: helm.Chart) -> None:
    spec = deployment(manifests(chart, None))["spec"]["template"]["spec"]
    sc, psc = spec["containers"][0]["securityContext"], spec["securityContext"]
    assert sc["runAsNonRoot"] is True and psc["runAsNonRoot"] is True
    assert sc["allowPrivilegeEscalation"] is False and sc["privileged"] is False
    assert sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"] == {"drop": ["ALL"]}
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    # a read-only root still gets a small writable /tmp
    (tmp,) = [m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == "/tmp"]
    assert "emptyDir" in next(v for v in spec["volumes"] if v["name"] == tmp["name"])


def test_chart_and_image_agree_on_user_and_ports(chart: helm.Chart) -> None:
    df = parse_dockerfile((ROOT / "Dockerfile").read_text())
    user = df.final.last("USER")
    assert user is not None
    uid, _, gid = user.args.partition(":")
    psc = deployment(manifests(chart, None))["spec"]["template"]["spec"]["securityContext"]
    assert (psc["runAsUser"], psc["runAsGroup"]) == (int(uid), int(gid))
    exposed = {int(p) for e in df.final.all("EXPOSE") for p in e.args.split()}
    assert {chart.values["ports"]["grpc"], chart.values["ports"]["metrics"]} == exposed


def test_otlp_export_is_configured_through_standard_variables(chart: helm.Chart) -> None:
    def env(values: dict[str, Any] | None) -> dict[str, str]:
        return {e["name"]: e.get("value", "") for e in container(manifests(chart, values)).get("env", [])}

    assert not [k for k in env(None) if k.startswith("OTEL_")]
    on = env(load_yaml(VALUES_DIR / "discovery.yaml"))
    assert on["OTEL_TRACES_EXPORTER"] == "otlp"
    assert on["OTEL_EXPORTER_OTLP_ENDPOINT"] == "http://otel-collector.observability:4317"
    assert on["OTEL_EXPORTER_OTLP_PROTOCOL"] == "grpc"
    assert on["OTEL_SERVICE_NAME"]
    assert on["OTEL_RESOURCE_ATTRIBUTES"] == \
        "k8s.pod.name=$(POD_NAME),k8s.namespace.name=$(POD_NAMESPACE),deployment.environment=prod"


def test_discovery_rbac_is_read_only_on_pods_and_only_with_discovery(chart: helm.Chart) -> None:
    off = manifests(chart, None)
    assert not by_kind(off, "Role") and not by_kind(off, "RoleBinding") and not by_kind(off, "ClusterRole")
    assert deployment(off)["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    on = manifests(chart, load_yaml(VALUES_DIR / "discovery.yaml"))
    role, binding = one(on, "Role"), one(on, "RoleBinding")
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert role["metadata"]["namespace"] == "llm"  # the watched namespace from the values file
    assert binding["roleRef"]["name"] == role["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": one(on, "ServiceAccount")["metadata"]["name"],
                                    "namespace": NAMESPACE}]
    assert not by_kind(on, "ClusterRole")
    assert deployment(on)["spec"]["template"]["spec"]["automountServiceAccountToken"] is True


# several replicas: the PodDisruptionBudget and the autoscaler need them, and they the headless Service
SEVERAL = {"replicaCount": 2, "service": {"headless": True}}


@pytest.mark.parametrize(
    ("kind", "switch", "context"),
    [
        ("ServiceMonitor", {"metrics": {"serviceMonitor": {"enabled": True}}}, {}),
        ("PrometheusRule", {"metrics": {"prometheusRule": {"enabled": True}}}, {}),
        ("PodDisruptionBudget", {"podDisruptionBudget": {"enabled": True}}, SEVERAL),
        ("HorizontalPodAutoscaler", {"autoscaling": {"enabled": True, "minReplicas": 2}}, SEVERAL),
        ("NetworkPolicy", {"networkPolicy": {"enabled": True}}, {}),
    ],
)
def test_optional_objects_follow_their_switch(chart: helm.Chart, kind: str, switch: dict[str, Any],
                                              context: dict[str, Any]) -> None:
    section = next(iter(switch))
    off = json.loads(json.dumps(switch).replace("true", "false"))
    assert not by_kind(manifests(chart, {**context, **off}), kind), section
    assert len(by_kind(manifests(chart, {**context, **switch}), kind)) == 1, section


def test_no_disruption_budget_over_a_single_replica(chart: helm.Chart) -> None:
    # minAvailable 1 over one pod would block every node drain
    assert not by_kind(manifests(chart, None), "PodDisruptionBudget")
    assert not by_kind(manifests(chart, {"autoscaling": {"enabled": True, "minReplicas": 1}, **SEVERAL}),
                       "PodDisruptionBudget")
    (pdb,) = by_kind(manifests(chart, SEVERAL), "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1 and "maxUnavailable" not in pdb["spec"]


def test_the_documented_pdb_switch_lints_clean_with_the_schema() -> None:
    # docs/deploy.md: "maxUnavailable: 1" alone switches the budget (no null for minAvailable)
    values = {**SEVERAL, "podDisruptionBudget": {"maxUnavailable": 1}}
    report = helm.lint(CHART, values, strict=True, namespace=NAMESPACE, skip_schema_validation=False)
    assert not report["errors"] and not [m for m in report["messages"] if m["severity"] >= 2], report
    with helm.Chart.load(CHART) as c:
        (pdb,) = by_kind(manifests(c, values), "PodDisruptionBudget")
    assert pdb["spec"]["maxUnavailable"] == 1 and "minAvailable" not in pdb["spec"]


def test_one_replica_by_default_and_several_only_with_a_consistent_topology(chart: helm.Chart) -> None:
    assert chart.values["replicaCount"] == 1
    assert deployment(manifests(chart, None))["spec"]["replicas"] == 1
    for fine in ({"replicaCount": 3, "service": {"headless": True}},
                 {"replicaCount": 3, "eventBus": {"enabled": True, "url": "nats://nats:4222"}},
                 {"autoscaling": {"enabled": True, "maxReplicas": 1}}):
        chart.validate_schema(fine)
    with pytest.raises(helm.HelmValuesError, match="each replica keeps its own index"):
        chart.validate_schema({"replicaCount": 3})
    # the reason is not Helm's alone: the Python jsonschema validator refuses the same values
    assert chart.schema is not None
    defaults = chart.merge_values({"replicaCount": 3})
    errors = list(jsonschema.Draft7Validator(chart.schema).iter_errors(defaults))
    assert errors and "more than one replica needs eventBus.enabled or service.headless" in str(errors[0].context)


def test_auth_is_on_by_default_with_a_generated_token_secret(chart: helm.Chart, tmp_path: Path) -> None:
    docs = manifests(chart, None)
    (secret,) = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == "kvr-kvrouterd-auth"
    token = base64.b64decode(secret["data"]["token"]).decode()
    assert re.fullmatch(r"[A-Za-z0-9]{48}", token)
    (volume,) = [v for v in deployment(docs)["spec"]["template"]["spec"]["volumes"] if v["name"] == "auth"]
    assert volume["secret"]["secretName"] == "kvr-kvrouterd-auth"
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(docs))
    auth = load_config(path, environ={}).auth
    assert auth.token_file == "/etc/kvrouterd/auth/token"
    assert {"PublishEvents", "RegisterWorker", "DeregisterWorker"} <= set(auth.protect)
    # an upgrade keeps the token engines already hold: the template reads the live Secret back
    # (`lookup`, which an offline render cannot exercise) before it generates one
    template = (CHART / "templates" / "auth-secret.yaml").read_text()
    assert 'lookup "v1" "Secret" .Release.Namespace $name' in template
    # a named Secret replaces the generated one; auth off renders none
    assert not by_kind(manifests(chart, {"auth": {"secretName": "mine"}}), "Secret")
    assert not by_kind(manifests(chart, {"auth": {"enabled": False}}), "Secret")


def test_the_grafana_dashboard_configmap_follows_its_switch(chart: helm.Chart) -> None:
    def dashboards(values: dict[str, Any]) -> list[dict[str, Any]]:
        return [d for d in by_kind(manifests(chart, values), "ConfigMap") if "kvrouterd.json" in d["data"]]

    assert not dashboards({})
    (cm,) = dashboards({"grafana": {"dashboard": {"enabled": True, "labels": {"dash": "yes"}}}})
    assert cm["metadata"]["labels"]["dash"] == "yes"
    assert json.loads(cm["data"]["kvrouterd.json"])["uid"] == "kvrouterd"


def test_service_monitor_scrapes_the_metrics_port_of_this_release(chart: helm.Chart) -> None:
    docs = manifests(chart, load_yaml(VALUES_DIR / "discovery.yaml"))
    monitor, service = one(docs, "ServiceMonitor"), one(docs, "Service")
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert monitor["metadata"]["labels"]["release"] == "prometheus"
    # metrics off: no ServiceMonitor or alerts even if asked for them
    off = manifests(chart, {"metrics": {"enabled": False, "serviceMonitor": {"enabled": True},
                                        "prometheusRule": {"enabled": True}}})
    assert not by_kind(off, "ServiceMonitor") and not by_kind(off, "PrometheusRule")
    # the alerts select the job the ServiceMonitor gives the series: the Service's name
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["metadata"]["labels"]["release"] == "prometheus"
    for r in rule["spec"]["groups"][0]["rules"]:
        assert f'job="{service["metadata"]["name"]}", namespace="{NAMESPACE}"' in r["expr"], r["alert"]


def test_every_value_is_documented_in_the_deployment_guide(chart: helm.Chart) -> None:
    guide = (ROOT / "docs" / "deploy.md").read_text()
    table = guide.split("### Values reference")[1].split("\n## ")[0]
    for key, sub in chart.values.items():
        assert f"`{key}" in table, f"{key} is missing from the values reference in docs/deploy.md"
        if isinstance(sub, dict) and key not in ("config", "resources", "podSecurityContext", "securityContext"):
            for child in sub:
                assert child in table, f"{key}.{child} is missing from the values reference"


def test_notes_tell_how_to_reach_the_daemon_as_it_is_configured(chart: helm.Chart) -> None:
    plain = render(chart, None)["kvrouterd/templates/NOTES.txt"]
    assert "grpcurl -plaintext localhost:50051 grpc.health.v1.Health/Check" in plain
    mtls = render(chart, load_yaml(VALUES_DIR / "static-tls.yaml"))["kvrouterd/templates/NOTES.txt"]
    assert "-plaintext" not in mtls
    assert "grpcurl -cacert ca.crt -servername kvrouterd.llm.svc -cert client.crt -key client.key localhost:50051" in mtls
    on = render(chart, load_yaml(VALUES_DIR / "discovery.yaml"))["kvrouterd/templates/NOTES.txt"]
    assert "Alerts: PrometheusRule kvr-kvrouterd" in on and "ConfigMap kvr-kvrouterd-dashboard" in on


# ---- the event bus and the ZMQ bridge ----------------------------------------------------

def test_the_bus_switch_wires_every_replica_and_the_bridge_to_the_nats_url(chart: helm.Chart, tmp_path: Path) -> None:
    values = load_yaml(VALUES_DIR / "nats-bus.yaml")
    docs = manifests(chart, values)
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(docs))
    cfg = load_config(path, environ={})
    bus = cfg.events.bus
    assert bus.enabled and bus.url == values["eventBus"]["url"]
    # the bus's fine-tuning under config.events.bus reaches the daemon beside the chart's kind/url
    assert bus.stream == "KVROUTER_EVENTS_LLAMA" and bus.snapshot_interval_s == 120
    assert bus.replica_sync.enabled and bus.replica_sync.stream == "KVROUTER_LOAD_LLAMA"
    assert cfg.events.replay_timeout_s == 1.5

    # the bridge reads the very file the replicas read, and exactly one bridge pod ever runs
    bridge = deployment(docs, "bridge")
    assert bridge["spec"]["replicas"] == 1 and bridge["spec"]["strategy"] == {"type": "Recreate"}
    c = container(docs, "bridge")
    assert c["args"] == ["bridge", "--config", "/etc/kvrouterd/config/config.yaml", "--max-pending", "50000"]
    (volume,) = [v for v in bridge["spec"]["template"]["spec"]["volumes"] if v["name"] == "config"]
    assert volume["configMap"]["name"] == config_map(docs)["metadata"]["name"]
    assert c["livenessProbe"]["httpGet"] == {"path": "/metrics", "port": "metrics"}
    # discovery finds the engines for the bridge too: it gets the API token
    assert bridge["spec"]["template"]["spec"]["automountServiceAccountToken"] is True
    assert container(docs)["args"][0] == "serve"

    # the router's Service, PDB and NetworkPolicy never select the bridge pod (it serves no gRPC)
    bridge_labels = bridge["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        doc = one(docs, kind)
        selector = doc["spec"]["selector"] if kind == "Service" else doc["spec"][
            "selector" if kind == "PodDisruptionBudget" else "podSelector"]["matchLabels"]
        assert not selector.items() <= bridge_labels.items(), kind
    assert not deployment(docs)["spec"]["selector"]["matchLabels"].items() <= bridge_labels.items()


def test_without_the_switch_there_is_no_bus_and_no_bridge(chart: helm.Chart, tmp_path: Path) -> None:
    docs = manifests(chart, {"eventBus": {"url": "nats://nats:4222", "bridge": {"enabled": False}}})
    assert [d["metadata"]["name"] for d in by_kind(docs, "Deployment")] == ["kvr-kvrouterd"]
    path = tmp_path / "config.yaml"
    path.write_text(rendered_config(docs))
    assert not load_config(path, environ={}).events.bus.enabled
    # the bus alone (engines publishing through the SDK): no bridge either
    on = manifests(chart, {"eventBus": {"enabled": True, "url": "nats://nats:4222"}})
    assert [d["metadata"]["name"] for d in by_kind(on, "Deployment")] == ["kvr-kvrouterd"]


def test_notes_say_where_the_events_come_from(chart: helm.Chart) -> None:
    notes = render(chart, load_yaml(VALUES_DIR / "nats-bus.yaml"))["kvrouterd/templates/NOTES.txt"]
    assert "NATS JetStream stream at nats://nats.nats:4222" in notes and "deploy/kvr-kvrouterd-bridge" in notes
    assert "publish KV events to every replica" not in notes
