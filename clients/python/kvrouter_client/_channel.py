"""Channel options shared by the SDK's clients."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

__all__ = ["channel_options"]


def channel_options(options: Iterable[tuple[str, Any]], initial_backoff_s: float, max_backoff_s: float) -> list[tuple[str, Any]]:
    """Caller options plus a reconnect backoff that suits a router: gRPC's default (1 s growing
    to 120 s) would keep a restarted router unused for minutes."""
    opts = list(options)
    names = {name for name, _ in opts}
    for name, value in (("grpc.initial_reconnect_backoff_ms", int(initial_backoff_s * 1000)),
                        ("grpc.min_reconnect_backoff_ms", int(initial_backoff_s * 1000)),
                        ("grpc.max_reconnect_backoff_ms", int(max_backoff_s * 1000))):
        if name not in names:
            opts.append((name, max(1, value)))
    return opts
