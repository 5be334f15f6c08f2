"""``kvrouterd serve`` in a process of its own, as in production: what the stall benchmarks
measure (through ``harness.daemon``) and the fuzz test's out-of-process mode attacks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path


class ServeProcess:
    """The daemon started from ``config_file`` (json logs on stderr); ``start`` returns once it
    serves. Its stderr is drained from then on, so it never blocks on a full pipe; the WARNING
    and ERROR lines (stall warnings among them) are kept in ``warnings``."""

    def __init__(self, config_file: Path) -> None:
        self.config_file = config_file
        self.port = 0
        self.metrics_port = 0
        self.warnings: list[str] = []
        self.proc: subprocess.Popen[str] | None = None
        self._reader: threading.Thread | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvrouterd", "serve", "--config", str(self.config_file), "--log-format", "json"],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        assert self.proc.stderr is not None
        deadline = time.monotonic() + 60
        for line in self.proc.stderr:
            record = json.loads(line) if line.startswith("{") else {}
            self.metrics_port = record.get("metrics_port", self.metrics_port)
            if record.get("msg") == "serving":
                self.port = record["port"]
                break
            if time.monotonic() > deadline:
                break
        if not self.port:
            self.proc.kill()
            raise RuntimeError("kvrouterd serve did not start")
        self._reader = threading.Thread(target=self._read_log, name="kvrouterd-serve-log", daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        """The daemon's process id (its main thread's, the event loop's, too)."""
        assert self.proc is not None, "start() first"
        return self.proc.pid

    def _read_log(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        for line in self.proc.stderr:
            if '"level": "warning"' in line or '"level": "error"' in line:
                self.warnings.append(line.strip())

    def stop(self) -> None:
        """SIGTERM, as a pod's shutdown sends, then wait for the daemon to drain and exit."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        if self._reader is not None:
            self._reader.join(10)
