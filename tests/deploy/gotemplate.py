"""Static checks of Helm (Go text/template) files: actions, block nesting, value paths.

Not a template engine: there is no well-kept Python implementation of Go templates with
Sprig, and no ``helm`` binary here, so the chart is checked structurally instead.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# a comment may contain "}}", so it is matched first, up to its closing "*/"
ACTION = re.compile(r"\{\{-?\s*/\*.*?\*/\s*-?\}\}|\{\{(-?)(.*?)(-?)\}\}", re.DOTALL)
VALUE_PATH = re.compile(r"\$?\.Values((?:\.[A-Za-z_][A-Za-z0-9_]*)+)")
BLOCK_OPENERS = ("if", "with", "range", "define", "block")


@dataclass
class Action:
    text: str
    line: int

    @property
    def keyword(self) -> str:
        word = self.text.split(None, 1)[0] if self.text else ""
        return word


def actions(source: str) -> list[Action]:
    out = []
    for m in ACTION.finditer(source):
        if m.group(2) is None:
            continue  # a comment
        body = m.group(2).strip()
        if body.startswith("/*"):
            raise ValueError(f"line {source.count(chr(10), 0, m.start()) + 1}: unterminated comment")
        out.append(Action(body, source.count("\n", 0, m.start()) + 1))
    return out


def check_syntax(source: str) -> None:
    """Delimiters pair up; if/with/range/define/block close with end; else sits inside a block."""
    leftover = ACTION.sub("", source)
    for token in ("{{", "}}"):
        if token in leftover:
            line = leftover[: leftover.index(token)].count("\n") + 1
            raise ValueError(f"unpaired {token!r} near line {line}")
    stack: list[Action] = []
    for a in actions(source):
        if a.keyword in BLOCK_OPENERS:
            stack.append(a)
        elif a.keyword == "else":
            if not stack or stack[-1].keyword not in ("if", "with", "range"):
                raise ValueError(f"line {a.line}: else outside if/with/range")
        elif a.keyword == "end":
            if not stack:
                raise ValueError(f"line {a.line}: end without an open block")
            stack.pop()
        if a.text.count("(") != a.text.count(")"):
            raise ValueError(f"line {a.line}: unbalanced parentheses in {a.text!r}")
        if a.text.count('"') % 2:
            raise ValueError(f"line {a.line}: unbalanced quotes in {a.text!r}")
    if stack:
        raise ValueError(f"line {stack[-1].line}: {stack[-1].keyword} never closed")


def value_paths(source: str) -> set[tuple[str, ...]]:
    """Every ``.Values.a.b`` (and ``$.Values.a.b``) referenced, as ('a', 'b')."""
    paths: set[tuple[str, ...]] = set()
    for a in actions(source):
        for m in VALUE_PATH.finditer(a.text):
            paths.add(tuple(m.group(1).lstrip(".").split(".")))
    return paths


def defines(source: str) -> set[str]:
    return {m.group(1) for a in actions(source) for m in [re.match(r'define\s+"([^"]+)"', a.text)] if m}


def includes(source: str) -> set[str]:
    return {m.group(1) for a in actions(source) for m in re.finditer(r'(?:include|template)\s+"([^"]+)"', a.text)}
