"""Engine KV-event adapters: vLLM / SGLang publishers over ZMQ into the router's vocabulary.

``engine_format`` decodes msgpack batch payloads (pure; ``engine_event`` reads one event,
``engine_structs`` is the typed fast path); ``endpoints`` parses and allows the addresses;
``sequencing`` orders each endpoint's batches (replay, restarts, hand-off); ``zmq_source`` owns
the sockets and reconnection. Only this package knows the engines' wire layouts.
"""

from __future__ import annotations

from .endpoints import ZmqEndpoint, rank_endpoint
from .engine_event import MalformedPayload, TierEvent, decode_event, normalize_hash
from .engine_format import DecodedBatch, decode_payload
from .sequencing import SubscriberStats
from .zmq_config import ZmqEventsConfig
from .zmq_source import EndpointSubscriber, ZmqEventSource

__all__ = [
    "DecodedBatch",
    "EndpointSubscriber",
    "MalformedPayload",
    "SubscriberStats",
    "TierEvent",
    "ZmqEndpoint",
    "ZmqEventSource",
    "ZmqEventsConfig",
    "decode_event",
    "decode_payload",
    "normalize_hash",
    "rank_endpoint",
]
