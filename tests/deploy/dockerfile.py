"""Just enough of a Dockerfile parser to check our Dockerfile without a Docker engine.

Handles comments, parser directives, backslash line continuations, ``ARG`` defaults
substituted into ``FROM`` (``${NAME}`` / ``$NAME``), stages (``FROM ... AS name``) and the
exec (JSON) form of ``CMD`` / ``ENTRYPOINT`` / ``HEALTHCHECK CMD``. Also a ``.dockerignore``
matcher with Docker's rule: patterns apply in order, ``!`` re-includes, the last match wins.
"""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class Instruction:
    keyword: str
    args: str
    line: int


@dataclass
class Stage:
    base: str  # with global ARG defaults substituted
    name: str
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    @property
    def final(self) -> Stage:
        return self.stages[-1]

    def stage(self, name: str) -> Stage:
        return next(s for s in self.stages if s.name == name)


def _logical_lines(text: str) -> list[tuple[int, str]]:
    out: list[tuple[int, str]] = []
    buf, start = "", 0
    for n, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not buf and (not stripped or stripped.startswith("#")):
            continue  # comments and directives (# syntax=...) are not instructions
        if buf and stripped.startswith("#"):
            continue  # Docker drops comment lines inside a continuation
        if not buf:
            start = n
        if stripped.endswith("\\"):
            buf += stripped[:-1].rstrip() + " "
            continue
        buf += stripped
        out.append((start, buf))
        buf = ""
    if buf:
        raise ValueError(f"line {start}: continuation runs off the end of the file")
    return out


def _substitute(value: str, args: dict[str, str]) -> str:
    return re.sub(r"\$\{(\w+)\}|\$(\w+)", lambda m: args.get(m.group(1) or m.group(2), ""), value)


def parse(text: str) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line, logical in _logical_lines(text):
        keyword, _, args = logical.partition(" ")
        keyword, args = keyword.upper(), args.strip()
        if keyword == "FROM":
            words = args.split()
            words = [w for w in words if not w.startswith("--")]
            name = words[2] if len(words) >= 3 and words[1].upper() == "AS" else str(len(stages))
            stages.append(Stage(_substitute(words[0], global_args), name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"line {line}: {keyword} before the first FROM")
            key, _, default = args.partition("=")
            global_args[key] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args, line))
    if not stages:
        raise ValueError("no FROM instruction")
    return Dockerfile(global_args, stages)


def exec_form(args: str) -> list[str]:
    """The JSON-array form of CMD/ENTRYPOINT; shell form is rejected (it breaks signal delivery)."""
    value = json.loads(args)
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise ValueError(f"not an exec-form array: {args}")
    return value


def env_pairs(args: str) -> dict[str, str]:
    """ENV/LABEL ``k=v k2="v 2"`` pairs (the legacy ``ENV k v`` form too)."""
    words = shlex.split(args)
    if words and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    return dict(w.split("=", 1) for w in words)


def healthcheck(args: str) -> tuple[dict[str, str], list[str]]:
    """Options and the exec-form command of a HEALTHCHECK."""
    opts: dict[str, str] = {}
    rest = args
    while rest.startswith("--"):
        opt, _, rest = rest.partition(" ")
        k, _, v = opt[2:].partition("=")
        opts[k] = v
        rest = rest.strip()
    keyword, _, cmd = rest.partition(" ")
    if keyword.upper() != "CMD":
        raise ValueError(f"HEALTHCHECK without CMD: {args}")
    return opts, exec_form(cmd.strip())


class DockerIgnore:
    def __init__(self, text: str) -> None:
        self.rules: list[tuple[bool, str]] = []
        for raw in text.splitlines():
            line = raw.strip()
            if not line or line.startswith("#"):
                continue
            include = line.startswith("!")
            pattern = line[1:].strip() if include else line
            self.rules.append((include, pattern.strip("/")))

    @staticmethod
    def _matches(pattern: str, path: str) -> bool:
        if pattern == "**":
            return True
        # a pattern matching a directory excludes everything below it
        candidates = [path] + ["/".join(path.split("/")[:i]) for i in range(1, path.count("/") + 1)]
        for cand in candidates:
            if fnmatch.fnmatchcase(cand, pattern):
                return True
            if pattern.startswith("**/") and any(
                fnmatch.fnmatchcase("/".join(cand.split("/")[i:]), pattern[3:]) for i in range(cand.count("/") + 1)
            ):
                return True
        return False

    def excluded(self, path: str) -> bool:
        result = False
        for include, pattern in self.rules:
            if self._matches(pattern, path):
                result = not include
        return result


def context_files(root: Path, ignore: DockerIgnore) -> list[str]:
    """Every file of the build context, relative to ``root``."""
    wildcard_includes = any(inc and pat.startswith("*") for inc, pat in ignore.rules)
    files: list[str] = []
    for dirpath, dirnames, filenames in os.walk(root):
        base = Path(dirpath).relative_to(root).as_posix()
        base = "" if base == "." else base + "/"
        # do not descend into an excluded directory nothing beneath can be re-included from
        dirnames[:] = [
            d for d in dirnames
            if not ignore.excluded(base + d) or wildcard_includes
            or any(inc and pat.startswith(base + d + "/") for inc, pat in ignore.rules)
        ]
        files.extend(base + f for f in filenames if not ignore.excluded(base + f))
    return sorted(files)
