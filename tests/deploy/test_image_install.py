"""The Dockerfile's build steps, run for real in a temporary directory (no Docker engine needed).

SLOW (about 25 s with a warm pip cache; it reuses the machine's pip cache): the build
stage's COPY and RUN instructions (but its apt-get of a C compiler: this machine has one) are replayed with /wheels and /opt/kvrouterd mapped into a
temporary directory and the stage's ARGs set to their defaults: copy the sources the
Dockerfile copies, build the wheel, create a fresh virtualenv, install the wheel with its
dependencies and default extras, run ``kvrouterd --help``. What got installed must be
exactly what constraints.txt pins. Then the installed daemon is started as the image's CMD
starts it and the image's HEALTHCHECK command is run against it, and SIGTERM must stop it
cleanly; started again with OTLP configured, its decision spans must reach a real OTLP
receiver (tests/otlp.py); and with the runtime stage's own config file, it serves /metrics
on the port the image's header publishes.
"""

from __future__ import annotations

import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml

from tests.otlp import check_daemon_exports_decision_spans, otel_env, running_receiver

from .dockerfile import env_pairs, exec_form, healthcheck, parse

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def _isolated_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON", "KVROUTERD_"))}
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# pip builds and installs the package into a fresh venv: ~1.5 min idle, several on a loaded machine
@pytest.mark.timeout(900)
def test_dockerfile_install_steps_produce_a_working_kvrouterd(tmp_path: Path) -> None:
    df = parse((ROOT / "Dockerfile").read_text())
    build = df.stage("build")
    src, wheels, venv = tmp_path / "src", tmp_path / "wheels", tmp_path / "opt" / "kvrouterd"
    src.mkdir()
    for c in build.all("COPY"):
        *sources, dest = c.args.split()
        for s in sources:
            target = src / dest / Path(s).name if dest.endswith("/") else src / dest
            if (ROOT / s).is_dir():
                shutil.copytree(ROOT / s, target, ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.so"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(ROOT / s, target)
    env = _isolated_env()
    for a in build.all("ARG"):  # a stage ARG without a default takes the global one, as in docker build
        name, _, default = a.args.partition("=")
        env[name] = default or df.global_args.get(name, "")
    for r in build.all("RUN"):
        if r.args.startswith("apt-get "):
            continue  # the build stage's compiler: this machine's own gcc stands in for it
        cmd = r.args.replace("/opt/kvrouterd", str(venv)).replace("/wheels", str(wheels))
        if cmd.startswith("python "):
            cmd = f"{shlex.quote(sys.executable)} {cmd[len('python '):]}"
        proc = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=src, env=env, capture_output=True,
                              text=True, timeout=240, check=False)
        assert proc.returncode == 0, f"Dockerfile line {r.line}: {cmd}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"

    # the wheel is this checkout's, at this checkout's version, and that is what got installed
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    # one wheel, compiled for this platform (the native fast path is inside)
    (wheel,) = wheels.iterdir()
    assert wheel.name.startswith(f"kvrouterd-{version}-cp3") and wheel.suffix == ".whl", wheel.name
    py = venv / "bin" / "python"
    where = subprocess.run([str(py), "-c", ("import kvrouterd, importlib.metadata as m; "
                            "print(kvrouterd.__file__); print(m.version('kvrouterd'))")],
                           env=env, capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    assert where[0].startswith(str(venv)) and where[1] == version
    # the default extras came along (ext_proc's local tokenizer, discovery's Kubernetes client)
    subprocess.run([str(py), "-c", "import tokenizers, kubernetes_asyncio"], env=env, check=True, cwd=tmp_path)
    # every installed distribution at the version the lock pins: the install resolved from it
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if line and not line.startswith("#"))
    pins = {name.lower().replace("_", "-"): version for name, version in pins.items()}
    frozen = subprocess.run([str(py), "-m", "pip", "freeze", "--all", "--exclude", "kvrouterd"], env=env,
                            capture_output=True, text=True, check=True, cwd=tmp_path).stdout.split()
    installed = {n.lower().replace("_", "-"): v for n, _, v in (line.partition("==") for line in frozen)}
    unpinned = {n: v for n, v in installed.items() if pins.get(n) != v and n not in ("pip", "setuptools", "wheel")}
    assert not unpinned, f"installed but not at constraints.txt's version: {unpinned}"

    # the image's CMD, with the port moved to a free one; then the image's HEALTHCHECK
    port = _free_port()
    cmd = exec_form(df.final.last("CMD").args)  # type: ignore[union-attr]
    cmd[cmd.index("--listen") + 1] = f"127.0.0.1:{port}"
    run_env = {**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "KVROUTERD_LOG_FORMAT": "json"}
    daemon = subprocess.Popen([str(venv / "bin" / "kvrouterd"), *cmd], env=run_env, cwd=tmp_path,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _, check = healthcheck(df.final.last("HEALTHCHECK").args)  # type: ignore[union-attr]
        # as the image runs it, but naming the daemon: here it is not PID 1
        check = [str(venv / "bin" / check[0]), *check[1:], "--pid", str(daemon.pid)]
        deadline = time.monotonic() + 30
        while True:
            hc = subprocess.run(check, env=run_env, capture_output=True, text=True, timeout=20, cwd=tmp_path, check=False)
            if hc.returncode == 0:
                break
            assert daemon.poll() is None, f"daemon exited: {daemon.stdout.read() if daemon.stdout else ''}"
            assert time.monotonic() < deadline, f"health check never passed: {hc.stderr[-1000:]}"
            time.sleep(0.3)
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=20) == 0
    finally:
        if daemon.poll() is None:
            daemon.kill()
            daemon.wait()

    # tracing to a real OTLP receiver, configured as the chart's otel.endpoint does
    with running_receiver() as receiver:
        check_daemon_exports_decision_spans([str(venv / "bin" / "kvrouterd")], {**env, **otel_env(receiver, "grpc")},
                                            receiver, "grpc", cwd=tmp_path)

    # the runtime stage's config file and ENV: /metrics where the header's `-p 9464:9464` points
    runtime_env = {}
    for e in df.final.all("ENV"):
        runtime_env.update(env_pairs(e.args))
    etc = tmp_path / "etc" / "kvrouterd"
    for r in df.final.all("RUN"):
        if "/etc/kvrouterd" in r.args:
            cmd = r.args.replace("/etc/kvrouterd", str(etc))
            subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], check=True, cwd=tmp_path)
    config_file = runtime_env["KVROUTERD_CONFIG"].replace("/etc/kvrouterd", str(etc))
    shown = subprocess.run([str(venv / "bin" / "kvrouterd"), "config", "show"], capture_output=True, text=True,
                           env={**env, "KVROUTERD_CONFIG": config_file}, check=True, cwd=tmp_path).stdout
    assert yaml.safe_load(shown)["metrics"]["listen"] == "0.0.0.0:9464"
