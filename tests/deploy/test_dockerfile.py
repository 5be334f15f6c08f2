"""The Dockerfile, checked statically: there is no Docker engine on our machines or in CI.

What a platform team relies on: a pinned slim base, a multi-stage build that installs the
wheel built from this checkout (never a kvrouterd from PyPI), a non-root numeric user, the
gRPC and metrics ports exposed, ``kvrouterd serve`` as the process (exec form, so SIGTERM
reaches it for a graceful drain), a health check, and no secrets baked into the image.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest
import yaml

from .dockerfile import Dockerfile, DockerIgnore, context_files, env_pairs, exec_form, healthcheck, parse

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def df() -> Dockerfile:
    return parse((ROOT / "Dockerfile").read_text())


@pytest.fixture(scope="module")
def ignore() -> DockerIgnore:
    return DockerIgnore((ROOT / ".dockerignore").read_text())


# ---- the parser itself ---------------------------------------------------------------

def test_parser_joins_continuations_substitutes_args_and_names_stages() -> None:
    d = parse(
        "# syntax=docker/dockerfile:1\nARG BASE=python:3.11.1-slim\nFROM ${BASE} AS build\n"
        "RUN a \\\n    # a comment inside\n    && b\nFROM $BASE\nUSER 1:1\n"
    )
    assert [s.name for s in d.stages] == ["build", "1"]
    assert d.stages[0].base == d.stages[1].base == "python:3.11.1-slim"
    assert d.stage("build").all("RUN")[0].args == "a && b"
    with pytest.raises(ValueError):
        parse("RUN x\n")
    with pytest.raises(ValueError):
        exec_form("kvrouterd serve")  # shell form


def test_dockerignore_matcher_follows_last_match_wins() -> None:
    ig = DockerIgnore("**\n!src/\n**/__pycache__/\n!keep.txt\n")
    assert ig.excluded(".git/HEAD") and ig.excluded("secrets.env")
    assert not ig.excluded("src/a.py") and not ig.excluded("keep.txt")
    assert ig.excluded("src/pkg/__pycache__/a.pyc")


# ---- the real Dockerfile -------------------------------------------------------------

def test_multi_stage_build_and_runtime_on_the_same_pinned_slim_base(df: Dockerfile) -> None:
    assert len(df.stages) >= 2
    build, runtime = df.stage("build"), df.final
    # exact patch version AND digest: a rebuild cannot silently pick up a different base
    pinned = re.compile(r"^python:3\.(1[1-9])\.\d+-slim(-[a-z]+)?@sha256:[0-9a-f]{64}$")
    for stage in (build, runtime):
        assert pinned.match(stage.base), stage.base
    assert build.base == runtime.base
    # the runtime stage takes only the built virtualenv from the build stage
    copies = runtime.all("COPY")
    assert any(c.args.startswith("--from=build ") for c in copies)
    assert not [c for c in copies if not c.args.startswith("--from=")], "runtime copies from the context"
    assert not [r for r in runtime.all("RUN") if "pip" in r.args], "runtime stage must not install packages"


def test_installs_the_wheel_built_from_this_checkout(df: Dockerfile) -> None:
    runs = [r.args for r in df.stage("build").all("RUN")]
    assert any(re.search(r"pip wheel --no-deps --wheel-dir (\S+) \.$", r) for r in runs)
    installs = [r for r in runs if " pip install " in r]
    # ... with every dependency at the version the lock pins
    assert installs and all(re.search(r'pip install --constraint constraints\.txt "\$\(echo /\S+/kvrouterd-\*\.whl\)[^"]*"$', r)
                            for r in installs)
    # the extras are optional features of the same wheel, declared in pyproject.toml
    extras = df.stage("build").all("ARG")
    assert [a.args for a in extras] == ["KVROUTERD_EXTRAS"]
    optional = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for extra in filter(None, df.global_args["KVROUTERD_EXTRAS"].split(",")):
        assert extra in optional, extra
    # nothing anywhere installs a package called kvrouterd from an index
    for stage in df.stages:
        for r in stage.all("RUN"):
            words = shlex.split(r.args)
            if "install" in words:
                targets = [w for w in words[words.index("install") + 1:] if not w.startswith("-")]
                assert "kvrouterd" not in targets, r.args


def test_runs_as_a_non_root_numeric_user(df: Dockerfile) -> None:
    user = df.final.last("USER")
    assert user is not None
    uid, _, gid = user.args.partition(":")
    # numeric, so Kubernetes runAsNonRoot can verify it without reading /etc/passwd
    assert uid.isdigit() and int(uid) > 0
    assert gid == "" or (gid.isdigit() and int(gid) > 0)
    # nothing runs as root after the switch
    assert all(i.keyword not in ("RUN", "USER") or i is user for i in df.final.instructions if i.line > user.line)
    # the account the uid belongs to is created in this stage
    assert any(f"--uid {uid}" in r.args for r in df.final.all("RUN"))


def test_exposes_grpc_and_metrics_ports(df: Dockerfile) -> None:
    ports = {p.split("/")[0] for e in df.final.all("EXPOSE") for p in e.args.split()}
    assert {"50051", "9464"} <= ports


def test_entrypoint_is_kvrouterd_serve_in_exec_form(df: Dockerfile) -> None:
    entry, cmd = df.final.last("ENTRYPOINT"), df.final.last("CMD")
    assert entry is not None and cmd is not None
    assert exec_form(entry.args) == ["kvrouterd"]
    args = exec_form(cmd.args)
    assert args[0] == "serve"
    # listens on all interfaces (reachable from outside the container) on the exposed port
    assert args[args.index("--listen") + 1] == "0.0.0.0:50051"


def test_healthcheck_asks_the_standard_grpc_health_service(df: Dockerfile) -> None:
    hc = df.final.last("HEALTHCHECK")
    assert hc is not None
    opts, cmd = healthcheck(hc.args)
    assert {"interval", "timeout", "retries"} <= set(opts)
    # the daemon's own settings decide where and how it is asked (test_healthcheck.py replays it):
    # no address or TLS choice is baked into the image
    assert cmd == ["python", "-m", "kvrouterd.server.healthcheck"]
    from kvrouterd.server import healthcheck as module
    assert "Health/Check" in (module.__doc__ or "") and module.main.__module__ == "kvrouterd.server.healthcheck"


def test_read_only_root_filesystem_friendly(df: Dockerfile) -> None:
    env: dict[str, str] = {}
    for e in df.final.all("ENV"):
        env.update(env_pairs(e.args))
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"  # no __pycache__ writes at run time
    assert env["PATH"].startswith("/opt/kvrouterd/bin:")
    assert not df.final.all("VOLUME")  # state lives in the process; nothing to persist


SECRET_NAME = re.compile(r"pass(word)?|secret|token|api[_-]?key|credential|private", re.IGNORECASE)


def test_no_secrets_baked_into_the_image(df: Dockerfile) -> None:
    names = list(df.global_args)
    for stage in df.stages:
        for i in stage.instructions:
            if i.keyword in ("ENV", "ARG", "LABEL"):
                names += list(env_pairs(i.args)) if i.keyword != "ARG" else [i.args.partition("=")[0]]
            if i.keyword in ("COPY", "ADD"):
                assert not SECRET_NAME.search(i.args), i.args
                assert not re.search(r"\.(pem|key|crt|env)\b", i.args), i.args
            assert i.keyword != "ADD", "ADD can fetch URLs; use COPY"
    assert not [n for n in names if SECRET_NAME.search(n)]


def test_copied_sources_are_in_the_build_context_and_nothing_else_is(df: Dockerfile, ignore: DockerIgnore) -> None:
    files = context_files(ROOT, ignore)
    for c in df.stage("build").all("COPY"):
        *sources, _dest = c.args.split()
        for src in sources:
            assert (ROOT / src).exists(), src
            assert not ignore.excluded(src.rstrip("/")), f"{src} is excluded by .dockerignore"
    assert "pyproject.toml" in files and "kvrouterd/cli.py" in files
    leaked = [f for f in files if f.startswith((".git/", ".venv/", "tests/", "helm/")) or "__pycache__" in f]
    assert not leaked, leaked[:5]


def test_the_lock_pins_every_dependency_the_image_installs_within_pyproject_bounds(df: Dockerfile) -> None:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    assert any("constraints.txt" in c.args.split()[:-1] for c in df.stage("build").all("COPY"))
    pins = {}
    for line in (ROOT / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[canonicalize_name(name)] = version
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"]]
    for extra, deps in project["optional-dependencies"].items():
        if extra != "dev":  # every extra the image may be built with
            wanted += deps
    for spec in map(Requirement, wanted):
        name = canonicalize_name(spec.name)
        assert name in pins, f"{spec.name} is not in constraints.txt: run `make constraints`"
        assert spec.specifier.contains(pins[name], prereleases=True), f"{spec} but constraints.txt pins {pins[name]}"


def test_the_image_serves_metrics_where_its_header_and_expose_say(df: Dockerfile) -> None:
    """The header's `docker run -p 9464:9464` reaches /metrics: the image's own config listens there."""
    env = {}
    for e in df.final.all("ENV"):
        env.update(env_pairs(e.args))
    (write,) = [r.args for r in df.final.all("RUN") if env["KVROUTERD_CONFIG"] in r.args]
    text = re.search(r"printf '([^']*)' > " + re.escape(env["KVROUTERD_CONFIG"]), write).group(1)
    config = yaml.safe_load(text.encode().decode("unicode_escape"))
    host, _, port = config["metrics"]["listen"].rpartition(":")
    assert host == "0.0.0.0" and port in {p.split("/")[0] for e in df.final.all("EXPOSE") for p in e.args.split()}
    header = (ROOT / "Dockerfile").read_text().split("\nFROM")[0]
    assert f"-p {port}:{port} kvrouterd" in header
