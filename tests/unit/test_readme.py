"""The README is the front door: what it documents must match what the code accepts."""

from pathlib import Path

from kvrouterd.cli import SUBCOMMANDS
from kvrouterd.config import ENV_KEYS, ENV_PREFIX
from kvrouterd.policies import registry

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_both_front_door_commands_are_documented():
    assert "make run" in README and "make test" in README


def test_every_environment_override_is_documented():
    missing = [ENV_PREFIX + k for k in ENV_KEYS if ENV_PREFIX + k not in README]
    assert not missing


def test_every_registered_policy_is_documented():
    missing = [f"{kind}:{n}" for kind in ("routing", "eviction") for n in registry.names(kind) if f"`{n}`" not in README]
    assert not missing


def test_linked_docs_exist():
    import re

    root = Path(__file__).resolve().parents[2]
    links = re.findall(r"\]\(((?:docs|clients)/[^)#]+)\)", README)
    assert links and [link for link in links if not (root / link).exists()] == []


def test_subcommands_are_mentioned():
    assert all(f"kvrouterd {name}" in README or f"`{name}`" in README for name in SUBCOMMANDS)


def test_readme_says_ext_proc_is_on_by_default_and_it_is():
    from kvrouterd.config import parse_config

    assert parse_config({}).ext_proc.enabled is True
    assert "endpoint picker**: on by default" in README and "`ext_proc: {enabled: false}` turns it off" in README
