"""Logging set-up: plain text for people, one JSON object per line for log pipelines.

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

__all__ = ["configure_logging"]

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
