"""The CLI as a new user meets it: version, config check/show, env-variable errors, bind errors,
plain help text (one line per flag, details in the docs), `policies --json`, `status`'s default target."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import kvrouterd
from kvrouterd import admin
from kvrouterd.cli import build_parser, main, plain_text
from kvrouterd.config import load_config
from kvrouterd.errors import ConfigError
from kvrouterd.server.app import bind_problem


def kvrouterd_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("KVROUTERD_") or k == "KVROUTERD_PURE_PYTHON"}
    return subprocess.run([sys.executable, "-m", "kvrouterd", *args], capture_output=True, text=True,
                          env={**clean, **(env or {})}, timeout=60)


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.startswith(f"kvrouterd {kvrouterd.__version__} ")


def test_unknown_kvrouterd_variable_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="unknown environment variable KVROUTERD_FOO"):
        load_config(environ={"KVROUTERD_FOO": "1"})
    # the token variable auth.token_env names may carry the prefix
    load_config(environ={"KVROUTERD_AUTH_TOKEN_ENV": "KVROUTERD_TOKEN", "KVROUTERD_TOKEN": "s3cret"})


@pytest.mark.parametrize("variable, value, field", [
    ("KVROUTERD_BLOCK_SIZE", "abc", "block_size"),
    ("KVROUTERD_ROUTING_POLICY", "nope", "routing"),
    ("KVROUTERD_TRACES", "bogus", "telemetry.traces"),
])
def test_env_sourced_errors_name_the_variable(variable, value, field):
    with pytest.raises(ConfigError) as err:
        load_config(environ={variable: value})
    assert str(err.value).startswith(f"{variable}={value!r}: {field}")


def test_a_flag_overriding_a_bad_variable_is_not_blamed_on_it():
    with pytest.raises(ConfigError) as err:
        load_config(overrides={"block_size": 0}, environ={"KVROUTERD_BLOCK_SIZE": "abc"})
    assert str(err.value).startswith("block_size:")


def test_serve_reports_an_unknown_variable_in_one_line():
    done = kvrouterd_cli("serve", env={"KVROUTERD_LISTN": "0.0.0.0:1"})
    assert done.returncode == 2
    assert "unknown environment variable KVROUTERD_LISTN" in done.stdout + done.stderr
    assert "Traceback" not in done.stderr


def test_config_check_and_show_round_trip(tmp_path, capsys):
    good = tmp_path / "good.yaml"
    good.write_text("routing: {name: least_loaded}\nblock_size: 32\n")
    assert main(["config", "check", str(good)]) == 0
    assert capsys.readouterr().out.strip() == f"{good}: ok"

    bad = tmp_path / "bad.yaml"
    bad.write_text("routing: {name: cache_aware, cache_threshold: 7}\n")
    assert main(["config", "check", str(bad)]) == 2
    assert "routing" in capsys.readouterr().err

    os.environ.pop("KVROUTERD_LISTEN", None)
    assert main(["config", "show", "--config", str(good), "--listen", "0.0.0.0:6000"]) == 0
    shown = yaml.safe_load(capsys.readouterr().out)
    assert shown["listen"] == "0.0.0.0:6000" and shown["block_size"] == 32
    assert shown["routing"] == {"name": "least_loaded"}
    # what show prints is itself a valid config file that loads to the same config
    again = tmp_path / "shown.yaml"
    again.write_text(yaml.safe_dump(shown))
    assert load_config(again, environ={}) == load_config(good, {"listen": "0.0.0.0:6000"}, environ={})


def test_config_show_includes_the_environment():
    done = kvrouterd_cli("config", "show", env={"KVROUTERD_BLOCK_SIZE": "64"})
    assert done.returncode == 0, done.stderr
    assert yaml.safe_load(done.stdout)["block_size"] == 64


def test_port_in_use_is_said_in_kvrouterds_own_line_without_tracebacks():
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        assert bind_problem(f"127.0.0.1:{port}") == "the port is already in use"
        done = kvrouterd_cli("serve", "--listen", f"127.0.0.1:{port}")
        assert done.returncode == 2
        assert f"kvrouterd: listen: cannot bind 127.0.0.1:{port}: the port is already in use" in done.stdout

        # the metrics port fails after the gRPC server started: that server is closed, not left to the GC
        done = kvrouterd_cli("serve", "--listen", "127.0.0.1:0", env={"KVROUTERD_METRICS_LISTEN": f"127.0.0.1:{port}"})
        assert done.returncode == 2
        assert "metrics.listen: cannot bind" in done.stdout and "address already in use" in done.stdout
        assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_unassignable_address_is_named():
    # 192.0.2.0/24 is TEST-NET-1: never assigned to a host
    assert bind_problem("192.0.2.1:5000") == "the address is not assigned to this machine"


def _parsers(parser: argparse.ArgumentParser, path: tuple[str, ...] = ()):
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                yield from _parsers(child, (*path, name))


def test_help_has_no_rest_markup_and_every_flag_has_help():
    assert plain_text("``x`` and :class:`Router` and `link <http://a>`_ Example::") == "x and Router and link Example:"
    for path, parser in _parsers(build_parser()):
        text = parser.format_help()
        assert "``" not in text and ":class:" not in text, path
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                assert action.help, f"kvrouterd {' '.join(path)} {action.option_strings[0]} has no help"


#: the code's vocabulary, not a user's: calls like Router(cfg), module paths, private names
_INTERNAL = re.compile(r"[A-Za-z_]\(|\bkvrouterd\.[a-z_]|\bsim\.[a-z_]|\b[A-Za-z]+\._[a-z]")
_REPO = Path(kvrouterd.__file__).resolve().parents[1]
_FLAG_HELP_CHARS = 80


def _details_exist(epilog: str) -> bool:
    """The help's last line, ``Details: PAGE[, PAGE] [(Section)]``, names pages (and a heading) that exist."""
    line = epilog.strip().splitlines()[-1]
    match = re.fullmatch(r"Details: (.+?)(?: \((.+)\))?", line)
    assert match, line
    pages = [_REPO / page for page in match.group(1).split(", ")]
    headings = [h.replace("`", "") for h in re.findall(r"^#+ (.+)$", pages[-1].read_text(), re.MULTILINE)]
    return all(page.is_file() for page in pages) and (
        match.group(2) is None or any(match.group(2) in heading for heading in headings))


def test_help_is_one_line_per_flag_with_the_details_in_the_docs(monkeypatch):
    monkeypatch.setenv("COLUMNS", "100")
    for path, parser in _parsers(build_parser()):
        where = "kvrouterd " + " ".join(path)
        text = parser.format_help()
        assert not _INTERNAL.search(text), (where, _INTERNAL.search(text))
        assert all(len(line) <= 100 for line in text.splitlines()), where
        if path and parser.description is not None:
            # what the command does in one line; the paragraphs are in the page the help names
            assert "\n" not in parser.description and len(parser.description) <= 100, where
            assert _details_exist(parser.epilog), where
        formatter = parser._get_formatter()
        for action in parser._actions:
            if action.option_strings and not isinstance(action, argparse._HelpAction):
                flag = formatter._expand_help(action)
                # one short sentence ("e.g. x" is not a sentence break)
                assert len(flag) <= _FLAG_HELP_CHARS and not re.search(r"\w\w\. ", flag), \
                    f"{where} {action.option_strings[0]}: {flag}"


def test_policies_lists_a_summary_per_policy_and_json(capsys):
    assert main(["policies", "--kind", "routing"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "  least_loaded: the worker with the fewest pending prefill tokens." in lines
    assert any("load_metric = 'requests'  (requests | prefill_tokens)" in line for line in lines)

    assert main(["policies", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert set(data) == {"routing", "eviction"}
    for kind in data.values():
        for name, info in kind.items():
            assert info["summary"] and "``" not in info["summary"], name
    dualmap = {p["name"]: p for p in data["routing"]["dualmap"]["parameters"]}
    assert dualmap["prefill_model"]["allowed"] == "linear | power_law"
    assert dualmap["prefill_model"]["default"] == "linear"


def test_status_defaults_to_the_default_listen_address():
    args = build_parser().parse_args(["status"])
    assert args.target == admin.DEFAULT_TARGET == load_config(environ={}).listen


def test_config_check_lists_every_bad_field(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("block_size: 0\nrouting: cache_aware\nlimits: {max_prompt_tokens: many}\nlisten: nope\n")
    assert main(["config", "check", str(bad)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvrouterd: {bad}: 3 configuration errors:"
    assert [line.split(":")[0].strip() for line in err[1:]] == ["limits.max_prompt_tokens", "listen", "block_size"]


def test_config_check_refuses_what_serve_refuses_at_start(tmp_path):
    # the values are fine; the files serve reads before it listens are not there
    for text, field in (("auth: {token_file: %s/missing-token}\n" % tmp_path, "auth.token_file"),
                        ("tls: {cert_file: %s/tls.crt, key_file: %s/tls.key}\n" % (tmp_path, tmp_path), "tls")):
        path = tmp_path / "config.yaml"
        path.write_text(text)
        assert load_config(path, environ={})  # loading alone passes: `config show` and the chart tests load pod paths
        check = kvrouterd_cli("config", "check", str(path))
        serve = kvrouterd_cli("serve", "--config", str(path), "--listen", "127.0.0.1:0")
        assert check.returncode == serve.returncode == 2, (check.stderr, serve.stdout)
        assert f"  {field}" in check.stderr and field in serve.stdout + serve.stderr
    path.write_text("auth: {token_file: %s/token}\n" % tmp_path)
    (tmp_path / "token").write_text("s3cret\n")
    assert kvrouterd_cli("config", "check", str(path)).returncode == 0


def test_serve_takes_the_metrics_listener_as_a_flag(tmp_path, capsys):
    assert main(["config", "show", "--metrics-listen", "127.0.0.1:9464"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["metrics"]["listen"] == "127.0.0.1:9464"
    parser = build_parser()
    assert parser.parse_args(["serve", "--metrics-listen", "0.0.0.0:9464"]).metrics_listen == "0.0.0.0:9464"
