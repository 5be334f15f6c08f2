"""The gRPC daemon: wire conversion, status mapping, the servicer and its life cycle."""

from .app import Daemon

__all__ = ["Daemon"]
