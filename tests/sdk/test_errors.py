"""How the SDK surfaces the router's statuses: a shed Route is RouterOverloaded, with its retry hint."""

from __future__ import annotations

import grpc

from kvrouter_client import RouterOverloaded, RouterRejected, RouterUnavailable
from kvrouter_client._errors import from_rpc_error, from_status

SHED = "shed: predicted TTFT 6,400 ms on the best eligible worker exceeds the 5,000 ms SLO; retry after 1,400 ms"


class FakeRpcError(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str, trailers: tuple[tuple[str, str], ...] = ()) -> None:
        self._code, self._details, self._trailers = code, details, trailers

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details

    def trailing_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._trailers


def test_a_shed_route_is_overloaded_with_the_trailers_retry_hint() -> None:
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, SHED, (("retry-after-ms", "1400"),)), "Route")
    assert isinstance(err, RouterOverloaded) and isinstance(err, RouterRejected)  # still not failed open
    assert err.retry_after_ms == 1400.0 and err.http_status == 429 and "5,000 ms SLO" in str(err)


def test_a_stream_item_carries_its_hint_in_the_message() -> None:
    err = from_status(grpc.StatusCode.RESOURCE_EXHAUSTED, SHED, "Route")
    assert isinstance(err, RouterOverloaded) and err.retry_after_ms == 1400.0


def test_a_limit_that_is_not_load_has_no_hint() -> None:
    err = from_rpc_error(FakeRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt over limits.max_prompt_tokens"), "Route")
    assert isinstance(err, RouterOverloaded) and err.retry_after_ms is None
    assert isinstance(from_status(grpc.StatusCode.UNAVAILABLE, "down", "Route"), RouterUnavailable)
    assert type(from_status(grpc.StatusCode.INVALID_ARGUMENT, "bad", "Route")) is RouterRejected
