"""Numbers read from text, in ASCII decimal only: every port, rank, count and code parsed from a string.

Python's own checks are wider than any wire format or config file means. ``str.isdigit()`` is
true for ``'²'`` (which ``int()`` then refuses: an uncaught ValueError, answered UNKNOWN) and
for ``'٨٠'`` (Arabic-Indic 80, which ``int()`` reads as 80); ``int()`` and ``float()`` also take
surrounding spaces and ``_`` separators, and ``float()`` takes ``inf`` and ``nan``. A port one
component reads as a number and another refuses (libzmq dials only ASCII digits) passes every
check and then fails forever, so a number the daemon accepts is one every program reads alike.
"""

from __future__ import annotations

import argparse
import re

__all__ = ["decimal_arg", "number_arg", "parse_decimal", "parse_number"]

# explicit [0-9], never \d: \d matches every script's digits
_DECIMAL = re.compile(r"[0-9]+")
_SIGNED = re.compile(r"-?[0-9]+")
_NUMBER = re.compile(r"[+-]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def parse_decimal(text: str, *, signed: bool = False) -> int | None:
    """``text`` as an int if it is ASCII digits (after one ``-`` when ``signed``), else None."""
    if not (_SIGNED if signed else _DECIMAL).fullmatch(text):
        return None
    try:
        return int(text)
    except ValueError:  # more digits than int() converts (sys.get_int_max_str_digits)
        return None


def parse_number(text: str) -> float | None:
    """``text`` as a finite float if it is an ASCII decimal number (``1``, ``-2.5``, ``.5``,
    ``1e3``), else None: no other script's digits, no ``_``, no spaces, no inf or nan."""
    if not _NUMBER.fullmatch(text):
        return None
    value = float(text)
    return value if value - value == 0.0 else None  # 1e999 reads as inf


def decimal_arg(text: str) -> int:
    """argparse ``type=`` for an integer flag: ASCII digits, optionally negative."""
    value = parse_decimal(text, signed=True)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected an integer (ASCII digits), got {text!r}")
    return value


def number_arg(text: str) -> float:
    """argparse ``type=`` for a number flag: an ASCII decimal number, finite."""
    value = parse_number(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected a number (ASCII digits), got {text!r}")
    return value
