"""From Kubernetes pod objects to worker membership changes (pure: no I/O, no asyncio).

A pod is a worker when it has an IP, is not terminating, and (by default) is Ready. Its
worker id is ``id_prefix + pod name``; its address is ``IP:port``; its KV-event endpoint is
``tcp://IP:kv_events_port`` when that port is configured (the worker is then in events
mode, otherwise approximate), and ``tcp://IP:kv_replay_port`` is where it replays missed
batches. A pod annotation ``kvrouterd.io/capacity-blocks`` overrides the configured capacity.

Its model pool and role follow llm-d's pod labels, which its charts set and InferencePools
select on: ``llm-d.ai/model`` (the model, in a label's charset: llm-d's charts put a short
form of the name there) and ``llm-d.ai/role`` (``prefill``, ``decode`` or ``both``); both label
names are configurable. Neither llm-d nor the Gateway API Inference Extension names labels
for LoRA adapters (the extension learns them from ``vllm:lora_requests_info``), so those are
annotations, whose values may hold any name: ``kvrouterd.io/models`` (the full model names
requests carry, comma-separated; wins over the label), ``kvrouterd.io/loras`` and
``kvrouterd.io/max-loras`` (vLLM's ``--max-loras``).

``Membership`` keeps the current set and turns each list or watch event into the smallest
list of ``Change``s: a pod that turns un-Ready is removed, a pod recreated under the same
name (new uid, new IP) is removed and added back because its cache is empty, and a label,
pool or capacity change is an in-place update (an ``add`` of a known id) so the index is kept.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

from ..decimals import parse_decimal
from ..index.workers import MAX_LORAS, MAX_POOL_NAMES, WorkerSpec
from ..protocols import CacheMode, WorkerRole
from .config import KubernetesDiscoveryConfig

__all__ = [
    "CAPACITY_ANNOTATION",
    "LORAS_ANNOTATION",
    "MAX_LORAS_ANNOTATION",
    "MODELS_ANNOTATION",
    "Change",
    "Membership",
    "pod_worker_spec",
    "replay_endpoint",
]

log = logging.getLogger("kvrouterd.discovery")

CAPACITY_ANNOTATION = "kvrouterd.io/capacity-blocks"
MODELS_ANNOTATION = "kvrouterd.io/models"
LORAS_ANNOTATION = "kvrouterd.io/loras"
MAX_LORAS_ANNOTATION = "kvrouterd.io/max-loras"

_ROLES = {"prefill": WorkerRole.PREFILL, "decode": WorkerRole.DECODE, "both": WorkerRole.BOTH}


def _names(value: object) -> tuple[str, ...]:
    """A comma-separated annotation as names, blanks dropped, each once."""
    return tuple(dict.fromkeys(n.strip() for n in str(value).split(",") if n.strip()))


def _pool(name: str, meta: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> dict[str, Any]:
    """The pod's models, adapters, adapter limit and role, from its labels and annotations."""
    labels = meta.get("labels", {}) or {}
    annotations = meta.get("annotations", {}) or {}
    models = _names(annotations.get(MODELS_ANNOTATION, ""))
    if not models and cfg.model_label and labels.get(cfg.model_label):
        models = (str(labels[cfg.model_label]),)
    max_loras = 0
    raw = annotations.get(MAX_LORAS_ANNOTATION)
    if raw is not None:
        if (number := parse_decimal(str(raw))) is not None and number <= MAX_LORAS:
            max_loras = number
        else:
            log.warning("pod %s: annotation %s=%r is not an adapter count in [0, %d]; ignoring it", name,
                        MAX_LORAS_ANNOTATION, raw, MAX_LORAS)
    role = WorkerRole.BOTH
    value = str(labels.get(cfg.role_label, "")) if cfg.role_label else ""
    if value:
        if value in _ROLES:
            role = _ROLES[value]
        else:
            log.warning("pod %s: label %s=%r is not prefill, decode or both; taking it as both", name, cfg.role_label,
                        value)
    return {"models": models[:MAX_POOL_NAMES], "loras": _names(annotations.get(LORAS_ANNOTATION, ""))[:MAX_POOL_NAMES],
            "max_loras": max_loras, "role": role}


@dataclass(frozen=True, slots=True)
class Change:
    """``add`` registers or updates ``spec``; ``remove`` drops ``worker_id``."""

    kind: Literal["add", "remove"]
    worker_id: str
    spec: WorkerSpec | None = None


def _host(ip: str) -> str:
    return f"[{ip}]" if ":" in ip else ip


def _resolve_port(pod: Mapping[str, Any], port: str) -> int | None:
    if (number := parse_decimal(port)) is not None:
        return number
    for container in pod.get("spec", {}).get("containers", []) or []:
        for p in container.get("ports", []) or []:
            if p.get("name") == port and isinstance(p.get("containerPort"), int):
                return int(p["containerPort"])
    return None


def _is_ready(pod: Mapping[str, Any]) -> bool:
    status = pod.get("status", {}) or {}
    if status.get("phase") != "Running":
        return False
    return any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions", []) or [])


def replay_endpoint(pod: Mapping[str, Any], cfg: KubernetesDiscoveryConfig) -> str:
    """The pod's KV-event replay endpoint, or "" when none is configured or the port is unknown."""
    ip = (pod.get("status", {}) or {}).get("podIP") or ""
    if not cfg.kv_replay_port or not ip:
        return ""
    port = _resolve_port(pod, cfg.kv_replay_port)
    return f"tcp://{_host(ip)}:{port}" if port is not None else ""


def pod_worker_spec(pod: Mapping[str, Any], cfg: KubernetesDiscoveryConfig, block_size: int = 0) -> WorkerSpec | None:
    """The worker a pod stands for, or None when it should not receive traffic now."""
    meta = pod.get("metadata", {}) or {}
    name = meta.get("name", "")
    ip = (pod.get("status", {}) or {}).get("podIP") or ""
    if not name or not ip or meta.get("deletionTimestamp"):
        return None
    if cfg.require_ready and not _is_ready(pod):
        return None
    port = _resolve_port(pod, cfg.port)
    if port is None:
        log.warning("pod %s has no container port named %r; not routing to it", name, cfg.port)
        return None
    endpoint = ""
    if cfg.kv_events_port:
        kv_port = _resolve_port(pod, cfg.kv_events_port)
        if kv_port is None:
            log.warning("pod %s has no container port named %r; not routing to it", name, cfg.kv_events_port)
            return None
        endpoint = f"tcp://{_host(ip)}:{kv_port}"
    annotations = meta.get("annotations", {}) or {}
    capacity = cfg.capacity_blocks
    raw = annotations.get(CAPACITY_ANNOTATION)
    if raw is not None:
        if (blocks := parse_decimal(str(raw))) is not None:
            capacity = blocks
        else:
            log.warning("pod %s: annotation %s=%r is not a block count; using %d", name, CAPACITY_ANNOTATION, raw,
                        capacity)
    return WorkerSpec(
        id=cfg.id_prefix + name,
        address=f"{_host(ip)}:{port}",
        capacity_blocks=capacity,
        block_size=block_size,
        labels=dict(meta.get("labels", {}) or {}),
        mode=CacheMode.EVENTS if endpoint else CacheMode.APPROXIMATE,
        kv_events_endpoint=endpoint,
        **_pool(name, meta, cfg),
    )


class Membership:
    """The discovered workers, and the changes each pod event makes to them."""

    def __init__(self, cfg: KubernetesDiscoveryConfig, block_size: int = 0) -> None:
        self.cfg = cfg
        self.block_size = block_size
        #: worker id -> (pod uid, spec)
        self._members: dict[str, tuple[str, WorkerSpec]] = {}
        self._replay: dict[str, str] = {}

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        return {wid: spec for wid, (_, spec) in self._members.items()}

    def __len__(self) -> int:
        return len(self._members)

    def replay_endpoint(self, worker_id: str) -> str:
        """Where a discovered worker replays missed KV-event batches ("" = nowhere)."""
        return self._replay.get(worker_id, "") if worker_id in self._members else ""

    def _worker_id(self, pod: Mapping[str, Any]) -> str:
        return self.cfg.id_prefix + ((pod.get("metadata", {}) or {}).get("name", ""))

    def upsert(self, pod: Mapping[str, Any]) -> list[Change]:
        """An ADDED or MODIFIED pod."""
        wid = self._worker_id(pod)
        uid = (pod.get("metadata", {}) or {}).get("uid", "")
        spec = pod_worker_spec(pod, self.cfg, self.block_size)
        current = self._members.get(wid)
        if spec is None:
            if current is None:
                return []
            del self._members[wid]
            self._replay.pop(wid, None)
            return [Change("remove", wid)]
        self._members[wid] = (uid, spec)
        self._replay[wid] = replay_endpoint(pod, self.cfg)
        if current is None:
            return [Change("add", wid, spec)]
        old_uid, old = current
        if old_uid != uid or old.address != spec.address or old.kv_events_endpoint != spec.kv_events_endpoint:
            # a different process behind the same name starts with an empty cache
            return [Change("remove", wid), Change("add", wid, spec)]
        if old != spec:
            return [Change("add", wid, spec)]
        return []

    def delete(self, pod: Mapping[str, Any]) -> list[Change]:
        """A DELETED pod."""
        wid = self._worker_id(pod)
        self._replay.pop(wid, None)
        if self._members.pop(wid, None) is None:
            return []
        return [Change("remove", wid)]

    def replace(self, pods: Iterable[Mapping[str, Any]]) -> list[Change]:
        """A full listing: drop members that are gone, then upsert every listed pod."""
        pods = list(pods)
        listed = {self._worker_id(p) for p in pods}
        changes: list[Change] = []
        for wid in [w for w in self._members if w not in listed]:
            del self._members[wid]
            self._replay.pop(wid, None)
            changes.append(Change("remove", wid))
        for pod in pods:
            changes.extend(self.upsert(pod))
        return changes
