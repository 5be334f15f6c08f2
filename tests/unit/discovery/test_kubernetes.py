"""KubernetesDiscovery against a fake API server: list, watch, bookmarks, 410 Gone, failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvrouterd.discovery import KubernetesDiscovery, KubernetesDiscoveryConfig
from kvrouterd.index.workers import WorkerSpec

from .fake_kube import FakeKubeApi, Reply, event, eventually, gone_event, pod, pod_list


class Recorder:
    """Stands in for the Router: the workers it holds, and every call in order."""

    def __init__(self) -> None:
        self.workers: dict[str, WorkerSpec] = {}
        self.calls: list[tuple[str, str]] = []

    def add(self, spec: WorkerSpec) -> None:
        self.workers[spec.id] = spec
        self.calls.append(("add", spec.id))

    def remove(self, worker_id: str) -> None:
        del self.workers[worker_id]  # KeyError if discovery removes what it never added
        self.calls.append(("remove", worker_id))


@pytest.fixture
async def fake() -> AsyncIterator[FakeKubeApi]:
    api = FakeKubeApi()
    await api.start()
    yield api
    await api.stop()


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    p = tmp_path / "token"
    p.write_text("sa-token-1\n")
    return p


@contextlib.asynccontextmanager
async def running(fake: FakeKubeApi, token_file: Path, **overrides: object) -> AsyncIterator[tuple[KubernetesDiscovery, Recorder]]:
    settings: dict[str, object] = {
        "enabled": True, "namespace": "llm", "label_selector": "app=vllm,role in (decode)", "port": "http",
        "kv_events_port": "kv-events", "api_server": f"http://127.0.0.1:{fake.port}", "token_file": str(token_file),
        "backoff_initial_s": 0.01, "backoff_max_s": 0.05,
    }
    settings.update(overrides)
    rec = Recorder()
    disc = KubernetesDiscovery(KubernetesDiscoveryConfig(**settings), rec.add, rec.remove, block_size=16)  # type: ignore[arg-type]
    task = asyncio.create_task(disc.run())
    try:
        yield disc, rec
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_initial_list_adds_only_pods_that_can_take_traffic(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([
        pod("vllm-0", "10.0.0.1"), pod("vllm-1", "10.0.0.2", ready=False), pod("vllm-2", None),
        pod("vllm-3", "10.0.0.4", terminating=True), pod("vllm-4", "10.0.0.5"),
    ], rv="100"))
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        assert sorted(rec.workers) == ["vllm-0", "vllm-4"]
        w = rec.workers["vllm-0"]
        assert w.address == "10.0.0.1:8000" and w.kv_events_endpoint == "tcp://10.0.0.1:5557"
        await eventually(lambda: len(fake.watch_requests()) == 1)
    lst = fake.list_requests()[0]
    assert lst.path == "/api/v1/namespaces/llm/pods"
    assert lst.query == {"labelSelector": "app=vllm,role in (decode)"}
    assert lst.headers["authorization"] == "Bearer sa-token-1"
    watch = fake.watch_requests()[0]
    # the API server parses booleans as Go does: "True" and "true" alike
    assert watch.query["resourceVersion"] == "100" and watch.query["allowWatchBookmarks"].lower() == "true"


async def test_watch_events_drive_membership(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([pod("vllm-0", "10.0.0.1")], rv="10"))
    q = fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        await q.put(event("ADDED", pod("vllm-1", None, ready=False, rv="11")))      # scheduled, no IP yet
        await q.put(event("MODIFIED", pod("vllm-1", "10.0.0.2", ready=False, rv="12")))  # IP, not Ready
        await q.put(event("MODIFIED", pod("vllm-1", "10.0.0.2", rv="13")))          # Ready: joins
        await eventually(lambda: "vllm-1" in rec.workers)
        await q.put(event("MODIFIED", pod("vllm-0", "10.0.0.1", ready=False, rv="14")))  # failing probe
        await eventually(lambda: "vllm-0" not in rec.workers)
        await q.put(event("MODIFIED", pod("vllm-0", "10.0.0.1", rv="15")))
        await q.put(event("DELETED", pod("vllm-1", "10.0.0.2", rv="16")))
        await eventually(lambda: sorted(rec.workers) == ["vllm-0"])
        assert rec.calls == [("add", "vllm-0"), ("add", "vllm-1"), ("remove", "vllm-0"), ("add", "vllm-0"),
                             ("remove", "vllm-1")]
        assert disc.resource_version == "16"


async def test_bookmark_and_normal_watch_end_resume_from_the_last_version(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([], rv="10"))
    q1 = fake.watch()
    q2 = fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        await q1.put(event("ADDED", pod("vllm-0", "10.0.0.1", rv="20")))
        await q1.put(event("BOOKMARK", {"kind": "Pod", "metadata": {"resourceVersion": "35"}}))
        await q1.put(None)  # the server's timeoutSeconds elapsed
        await eventually(lambda: len(fake.watch_requests()) == 2)
        await q2.put(event("ADDED", pod("vllm-1", "10.0.0.2", rv="36")))
        await eventually(lambda: "vllm-1" in rec.workers)
    assert [r.query["resourceVersion"] for r in fake.watch_requests()] == ["10", "35"]
    assert len(fake.list_requests()) == 1  # an ordinary watch end does not relist


@pytest.mark.parametrize("how", ["http-status", "error-event"])
async def test_gone_relists_and_applies_only_the_difference(fake: FakeKubeApi, token_file: Path, how: str) -> None:
    fake.lists += [
        pod_list([pod("vllm-0", "10.0.0.1"), pod("vllm-1", "10.0.0.2")], rv="10"),
        # while we were away: vllm-1 deleted, vllm-2 created, vllm-0 untouched
        pod_list([pod("vllm-0", "10.0.0.1", rv="90"), pod("vllm-2", "10.0.0.3", rv="95")], rv="100"),
    ]
    if how == "http-status":
        fake.watches.append(Reply(410, {"kind": "Status", "code": 410, "message": "too old resource version"}))
    else:
        q = fake.watch()
        await q.put(gone_event())
    async with running(fake, token_file) as (disc, rec):
        await eventually(lambda: disc.lists == 2 and len(fake.watch_requests()) == 2)
        assert sorted(rec.workers) == ["vllm-0", "vllm-2"]
        # vllm-0 kept its place (and its index): no remove/add flap
        assert rec.calls == [("add", "vllm-0"), ("add", "vllm-1"), ("remove", "vllm-1"), ("add", "vllm-2")]
    assert fake.watch_requests()[1].query["resourceVersion"] == "100"


async def test_malformed_watch_events_are_skipped(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([], rv="10"))
    q = fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        for bad in ({"type": "ADDED", "object": ["not", "a", "pod"]},
                    {"type": "MODIFIED", "object": {"metadata": "x"}}, {"type": "SURPRISE", "object": {}}):
            await q.put(bad)
        await q.put(event("ADDED", pod("vllm-0", "10.0.0.1", rv="11")))
        await eventually(lambda: "vllm-0" in rec.workers)
        assert disc.errors == 0 and disc.resource_version == "11"


async def test_an_event_without_an_object_breaks_the_watch_which_resumes(fake: FakeKubeApi, token_file: Path) -> None:
    # no API server sends one; the client library treats the stream as broken, and the watch
    # resumes from the last version, so nothing after it is lost
    fake.lists.append(pod_list([], rv="10"))
    q1, q2 = fake.watch(), fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        await q1.put(event("ADDED", pod("vllm-0", "10.0.0.1", rv="11")))
        await q1.put({"type": "ADDED"})
        await eventually(lambda: len(fake.watch_requests()) == 2)
        await q2.put(event("ADDED", pod("vllm-1", "10.0.0.2", rv="12")))
        await eventually(lambda: "vllm-1" in rec.workers)
        assert sorted(rec.workers) == ["vllm-0", "vllm-1"] and disc.errors == 1 and disc.lists == 1
    assert [r.query["resourceVersion"] for r in fake.watch_requests()] == ["10", "11"]


async def test_recreated_pod_with_the_same_name_is_replaced(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([pod("vllm-0", "10.0.0.1", uid="u1")], rv="10"))
    q = fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        await q.put(event("ADDED", pod("vllm-0", "10.0.0.9", uid="u2", rv="11")))
        await eventually(lambda: len(rec.calls) == 3)
        assert rec.calls == [("add", "vllm-0"), ("remove", "vllm-0"), ("add", "vllm-0")]
        assert rec.workers["vllm-0"].address == "10.0.0.9:8000"


async def test_api_failures_back_off_and_keep_the_workers(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists += [Reply(500, {"kind": "Status", "message": "etcdserver: timeout"}),
                   Reply(403, {"kind": "Status", "message": "pods is forbidden"}),
                   pod_list([pod("vllm-0", "10.0.0.1")], rv="10", )]
    fake.watches += [Reply(500, {"message": "boom"}), Reply(200, b"{not json\n", chunked=True)]
    q = fake.watch()
    async with running(fake, token_file) as (disc, rec):
        await asyncio.wait_for(disc.synced.wait(), 5)
        await eventually(lambda: len(fake.watch_requests()) == 3)
        assert sorted(rec.workers) == ["vllm-0"]  # failing watches removed nobody
        await q.put(event("ADDED", pod("vllm-1", "10.0.0.2", rv="12")))
        await eventually(lambda: "vllm-1" in rec.workers)
        assert disc.errors == 4
    # after a failed watch we resume from the version we had; no relist was needed
    assert [r.query["resourceVersion"] for r in fake.watch_requests()] == ["10", "10", "10"]


async def test_unreachable_api_server_retries_until_it_answers(token_file: Path) -> None:
    fake = FakeKubeApi()
    await fake.start()
    port = fake.port
    await fake.stop()  # nothing listens on the port now
    async with running(fake, token_file) as (disc, rec):
        await eventually(lambda: disc.errors >= 2)
        assert not disc.synced.is_set()
        server = FakeKubeApi(lists=[pod_list([pod("vllm-0")], rv="5")])
        server._server = await asyncio.start_server(server._handle, "127.0.0.1", port)
        try:
            await asyncio.wait_for(disc.synced.wait(), 5)
            assert list(rec.workers) == ["vllm-0"]
        finally:
            await server.stop()


async def test_a_failing_callback_does_not_stop_discovery(fake: FakeKubeApi, token_file: Path) -> None:
    fake.lists.append(pod_list([pod("bad", "10.0.0.1"), pod("good", "10.0.0.2")], rv="10"))
    added: list[str] = []

    def add(spec: WorkerSpec) -> None:
        if spec.id == "bad":
            raise ValueError("router refused it")
        added.append(spec.id)

    cfg = KubernetesDiscoveryConfig(enabled=True, namespace="llm", label_selector="app=vllm",
                                    api_server=f"http://127.0.0.1:{fake.port}", token_file=str(token_file))
    disc = KubernetesDiscovery(cfg, add, lambda _id: None)
    task = asyncio.create_task(disc.run())
    try:
        await asyncio.wait_for(disc.synced.wait(), 5)
        assert added == ["good"]
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def test_outside_a_pod_without_api_server_is_a_config_error(tmp_path: Path) -> None:
    from kvrouterd.errors import ConfigError

    cfg = KubernetesDiscoveryConfig(enabled=True, namespace="llm", label_selector="app=vllm")
    with pytest.raises(ConfigError, match="api_server"):
        KubernetesDiscovery(cfg, lambda s: None, lambda i: None, environ={})
