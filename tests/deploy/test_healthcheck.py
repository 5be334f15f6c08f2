"""The image's HEALTHCHECK, replayed against real daemons started as the image's CMD starts them.

No Docker engine: the HEALTHCHECK command is read from the Dockerfile and run as it is (plus
``--pid``, since here the daemon is not PID 1 and other daemons may run on this machine), against
``kvrouterd serve`` processes on a non-default address, over TLS with client certificates, with
the settings coming from flags, a config file relative to the daemon's directory, and
KVROUTERD_* variables. The static side (the command names no address) is in test_dockerfile.py.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ..integration.test_security import make_ca, make_leaf
from .dockerfile import healthcheck, parse

ROOT = Path(__file__).resolve().parents[2]
KVROUTERD = Path(sys.executable).parent / "kvrouterd"

pytestmark = pytest.mark.slow  # two daemon start-ups, about 5 s each on a loaded machine


def image_healthcheck() -> list[str]:
    df = parse((ROOT / "Dockerfile").read_text())
    _, cmd = healthcheck(df.final.last("HEALTHCHECK").args)  # type: ignore[union-attr]
    assert cmd[0] == "python"
    return [sys.executable, *cmd[1:]]


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVROUTERD_", "OTEL_"))}
    return {**env, **extra}


@contextlib.contextmanager
def daemon(args: list[str], env: dict[str, str], cwd: Path) -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen([str(KVROUTERD), "serve", *args], env=env, cwd=cwd,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield proc
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def run_check(proc: subprocess.Popen[str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*image_healthcheck(), "--pid", str(proc.pid), *extra], env=clean_env(),
                          capture_output=True, text=True, timeout=30, check=False, cwd="/")


def until_healthy(proc: subprocess.Popen[str], *extra: str) -> None:
    deadline = time.monotonic() + 30
    while (hc := run_check(proc, *extra)).returncode != 0:
        assert proc.poll() is None, f"daemon exited: {proc.stdout.read() if proc.stdout else ''}"
        assert time.monotonic() < deadline, f"health check never passed: {hc.stderr}"
        time.sleep(0.3)


def test_plaintext_on_a_non_default_address_from_the_listen_flag(tmp_path: Path) -> None:
    port = free_port("127.0.0.2")
    with daemon(["--listen", f"127.0.0.2:{port}"], clean_env(), tmp_path) as proc:
        until_healthy(proc)
    # the daemon is gone: the check fails, saying why
    hc = run_check(proc)
    assert hc.returncode == 1 and "no `kvrouterd serve` process" in hc.stderr


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command line")
def test_mutual_tls_from_a_relative_config_file_and_variables(tmp_path: Path) -> None:
    make_ca(tmp_path, "ca")
    make_leaf(tmp_path, "ca", "server")  # names localhost and 127.0.0.1, not 127.0.0.2
    (tmp_path / "kvrouterd.yaml").write_text(
        f"tls: {{cert_file: {tmp_path}/server.crt, key_file: {tmp_path}/server.key}}\n")
    port = free_port("127.0.0.2")
    env = clean_env(KVROUTERD_CONFIG="kvrouterd.yaml", KVROUTERD_LISTEN=f"127.0.0.2:{port}",
                    KVROUTERD_TLS_CA_FILE=str(tmp_path / "ca.crt"), KVROUTERD_TLS_REQUIRE_CLIENT_CERT="true")
    with daemon([], env, tmp_path) as proc:
        until_healthy(proc, "--server-name", "localhost")
        # the certificate does not name 127.0.0.2: without --server-name the check refuses it
        hc = run_check(proc)
        assert hc.returncode == 1 and f"127.0.0.2:{port}: UNAVAILABLE" in hc.stderr, hc.stderr
