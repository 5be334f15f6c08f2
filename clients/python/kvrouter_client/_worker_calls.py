"""The unary calls an engine makes for its own worker: register, deregister, report load, ask for eviction advice.

``EventPublisher`` (and the bus publisher built on it) takes them from ``WorkerCalls``; they
share its channel, its worker id and its default timeout, and ``register`` leaves what the
publisher repeats after a router restart (``_registration``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from typing import Any

import grpc

from ._errors import from_rpc_error
from ._generated.kvrouter.v1 import router_pb2 as pb
from ._generated.kvrouter.v1 import router_pb2_grpc
from ._types import CacheMode, EvictAdvice, WorkerInfo, WorkerRole

__all__ = ["WorkerCalls"]


class WorkerCalls:
    """RegisterWorker, DeregisterWorker, ReportLoad and EvictHint for ``worker_id``."""

    # what the publisher holds and these calls read or leave for it
    worker_id: str
    block_size: int
    timeout: float
    _events_need_router: bool
    _stub: router_pb2_grpc.KVRouterStub | None
    _registration: dict[str, Any] | None
    _reregister: bool
    _router_epoch: int
    _check_epoch: bool
    _wake: asyncio.Event

    async def register(
        self,
        address: str,
        *,
        capacity_blocks: int = 0,
        labels: Mapping[str, str] | None = None,
        mode: CacheMode = CacheMode.EVENTS,
        kv_events_endpoint: str = "",
        models: Sequence[str] = (),
        loras: Sequence[str] = (),
        max_loras: int = 0,
        role: WorkerRole = WorkerRole.BOTH,
        timeout: float | None = None,
    ) -> WorkerInfo:
        """Register (or update) this worker; ``address`` is where gateways send its requests;
        ``models`` its model pool (empty = any model), ``loras`` the adapters it can load,
        ``max_loras`` how many it holds at once (vLLM ``--max-loras``), ``role`` its part in a
        disaggregated pool. Remembered: after a router restart the publisher registers the
        worker again by itself."""
        worker = pb.Worker(id=self.worker_id, address=address, capacity_blocks=capacity_blocks,
                           block_size=self.block_size, labels=dict(labels or {}), mode=int(mode),
                           kv_events_endpoint=kv_events_endpoint, models=list(models), loras=list(loras),
                           max_loras=max_loras, role=int(role))
        resp = await self._unary("RegisterWorker", pb.RegisterWorkerRequest(worker=worker), timeout)
        self._registration = {"address": address, "capacity_blocks": capacity_blocks, "labels": labels, "mode": mode,
                              "kv_events_endpoint": kv_events_endpoint, "models": models, "loras": loras,
                              "max_loras": max_loras, "role": role, "timeout": timeout}
        if self._events_need_router and not self._router_epoch:
            self._check_epoch = True  # learn the epoch now, so a restart right after is noticed
            self._wake.set()
        return WorkerInfo.from_pb(resp.worker)

    async def deregister(self, timeout: float | None = None) -> None:
        self._registration = None
        self._reregister = False
        await self._unary("DeregisterWorker", pb.DeregisterWorkerRequest(worker_id=self.worker_id), timeout)

    async def report_load(self, queued: int, running: int, kv_utilization: float, timeout: float | None = None,
                          loaded_loras: Sequence[str] | None = None) -> None:
        """The engine's own view of its load (queue, running requests, KV use in [0, 1]) and, when
        given, the LoRA adapters loaded now (None = not reported; ``[]`` = none loaded)."""
        msg = pb.ReportLoadRequest(
            worker_id=self.worker_id, queued_requests=queued, running_requests=running, kv_utilization=kv_utilization,
        )
        if loaded_loras is not None:
            msg.loaded_loras.SetInParent()
            msg.loaded_loras.names.extend(loaded_loras)
        await self._unary("ReportLoad", msg, timeout)

    async def evict_hint(
        self,
        *,
        blocks: int = 0,
        tokens: int = 0,
        pinned_engine_hashes: Sequence[int] = (),
        pinned_keys: Sequence[int] = (),
        policy: str = "",
        timeout: float | None = None,
    ) -> EvictAdvice:
        """Which blocks to evict first to free ``blocks`` blocks (or ``tokens`` tokens)."""
        if (blocks > 0) == (tokens > 0):
            raise ValueError("pass exactly one of blocks and tokens, as a positive number")
        resp = await self._unary("EvictHint", pb.EvictHintRequest(
            worker_id=self.worker_id, blocks=blocks, tokens=tokens, pinned_engine_hashes=pinned_engine_hashes,
            pinned_keys=pinned_keys, policy=policy,
        ), timeout)
        return EvictAdvice(list(resp.keys), list(resp.engine_hashes), resp.exhausted, resp.policy)

    async def _unary(self, method: str, request: Any, timeout: float | None) -> Any:
        if self._stub is None:
            raise RuntimeError(f"{method}: this publisher has no router target (pass target= or channel=)")
        try:
            return await getattr(self._stub, method)(request, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            raise from_rpc_error(exc, method) from None
