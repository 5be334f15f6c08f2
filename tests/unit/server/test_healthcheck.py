"""How the health check finds the daemon and rebuilds the address and TLS settings it serves with."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvrouterd.errors import ConfigError
from kvrouterd.server.healthcheck import DaemonProcess, dial_address, find_daemon, read_daemon


@pytest.mark.parametrize(("listen", "dial"), [
    ("0.0.0.0:50051", "127.0.0.1:50051"),
    ("[::]:6000", "[::1]:6000"),
    ("10.1.2.3:7000", "10.1.2.3:7000"),
    ("[fd00::5]:50051", "[fd00::5]:50051"),
    ("localhost:50051", "localhost:50051"),
])
def test_wildcard_listeners_are_dialled_on_loopback(listen: str, dial: str) -> None:
    assert dial_address(listen) == dial


def daemon(argv: list[str], environ: dict[str, str] | None = None, cwd: str = "/") -> DaemonProcess:
    return DaemonProcess(7, ["/opt/kvrouterd/bin/python", "/opt/kvrouterd/bin/kvrouterd", *argv],
                         environ or {}, Path(cwd))


def test_the_listen_flag_wins_over_the_variable_and_the_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("listen: 0.0.0.0:1111\n")
    env = {"KVROUTERD_LISTEN": "0.0.0.0:2222"}
    assert daemon(["serve", "--config", "c.yaml"], cwd=str(tmp_path)).config().listen == "0.0.0.0:1111"
    assert daemon(["serve", "--config", "c.yaml"], env, str(tmp_path)).config().listen == "0.0.0.0:2222"
    cfg = daemon(["serve", "--config", "c.yaml", "--listen", "127.0.0.9:3333"], env, str(tmp_path)).config()
    assert cfg.listen == "127.0.0.9:3333"
    assert daemon(["serve", "--listen=[::]:4444"]).config().listen == "[::]:4444"


def test_tls_comes_from_the_daemons_file_and_variables(tmp_path: Path) -> None:
    for name in ("s.crt", "s.key", "ca.crt"):
        (tmp_path / name).write_text("x")
    (tmp_path / "c.yaml").write_text(f"tls: {{cert_file: {tmp_path}/s.crt, key_file: {tmp_path}/s.key}}\n")
    env = {"KVROUTERD_CONFIG": "c.yaml", "KVROUTERD_TLS_CA_FILE": f"{tmp_path}/ca.crt",
           "KVROUTERD_TLS_REQUIRE_CLIENT_CERT": "true"}
    tls = daemon(["serve"], env, str(tmp_path)).config().tls
    assert tls.enabled and tls.require_client_cert and tls.ca_file == f"{tmp_path}/ca.crt"
    # the daemon's settings, not the checker's: our own KVROUTERD_* variables do not leak in
    os.environ["KVROUTERD_LISTEN"] = "0.0.0.0:1"
    try:
        assert daemon(["serve"]).config().listen == "127.0.0.1:50051"
    finally:
        del os.environ["KVROUTERD_LISTEN"]


def test_a_config_the_daemon_could_not_have_started_with_is_an_error() -> None:
    with pytest.raises(ConfigError):
        daemon(["serve"], {"KVROUTERD_BLOCK_SIZE": "0"}).config()


def fake_proc(root: Path, pid: int, argv: list[str], env: dict[str, str], cwd: Path) -> None:
    d = root / str(pid)
    d.mkdir(parents=True)
    (d / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (d / "environ").write_bytes(b"\0".join(f"{k}={v}".encode() for k, v in env.items()) + b"\0")
    (d / "cwd").symlink_to(cwd)


def test_pid_1_is_the_daemon_or_it_is_found_among_the_others(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    daemon_argv = ["/opt/kvrouterd/bin/python", "/opt/kvrouterd/bin/kvrouterd", "serve", "--listen", "[::]:9"]
    fake_proc(proc, 1, ["/bin/sh", "-c", "sleep infinity"], {}, tmp_path)
    fake_proc(proc, 40, ["python", "-m", "http.server"], {}, tmp_path)
    fake_proc(proc, 41, daemon_argv, {"KVROUTERD_LOG_LEVEL": "debug"}, tmp_path)
    found = find_daemon(proc)
    assert found is not None and found.pid == 41
    assert found.environ == {"KVROUTERD_LOG_LEVEL": "debug"} and found.cwd == tmp_path
    assert found.config().listen == "[::]:9"
    assert read_daemon(1, proc) is None and read_daemon(40, proc) is None and read_daemon(99, proc) is None
    # docker run --init: PID 1 is tini, whose command line carries the daemon's, with its environment
    tini = tmp_path / "tini"
    fake_proc(tini, 1, ["/sbin/tini", "--", "kvrouterd", "serve", "--listen", "0.0.0.0:7"], {}, tmp_path)
    found = find_daemon(tini)
    assert found is not None and found.config().listen == "0.0.0.0:7"
