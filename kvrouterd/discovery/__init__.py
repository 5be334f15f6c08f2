"""Worker discovery: engine pods found through the Kubernetes API become workers.

Use::

    discovery = KubernetesDiscovery(cfg.discovery.kubernetes, router.add_worker, router.remove_worker,
                                    block_size=cfg.block_size)
    task = asyncio.create_task(discovery.run())
    await discovery.synced.wait()     # the first listing is applied
"""

from __future__ import annotations

from .config import SERVICE_ACCOUNT_DIR, DiscoveryConfig, KubernetesDiscoveryConfig
from .kubeapi import ApiError, Gone, KubeApi
from .kubernetes import KubernetesDiscovery
from .pods import (
    CAPACITY_ANNOTATION,
    LORAS_ANNOTATION,
    MAX_LORAS_ANNOTATION,
    MODELS_ANNOTATION,
    Change,
    Membership,
    pod_worker_spec,
)

__all__ = [
    "CAPACITY_ANNOTATION",
    "LORAS_ANNOTATION",
    "MAX_LORAS_ANNOTATION",
    "MODELS_ANNOTATION",
    "SERVICE_ACCOUNT_DIR",
    "ApiError",
    "Change",
    "DiscoveryConfig",
    "Gone",
    "KubeApi",
    "KubernetesDiscovery",
    "KubernetesDiscoveryConfig",
    "Membership",
    "pod_worker_spec",
]
