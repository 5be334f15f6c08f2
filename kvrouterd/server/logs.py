"""Logging set-up: plain text for people, one JSON object per line for log pipelines.

Lines a client can cause at will (rejections, handler bugs it triggers) go through
``SampledLog``: the first few of a kind per interval, then one line saying how many were left out.

Structured fields passed as ``extra={...}`` (worker_id, request_id, sequence, ...) appear as
``key=value`` in text and as keys in JSON.

Log lines quote what clients sent (ids, endpoints, error messages naming them). Both formats
cut the message at ``MAX_MESSAGE_CHARS`` and each field at ``MAX_FIELD_CHARS``, so a caller's
megabyte id costs a bounded line, not a megabyte one.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from collections.abc import Callable, Hashable, Mapping

__all__ = ["SampledLog", "configure_logging"]

#: longest log message kept, characters (tracebacks are not cut)
MAX_MESSAGE_CHARS = 2048
#: longest structured field value kept, characters
MAX_FIELD_CHARS = 256

_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime"}


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else f"{text[:limit]}...({len(text)} characters)"


def _field(value: object) -> object:
    if isinstance(value, str):
        return _cut(value, MAX_FIELD_CHARS)
    if isinstance(value, (int, float, bool)) or value is None:
        return value
    text = str(value)
    return value if len(text) <= MAX_FIELD_CHARS else _cut(text, MAX_FIELD_CHARS)


def _extras(record: logging.LogRecord) -> dict[str, object]:
    return {k: _field(v) for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


def _message(record: logging.LogRecord) -> str:
    return _cut(record.getMessage(), MAX_MESSAGE_CHARS)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        base = f"{self.formatTime(record, '%Y-%m-%dT%H:%M:%S')} {record.levelname:<7} {record.name}: {_message(record)}"
        extras = _extras(record)
        if extras:
            base += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        if record.exc_info:
            base += "\n" + self.formatException(record.exc_info)
        return base


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": _message(record),
            **_extras(record),
        }
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)


def configure_logging(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger("kvrouterd")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


class SampledLog:
    """At most ``burst`` lines per key per ``interval_s``; the rest are counted, and the first
    line of a key after its interval (or ``flush``) says how many were suppressed.

    Keys come from the code (an RPC and a status code), never from client input, so they stay
    few. ``clock`` is ``time.monotonic`` unless a test passes its own.
    """

    def __init__(self, logger: logging.Logger, burst: int, interval_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.logger = logger
        self.burst = burst
        self.interval_s = interval_s
        self.clock = clock
        #: key -> [interval start, lines logged in it, lines suppressed in it, what they were, level]
        self._windows: dict[Hashable, list] = {}

    def log(self, key: Hashable, level: int, msg: str, *args: object, what: str = "lines",
            exc_info: BaseException | None = None, extra: Mapping[str, object] | None = None) -> bool:
        """Log ``msg % args`` unless ``key`` used its burst this interval; True if logged.
        ``what`` names the lines in the summary ("rejections")."""
        now = self.clock()
        window = self._windows.get(key)
        if window is None or now - window[0] >= self.interval_s:
            if window is not None:
                self._summarise(key, window)
            window = self._windows[key] = [now, 0, 0, what, level]
        if window[1] >= self.burst:
            window[2] += 1
            return False
        window[1] += 1
        self.logger.log(level, msg, *args, exc_info=exc_info, extra=extra)
        return True

    def flush(self, now: float | None = None) -> None:
        """Summarise every key whose interval has ended (the daemon's maintenance tick calls it)."""
        now = self.clock() if now is None else now
        for key, window in list(self._windows.items()):
            if now - window[0] >= self.interval_s:
                self._summarise(key, window)
                del self._windows[key]

    def _summarise(self, key: Hashable, window: list) -> None:
        if window[2]:
            name = " ".join(map(str, key)) if isinstance(key, tuple) else str(key)
            self.logger.log(window[4], "%s: suppressed %d more %s", name, window[2], window[3],
                            extra={"interval_s": self.interval_s})
