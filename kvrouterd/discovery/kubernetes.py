"""Kubernetes pod discovery: list, then watch from the list's resourceVersion, forever.

    list pods (labelSelector) --> Membership.replace --> on_add / on_remove --> synced
      watch from resourceVersion --> ADDED / MODIFIED / DELETED --> on_add / on_remove
        BOOKMARK: remember the version   server ends the watch: watch again from it
        410 Gone: list again (the diff against what we hold is applied, nothing is flapped)
        any other failure: back off (the daemon's ``retry.Backoff``, between
          backoff_initial_s and backoff_max_s), then watch again, or list if never listed

Workers discovered stay registered while the API server is unreachable: losing the
control plane must not empty the router. The callbacks run on the event loop (the host
wires them to ``Router.add_worker`` / ``Router.remove_worker``); an exception from one is
logged and discovery goes on.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from typing import Any

import tenacity

from ..errors import ConfigError
from ..index.workers import WorkerSpec
from ..retry import Backoff
from .config import SERVICE_ACCOUNT_DIR, KubernetesDiscoveryConfig
from .kubeapi import ApiError, Gone, KubeApi
from .pods import Change, Membership

__all__ = ["KubernetesDiscovery"]

log = logging.getLogger("kvrouterd.discovery")


class _ClosedAtOnce(Exception):
    """A watch that ended within a second, having delivered nothing: a proxy that closes
    every watch at once must not turn following into a busy loop, so it is retried as a failure."""


def _own_namespace() -> str:
    try:
        with open(f"{SERVICE_ACCOUNT_DIR}/namespace", encoding="utf-8") as f:
            return f.read().strip()
    except OSError:
        return ""


class KubernetesDiscovery:
    """Turns the engine pods matching a label selector into worker add/remove calls."""

    def __init__(
        self,
        cfg: KubernetesDiscoveryConfig,
        on_add: Callable[[WorkerSpec], Any],
        on_remove: Callable[[str], Any],
        *,
        block_size: int = 0,
        api: KubeApi | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        cfg.validate()
        self.cfg = cfg
        self.namespace = cfg.namespace or _own_namespace()
        if not self.namespace:
            raise ConfigError("discovery.kubernetes.namespace: not set and not running in a pod")
        self.api = api or KubeApi(cfg, environ)
        self.membership = Membership(cfg, block_size)
        self._on_add = on_add
        self._on_remove = on_remove
        #: set once the first listing has been applied (the host may wait on it before READY)
        self.synced = asyncio.Event()
        self.resource_version = ""
        #: counters for metrics and tests
        self.lists = 0
        self.watches = 0
        self.errors = 0

    @property
    def workers(self) -> dict[str, WorkerSpec]:
        return self.membership.workers

    def replay_endpoint(self, worker_id: str) -> str:
        """The discovered worker's KV-event replay endpoint (``kv_replay_port``), or ""."""
        return self.membership.replay_endpoint(worker_id)

    def _apply(self, changes: list[Change]) -> None:
        for change in changes:
            try:
                if change.kind == "add":
                    assert change.spec is not None
                    self._on_add(change.spec)
                    log.info("discovered worker", extra={"worker_id": change.worker_id,
                                                         "address": change.spec.address})
                else:
                    self._on_remove(change.worker_id)
                    log.info("worker left", extra={"worker_id": change.worker_id})
            except Exception:
                log.exception("applying %s of worker %s failed", change.kind, change.worker_id)

    async def _list(self) -> None:
        pods, self.resource_version = await self.api.list_pods(self.namespace, self.cfg.label_selector)
        self.lists += 1
        self._apply(self.membership.replace(pods))
        self.synced.set()
        log.info("pod list applied", extra={"pods": len(pods), "workers": len(self.membership),
                                            "resource_version": self.resource_version})

    async def _watch(self) -> int:
        """Follow one watch until the server ends it; returns how many events it carried."""
        self.watches += 1
        n = 0
        async for event in self.api.watch_pods(self.namespace, self.cfg.label_selector, self.resource_version):
            n += 1
            kind, pod = event.get("type"), event.get("object")
            if not isinstance(pod, dict) or not isinstance(pod.get("metadata", {}), dict):
                log.warning("ignoring a %s watch event without a pod object", kind)
                continue
            rv = (pod.get("metadata") or {}).get("resourceVersion")
            if kind in ("ADDED", "MODIFIED"):
                self._apply(self.membership.upsert(pod))
            elif kind == "DELETED":
                self._apply(self.membership.delete(pod))
            elif kind != "BOOKMARK":
                log.warning("ignoring watch event of type %r", kind)
                continue
            if rv:
                self.resource_version = str(rv)
        return n

    async def run(self) -> None:
        """Keep the membership in step with the cluster until cancelled."""
        try:
            await self._follow()
        finally:
            await self.api.close()

    async def _follow(self) -> None:
        backoff = Backoff(self.cfg.backoff_initial_s, self.cfg.backoff_max_s)
        while True:  # each watch that delivers starts the backoff over
            async for attempt in backoff.retrying((ApiError, OSError, _ClosedAtOnce), before_sleep=self._failed):
                with attempt:
                    await self._list_and_watch()

    async def _list_and_watch(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            if not self.resource_version:
                await self._list()
            started = loop.time()
            if await self._watch() == 0 and loop.time() - started < 1.0:
                raise _ClosedAtOnce
        except Gone:
            log.info("watch version %s expired; listing again", self.resource_version)
            self.resource_version = ""

    def _failed(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if isinstance(exc, _ClosedAtOnce):
            return
        self.errors += 1
        log.warning("kubernetes discovery: %s; retrying in %.1fs", exc, state.upcoming_sleep)
