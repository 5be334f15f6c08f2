"""Gateways' side: ask kvrouterd where to send a request, then report how it went.

``RouterClient`` (asyncio, ``grpc.aio``) and ``SyncRouterClient`` (blocking) share one API::

    async with RouterClient("kvrouter:50051", timeout=0.05) as router:
        choice = await router.route(token_ids=prompt_ids, model="llama-3-8b", session_id=sid)
        ...send the request to choice.worker_address...
        await router.complete(choice, ttft_ms=ttft, e2e_ms=e2e, output_tokens=n)

Transport: ``RouterClient`` sends route() and complete() as messages of a few long-lived
``RouteStream`` calls (``streams=4`` by default), which costs the router far less CPU per
call than a unary RPC (calls ready together on a stream go as one batch message when the
router advertises batches: see ``_streams``); a broken stream is reopened on the next call, and
a router without RouteStream (UNIMPLEMENTED) is spoken to with unary calls from then on. ``streams=0`` uses
unary ``Route``/``Complete`` only. ``SyncRouterClient`` always uses unary calls.

Block keys: with ``send_block_keys=True`` a route() given token ids hashes them into the block
keys the router would compute (``keys``, with the block size the router advertises on its
streams) and sends those with ``prompt_tokens``: 8 bytes a block instead of 4 a token (a 4,000-token
prompt: 2 KB instead of 16 KB), which the router neither parses nor hashes, so each Route costs it
less CPU and the gateway more (the hash, ~0.1 us a block in pure Python). Routed exactly as the
token ids would be. A prompt with no full block, a unary call, and a stream whose router
advertises no block size (an older one, or before its metadata arrived) send token ids. Name a
LoRA adapter in ``lora`` with its base in ``model`` then: the router keys an adapter named in
``model`` under its base model, which the client cannot know.

Deadlines: every call has one (``timeout`` per client, overridable per call). A router
that is down or slow must not stall the data path.

Fallback when the router is unreachable (UNAVAILABLE or DEADLINE_EXCEEDED, which includes
"no eligible worker right now"): with ``fallback=None`` (the default) ``route()`` raises
``RouterUnavailable``; with a ``fallback`` callable the client fails open: it calls
``fallback(request)`` with the ``RouteRequest`` it tried and returns its ``(worker_id,
worker_address)`` as a ``RouteResult`` with ``fallback=True`` (``complete()`` of such a result
does nothing: a streamed Route the router answers after its deadline, having committed it
while the caller gave up, is released by the client itself; see ``late_routes_released``).
Rejections (bad input, a model or ``candidate_workers`` no registered worker has, over a limit)
always raise ``RouterRejected``: failing open would hide a bug.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import Any

import grpc

from ._channel import TLS, channel_options, open_aio_channel, open_channel
from ._errors import KVRouterClientError, RouterUnavailable, from_rpc_error
from ._generated.kvrouter.v1 import router_pb2 as pb
from ._generated.kvrouter.v1 import router_pb2_grpc
from ._streams import COMPLETE, ROUTE, RouteStreams, StreamsUnsupported, field_header, varint_field
from ._types import RouteResult, TaskCategory, WorkerInfo, packed_array
from .keys import chain_keys, namespace_seed

__all__ = ["DEFAULT_STREAMS", "DEFAULT_TIMEOUT_S", "FallbackFn", "RouterClient", "SyncRouterClient"]

#: per-call deadline unless the client or the call says otherwise
DEFAULT_TIMEOUT_S = 0.5
#: RouteStream calls a RouterClient spreads its calls over (a stream is served on one
#: event-loop turn at a time, so a few let the router overlap reading and answering)
DEFAULT_STREAMS = 4

#: chooses a worker when the router is unreachable: request -> (worker_id, worker_address)
FallbackFn = Callable[[pb.RouteRequest], tuple[str, str]]

#: RouteRequest.token_ids_le32, the packed prompt: the last field, so protobuf writes it last
_PROMPT_FIELD = 14
#: RouteRequest.block_keys (packed fixed64: little-endian uint64s) and prompt_tokens (a varint)
_KEYS_FIELD = 3
_PROMPT_TOKENS_FIELD = 4
_LITTLE_ENDIAN = sys.byteorder == "little"


class _Route:
    """A route() call's request: every field but the packed prompt in ``fields``, the prompt
    beside it (a 4,000-token prompt is 16 KB, which the streamed path copies only once)."""

    __slots__ = ("fields", "prompt")

    def __init__(self, fields: pb.RouteRequest, prompt: array | None) -> None:
        self.fields = fields
        self.prompt = prompt

    def message(self) -> pb.RouteRequest:
        """The whole RouteRequest (unary calls, and the fallback's argument)."""
        if self.prompt is not None:
            self.fields.token_ids_le32 = self.prompt.tobytes()
            self.prompt = None
        return self.fields

    def body(self) -> list[bytes | memoryview]:
        """The serialised RouteRequest in parts, byte for byte ``message().SerializeToString()``."""
        fields = self.fields.SerializeToString()
        if not self.prompt:  # no prompt, or an empty one, which proto3 leaves out
            return [fields]
        prompt = memoryview(self.prompt).cast("B")  # our own array (see _route_request): nobody resizes it
        return [fields, field_header(_PROMPT_FIELD, len(prompt)), prompt]

    def keyed(self, block_size: int) -> list[bytes | memoryview]:
        """The serialised RouteRequest with the prompt as its block keys for ``block_size`` and
        ``prompt_tokens`` its length, as the router hashes them (``keys``); ``body()`` when
        there is no block size (0: the router advertised none) or the prompt holds no full block
        (an empty ``block_keys`` would be no prompt at all)."""
        prompt = self.prompt
        if not block_size or prompt is None or len(prompt) < block_size:
            return self.body()
        fields = self.fields
        seed = namespace_seed(fields.model, fields.lora, fields.cache_salt)
        keys = array("Q", chain_keys(prompt.tobytes(), block_size, seed))
        if not _LITTLE_ENDIAN:  # pragma: no cover - no big-endian CI machine
            keys.byteswap()
        packed = memoryview(keys).cast("B")
        # after the other fields, so ours win: the router takes the last prompt_tokens, and counts
        # a token prompt by its ids whatever prompt_tokens said
        return [fields.SerializeToString(), field_header(_KEYS_FIELD, len(packed)), packed,
                varint_field(_PROMPT_TOKENS_FIELD, len(prompt))]


def _route_request(
    token_ids: Sequence[int] | None,
    block_keys: Sequence[int] | None,
    prompt_tokens: int,
    model: str,
    lora: str,
    session_id: str,
    task: TaskCategory | int,
    ttft_slo_ms: float,
    expected_output_tokens: int,
    policy: str,
    candidate_workers: Sequence[str],
    request_id: str,
    cache_salt: str = "",
) -> _Route:
    if (token_ids is None) == (block_keys is None):
        raise ValueError("pass exactly one of token_ids and block_keys")
    # packed: the router hashes this buffer as it is, instead of decoding one varint per token
    prompt = None if token_ids is None else packed_array(token_ids)
    if prompt is not None and prompt is token_ids:  # the caller's own array: the fallback must see it as it was now
        prompt = prompt[:]
    # only the arguments given: protobuf takes ~0.1 us a keyword, and most calls leave most at
    # their defaults. An argument is left out only when it *is* its default object, which sets
    # nothing, so every other value is checked by protobuf exactly as before.
    fields: dict[str, Any] = {"ttft_slo_ms": ttft_slo_ms}
    if request_id is not _NONE_STR:
        fields["request_id"] = request_id
    if block_keys:
        fields["block_keys"] = block_keys
    if prompt_tokens is not _ZERO:
        fields["prompt_tokens"] = prompt_tokens
    if model is not _NONE_STR:
        fields["model"] = model
    if lora is not _NONE_STR:
        fields["lora"] = lora
    if session_id is not _NONE_STR:
        fields["session_id"] = session_id
    if task is not TaskCategory.UNSPECIFIED:
        fields["task"] = int(task)
    if expected_output_tokens is not _ZERO:
        fields["expected_output_tokens"] = expected_output_tokens
    if policy is not _NONE_STR:
        fields["policy"] = policy
    if candidate_workers is not _NO_WORKERS:
        fields["candidate_workers"] = candidate_workers
    if cache_salt is not _NONE_STR:
        fields["cache_salt"] = cache_salt
    return _Route(pb.RouteRequest(**fields), prompt)


#: route()'s defaults, as objects: the empty string and 0 are singletons in CPython, () too
_NONE_STR = ""
_ZERO = 0
_NO_WORKERS = ()


def _complete_request(
    request: RouteResult | str, ttft_ms: float, e2e_ms: float, cached_tokens: int, output_tokens: int, success: bool,
    session_ended: bool = False, prefill_ms: float = 0.0, kv_transfer_ms: float = 0.0, prefill_done: bool = False,
) -> pb.CompleteRequest | None:
    if isinstance(request, RouteResult):
        if request.fallback:
            return None
        request = request.request_id
    return pb.CompleteRequest(
        request_id=request, ttft_ms=ttft_ms, e2e_ms=e2e_ms, cached_tokens=cached_tokens,
        output_tokens=output_tokens, success=success, session_ended=session_ended,
        prefill_ms=prefill_ms, kv_transfer_ms=kv_transfer_ms, prefill_done=prefill_done,
    )


def _last_page(resp: pb.ListWorkersResponse, token: str) -> bool:
    """No page after ``resp`` (a router from before pages answers everything at once, with no
    token; one that repeats the token would loop)."""
    return not resp.next_page_token or resp.next_page_token == token


def _fallback_result(req: pb.RouteRequest, fallback: FallbackFn | None, exc: grpc.RpcError) -> RouteResult:
    return _fail_open(req, fallback, from_rpc_error(exc, "Route"))


def _fail_open(req: pb.RouteRequest, fallback: FallbackFn | None, err: KVRouterClientError) -> RouteResult:
    if fallback is None or not isinstance(err, RouterUnavailable):
        raise err from None
    worker_id, address = fallback(req)
    return RouteResult(request_id=req.request_id, worker_id=worker_id, worker_address=address,
                       reason="router_unavailable", fallback=True)


class RouterClient:
    """Asynchronous client for gateways (``grpc.aio``). Use one per process; it is cheap to share.

    ``target`` is ``host:port``. ``tls=TLS(ca_file=..., cert_file=..., key_file=...)`` connects
    with TLS (mutual with a client pair); ``token`` or ``token_file`` sends ``authorization:
    Bearer <token>`` on every call (the router's ``auth`` section). Pass ``channel`` to bring
    your own (then tls and token are yours to set on it).
    ``streams`` RouteStream calls carry route()/complete(); 0 = unary calls only.
    ``send_block_keys``: streamed Routes carry their prompts' block keys instead of their token
    ids (see the module docstring): less CPU for the router, more for the gateway.
    """

    def __init__(
        self,
        target: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        fallback: FallbackFn | None = None,
        channel: grpc.aio.Channel | None = None,
        options: Sequence[tuple[str, Any]] = (),
        streams: int = DEFAULT_STREAMS,
        tls: TLS | None = None,
        token: str | None = None,
        token_file: str | None = None,
        send_block_keys: bool = False,
    ) -> None:
        if channel is None and not target:
            raise ValueError("pass a target (host:port) or a channel")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        if streams < 0:
            raise ValueError("streams must be >= 0")
        self.send_block_keys = send_block_keys
        self._own_channel = channel is None
        self._channel = channel or open_aio_channel(target, channel_options(options, 0.1, 5.0), tls, token, token_file)
        self._stub = router_pb2_grpc.KVRouterStub(self._channel)
        self._streams = RouteStreams(self._channel, streams) if streams else None
        self.timeout = timeout
        self.fallback = fallback

    @property
    def late_routes_released(self) -> int:
        """Streamed Routes the router answered after their callers' deadlines (they had failed
        open or raised), which this client then released with a ``success=False`` Complete:
        a gateway may export it; a rising count says the router stalls past ``timeout``."""
        return self._streams.late_routes_released if self._streams is not None else 0

    def _streaming(self) -> RouteStreams | None:
        streams = self._streams
        return None if streams is None or streams.unsupported else streams

    async def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        prompt_tokens: int = 0,
        model: str = "",
        lora: str = "",
        session_id: str = "",
        task: TaskCategory | int = TaskCategory.UNSPECIFIED,
        ttft_slo_ms: float = 0.0,
        expected_output_tokens: int = 0,
        policy: str = "",
        candidate_workers: Sequence[str] = (),
        request_id: str = "",
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> RouteResult:
        """Pick the worker for one request (pass the prompt as token ids or as block keys).
        ``cache_salt``: the salt the engine caches this request under (vLLM/SGLang ``cache_salt``,
        a tenant's); its blocks match only blocks stored under the same salt, as in the engine."""
        route = _route_request(token_ids, block_keys, prompt_tokens, model, lora, session_id, task, ttft_slo_ms,
                               expected_output_tokens, policy, candidate_workers, request_id, cache_salt)
        timeout = timeout or self.timeout
        streams = self._streaming()
        if streams is not None:
            try:
                body = route.keyed if self.send_block_keys else route.body()
                reply = await streams.exchange(ROUTE, body, timeout, "Route")
            except KVRouterClientError as err:
                return _fail_open(route.message(), self.fallback, err)
            except StreamsUnsupported:
                pass  # an older router: this call and the next ones go unary
            else:
                return RouteResult.from_pb(reply.route)
        req = route.message()
        try:
            resp = await self._stub.Route(req, timeout=timeout)
        except grpc.RpcError as exc:
            return _fallback_result(req, self.fallback, exc)
        return RouteResult.from_pb(resp)

    async def complete(
        self,
        request: RouteResult | str,
        *,
        ttft_ms: float = 0.0,
        e2e_ms: float = 0.0,
        cached_tokens: int = -1,
        output_tokens: int = 0,
        success: bool = True,
        session_ended: bool = False,
        prefill_ms: float = 0.0,
        kv_transfer_ms: float = 0.0,
        prefill_done: bool = False,
        timeout: float | None = None,
    ) -> bool:
        """Release a routed request's load. False if the router was unreachable (it then releases
        the load itself after its in-flight timeout); raises RouterRejected otherwise.
        ``session_ended=True`` says the conversation is over (end-aware eviction drops its tail first).
        A disaggregated request (``RouteResult.disaggregated``) reports its prefill hop's
        ``prefill_ms`` and ``kv_transfer_ms``; ``prefill_done=True`` releases only the prefill
        worker, as soon as it answered (its Complete without the flag follows)."""
        req = _complete_request(request, ttft_ms, e2e_ms, cached_tokens, output_tokens, success, session_ended,
                                prefill_ms, kv_transfer_ms, prefill_done)
        if req is None:
            return True
        timeout = timeout or self.timeout
        streams = self._streaming()
        if streams is not None:
            try:
                await streams.exchange(COMPLETE, [req.SerializeToString()], timeout, "Complete")
            except RouterUnavailable:
                return False
            except StreamsUnsupported:
                pass
            else:
                return True
        try:
            await self._stub.Complete(req, timeout=timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc, "Complete")
            if isinstance(err, RouterUnavailable):
                return False
            raise err from None
        return True

    async def list_workers(self, timeout: float | None = None) -> list[WorkerInfo]:
        """Every worker, in id order, a ``ListWorkers`` page at a time (``timeout`` per page)."""
        workers: list[WorkerInfo] = []
        token = ""
        while True:
            try:
                resp = await self._stub.ListWorkers(pb.ListWorkersRequest(page_token=token), timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, "ListWorkers") from None
            workers += [WorkerInfo.from_pb(w) for w in resp.workers]
            if _last_page(resp, token):
                return workers
            token = resp.next_page_token

    async def close(self) -> None:
        if self._streams is not None:
            self._streams.close()
        if self._own_channel:
            await self._channel.close()

    async def __aenter__(self) -> RouterClient:
        return self

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        await self.close()


class SyncRouterClient:
    """Blocking twin of RouterClient for threaded gateways; same arguments and semantics."""

    def __init__(
        self,
        target: str = "",
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        fallback: FallbackFn | None = None,
        channel: grpc.Channel | None = None,
        options: Sequence[tuple[str, Any]] = (),
        tls: TLS | None = None,
        token: str | None = None,
        token_file: str | None = None,
    ) -> None:
        if channel is None and not target:
            raise ValueError("pass a target (host:port) or a channel")
        if timeout <= 0:
            raise ValueError("timeout must be > 0")
        self._own_channel = channel is None
        self._channel = channel or open_channel(target, channel_options(options, 0.1, 5.0), tls, token, token_file)
        self._stub = router_pb2_grpc.KVRouterStub(self._channel)
        self.timeout = timeout
        self.fallback = fallback

    def route(
        self,
        token_ids: Sequence[int] | None = None,
        *,
        block_keys: Sequence[int] | None = None,
        prompt_tokens: int = 0,
        model: str = "",
        lora: str = "",
        session_id: str = "",
        task: TaskCategory | int = TaskCategory.UNSPECIFIED,
        ttft_slo_ms: float = 0.0,
        expected_output_tokens: int = 0,
        policy: str = "",
        candidate_workers: Sequence[str] = (),
        request_id: str = "",
        cache_salt: str = "",
        timeout: float | None = None,
    ) -> RouteResult:
        """See RouterClient.route."""
        req = _route_request(token_ids, block_keys, prompt_tokens, model, lora, session_id, task, ttft_slo_ms,
                             expected_output_tokens, policy, candidate_workers, request_id, cache_salt).message()
        try:
            resp = self._stub.Route(req, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            return _fallback_result(req, self.fallback, exc)
        return RouteResult.from_pb(resp)

    def complete(
        self,
        request: RouteResult | str,
        *,
        ttft_ms: float = 0.0,
        e2e_ms: float = 0.0,
        cached_tokens: int = -1,
        output_tokens: int = 0,
        success: bool = True,
        session_ended: bool = False,
        prefill_ms: float = 0.0,
        kv_transfer_ms: float = 0.0,
        prefill_done: bool = False,
        timeout: float | None = None,
    ) -> bool:
        """See RouterClient.complete."""
        req = _complete_request(request, ttft_ms, e2e_ms, cached_tokens, output_tokens, success, session_ended,
                                prefill_ms, kv_transfer_ms, prefill_done)
        if req is None:
            return True
        try:
            self._stub.Complete(req, timeout=timeout or self.timeout)
        except grpc.RpcError as exc:
            err = from_rpc_error(exc, "Complete")
            if isinstance(err, RouterUnavailable):
                return False
            raise err from None
        return True

    def list_workers(self, timeout: float | None = None) -> list[WorkerInfo]:
        """Every worker, in id order, a ``ListWorkers`` page at a time (``timeout`` per page)."""
        workers: list[WorkerInfo] = []
        token = ""
        while True:
            try:
                resp = self._stub.ListWorkers(pb.ListWorkersRequest(page_token=token), timeout=timeout or self.timeout)
            except grpc.RpcError as exc:
                raise from_rpc_error(exc, "ListWorkers") from None
            workers += [WorkerInfo.from_pb(w) for w in resp.workers]
            if _last_page(resp, token):
                return workers
            token = resp.next_page_token

    def close(self) -> None:
        if self._own_channel:
            self._channel.close()

    def __enter__(self) -> SyncRouterClient:
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
