"""A pod's model pool, LoRA adapters and role, from llm-d's labels and kvrouterd's annotations."""

from __future__ import annotations

from kvrouterd.discovery import (
    LORAS_ANNOTATION,
    MAX_LORAS_ANNOTATION,
    MODELS_ANNOTATION,
    Change,
    KubernetesDiscoveryConfig,
    Membership,
    pod_worker_spec,
)
from kvrouterd.protocols import WorkerRole

from .fake_kube import pod

CFG = KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="8000")


def test_llm_d_labels_give_the_model_and_the_role() -> None:
    spec = pod_worker_spec(pod("p", labels={"app": "vllm", "llm-d.ai/model": "llama-3-8b", "llm-d.ai/role": "decode"}),
                           CFG)
    assert spec is not None
    assert spec.models == ("llama-3-8b",)
    assert spec.role is WorkerRole.DECODE
    assert spec.loras == () and spec.max_loras == 0


def test_a_pod_without_pool_labels_serves_any_model_in_both_roles() -> None:
    spec = pod_worker_spec(pod("p"), CFG)
    assert spec is not None
    assert spec.models == () and spec.role is WorkerRole.BOTH


def test_annotations_name_full_models_and_adapters_and_win_over_the_label() -> None:
    annotations = {MODELS_ANNOTATION: "meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.1-8B",
                   LORAS_ANNOTATION: "sql-lora,chat-lora,,sql-lora", MAX_LORAS_ANNOTATION: "4"}
    spec = pod_worker_spec(pod("p", labels={"app": "vllm", "llm-d.ai/model": "llama"}, annotations=annotations), CFG)
    assert spec is not None
    assert spec.models == ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Llama-3.1-8B")
    assert spec.loras == ("sql-lora", "chat-lora")
    assert spec.max_loras == 4


def test_bad_role_and_adapter_count_are_ignored_with_a_warning(caplog) -> None:
    spec = pod_worker_spec(pod("p", labels={"app": "vllm", "llm-d.ai/role": "encode"},
                               annotations={MAX_LORAS_ANNOTATION: "many"}), CFG)
    assert spec is not None
    assert spec.role is WorkerRole.BOTH and spec.max_loras == 0
    assert "llm-d.ai/role" in caplog.text and MAX_LORAS_ANNOTATION in caplog.text


def test_label_names_are_configurable_and_can_be_turned_off() -> None:
    cfg = KubernetesDiscoveryConfig(enabled=True, label_selector="app=vllm", port="8000", model_label="model",
                                    role_label="")
    spec = pod_worker_spec(pod("p", labels={"model": "qwen", "llm-d.ai/role": "prefill"}), cfg)
    assert spec is not None
    assert spec.models == ("qwen",) and spec.role is WorkerRole.BOTH


def test_relabelling_a_pods_pool_updates_the_worker_in_place() -> None:
    members = Membership(CFG)
    first = pod("p", labels={"app": "vllm", "llm-d.ai/model": "a"})
    assert [c.kind for c in members.upsert(first)] == ["add"]
    changes = members.upsert(pod("p", labels={"app": "vllm", "llm-d.ai/model": "b"}))
    assert changes == [Change("add", "p", members.workers["p"])]  # kept: same uid and address, cache intact
    assert members.workers["p"].models == ("b",)
