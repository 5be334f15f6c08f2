"""Fixtures of the server's conversion tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvrouterd._generated.kvrouter.v1 import router_pb2 as pb
from kvrouterd.index import native


@pytest.fixture(params=["listed", "by_name"])
def read_as(request: pytest.FixtureRequest) -> Iterator[str]:
    """How the native conversions read a message: its set fields in one call (the layouts
    ``convert`` hands over at import), or each field by name (no layout)."""
    if request.param == "by_name" and native.module is not None:
        native.module.message_layouts(None, None)
    try:
        yield request.param
    finally:
        if native.module is not None:
            native.module.message_layouts(pb.RouteRequest, pb.CompleteRequest)
