"""The loop watchdog's stack sample must not let a collection start inside ``sys._current_frames``."""

from __future__ import annotations

import gc
import sys
import threading

from kvrouterd.telemetry import loop_lag


def test_no_collection_can_start_while_the_frames_are_read(monkeypatch) -> None:
    """CPython gh-106883: a collection inside ``_current_frames`` deadlocks the process."""
    seen = []
    real = sys._current_frames

    def recording() -> dict:
        seen.append(gc.isenabled())
        return real()

    monkeypatch.setattr(sys, "_current_frames", recording)
    assert gc.isenabled()
    frame = loop_lag._thread_frame(threading.get_ident())
    assert seen == [False] and gc.isenabled()
    assert frame is not None and frame.f_code.co_name == "recording"  # this thread, inside the read


def test_a_collector_already_off_stays_off() -> None:
    gc.disable()
    try:
        loop_lag._thread_frame(threading.get_ident())
        assert not gc.isenabled()
    finally:
        gc.enable()
