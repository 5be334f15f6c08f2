"""FanOutPublisher: one engine's events reach every router replica, including one that joins later."""

from __future__ import annotations

import asyncio

from kvrouter_client import FanOutPublisher, Stored
from kvrouter_client._fanout import resolve_all

from .test_security import serve

BS = 16


async def wait_for(predicate, timeout: float = 10.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.02)


async def test_a_list_of_targets_gets_every_event_and_the_registration():
    async with serve({}) as one, serve({}) as two:
        targets = [f"127.0.0.1:{one.port}", f"127.0.0.1:{two.port}"]
        async with FanOutPublisher(targets, "gpu-0", block_size=BS) as pub:
            registered = await pub.register("10.0.0.5:8000", capacity_blocks=100)
            assert set(registered) == set(targets)
            pub.stored(list(range(4 * BS)))
            assert await pub.flush(5.0)
            assert len(one.router.index) == len(two.router.index) == 4
            pub.removed([one.router.keys_for_tokens(list(range(4 * BS)))[-1]])
            assert await pub.flush(5.0)
            assert len(one.router.index) == len(two.router.index) == 3
            await pub.report_load(queued=2, running=5, kv_utilization=0.5)
            assert one.router.workers.get("gpu-0").reported_queue == two.router.workers.get("gpu-0").reported_queue == 2
            assert (await pub.evict_hint(blocks=1)).keys


async def test_a_dns_name_follows_its_addresses_and_a_new_replica_is_caught_up():
    snapshot_chain = list(range(1000, 1000 + 2 * BS))
    async with serve({}) as one, serve({}) as two:
        addresses = [f"127.0.0.1:{one.port}"]
        pub = FanOutPublisher("routers.example:50051", "gpu-0", block_size=BS, resolve_interval_s=0.05,
                              resolve=lambda name: list(addresses),
                              snapshot=lambda: [Stored(snapshot_chain)])
        async with pub:
            await pub.register("10.0.0.5:8000")
            pub.stored(snapshot_chain)
            assert await pub.flush(5.0)
            addresses.append(f"127.0.0.1:{two.port}")  # the Service gained a ready pod
            await wait_for(lambda: len(pub.publishers) == 2)
            assert await pub.flush(5.0)
            # registered and snapshotted: the new replica's view is whole before any new event
            assert "gpu-0" in two.router.workers and len(two.router.index) == 2
            addresses.remove(f"127.0.0.1:{one.port}")
            await wait_for(lambda: list(pub.publishers) == [f"127.0.0.1:{two.port}"])


def test_resolve_all_lists_each_address_once():
    assert resolve_all("127.0.0.1:50051") == ["127.0.0.1:50051"]
