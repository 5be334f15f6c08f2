"""Pages of worker descriptions for ListWorkers and GetStats, each well under gRPC's default 4 MiB receive limit.

A worker's description may take ~64 KiB (``limits.max_labels_length`` characters of labels, up
to 4 UTF-8 bytes each), so a fleet's in one reply passed the 4 MiB a default gRPC client accepts
at ~300 such workers, and ``kvrouterd status`` and default clients failed (issue #28 item 8). A
page holds workers in id order, at most ``page_size`` of them (0: ``MAX_PAGE_SIZE``) and at most
``PAGE_BYTES`` encoded (or half the daemon's ``limits.max_message_bytes``, when that is less),
always at least one. Its token names the page's last id, so a worker
registered or removed meanwhile shifts no other worker off a page; one registered meanwhile with
an id sorting before the token's shows only on a later listing.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Iterable

from ..errors import InvalidRequest
from ..index.workers import MAX_WORKERS, Worker
from .convert import pb

__all__ = ["MAX_PAGE_SIZE", "PAGE_BYTES", "worker_page"]

#: most encoded bytes of workers on one page: a quarter of gRPC's default receive limit
PAGE_BYTES = 1 << 20
#: most workers on one page, and the size of a page that asks for none in particular
MAX_PAGE_SIZE = MAX_WORKERS
#: a repeated field's tag and length prefix, at most, per worker on the page
_FIELD_OVERHEAD = 6


def worker_page(
    workers: Iterable[Worker], describe: Callable[[Worker], pb.Worker], page_size: int = 0, page_token: str = "",
    max_bytes: int = PAGE_BYTES,
) -> tuple[list[pb.Worker], str]:
    """The page of ``workers`` (described by ``describe``) after ``page_token``'s, and the
    token of the next page ("" when this one is the last); its workers take at most
    ``max_bytes`` encoded, unless the first alone takes more. Raises ``InvalidRequest`` for a
    token this module did not make."""
    after = _decode(page_token) if page_token else None
    limit = min(page_size, MAX_PAGE_SIZE) if page_size else MAX_PAGE_SIZE
    ordered = sorted((w for w in workers if after is None or w.id > after), key=lambda w: w.id)
    page: list[pb.Worker] = []
    size = 0
    for worker in ordered:
        message = describe(worker)
        grown = size + message.ByteSize() + _FIELD_OVERHEAD
        if page and (len(page) == limit or grown > max_bytes):
            return page, _encode(page[-1].id)
        page.append(message)
        size = grown
    return page, ""


def _encode(last_id: str) -> str:
    return base64.urlsafe_b64encode(last_id.encode()).decode("ascii")


def _decode(token: str) -> str:
    try:
        return base64.urlsafe_b64decode(token.encode("ascii")).decode()
    except (UnicodeError, binascii.Error, ValueError):
        raise InvalidRequest("page_token is not a next_page_token this router gave") from None
