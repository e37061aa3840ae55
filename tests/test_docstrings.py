"""Docstrings and comments stay short (STYLE.md 14): what a thing is and why, in a few lines; the
reasoning goes to ``docs/`` or a commit body, measured timings to ``benchmarks/RESULTS.md``."""

from __future__ import annotations

import ast
import io
import os
import re
import tokenize

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("schema", "recorder", "replay", "analyzers", "tools", "integrations")
MODULE_WORDS, OTHER_WORDS = 150, 120
# a measured duration: "10-20 us", "0.3 ms", "about 5 ns per value"
TIMING = re.compile(r"\b\d+(?:\.\d+)?(?:\s?-\s?\d+(?:\.\d+)?)?\s?(?:ms|us|µs|ns)\b")


def _modules():
    for package in PACKAGES:
        for dirpath, _dirs, files in os.walk(os.path.join(ROOT, package)):
            for name in sorted(files):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, name), ROOT)


def long_docstrings(source: str) -> list[tuple[str, int]]:
    """``(name, words)`` of each docstring over its limit (the module's, then classes' and functions'). A
    module docstring that is its command's ``--help`` text (the module reads ``__doc__``) is user
    documentation, not a comment: it has no limit."""
    tree = ast.parse(source)
    help_text = any(isinstance(n, ast.Name) and n.id == "__doc__" for n in ast.walk(tree))
    found = []
    for node in [*([] if help_text else [tree]), *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)))]:
        doc = ast.get_docstring(node)
        limit = MODULE_WORDS if node is tree else OTHER_WORDS
        if doc and len(doc.split()) > limit:
            found.append((getattr(node, "name", "<module>"), len(doc.split())))
    return found


def timings(source: str) -> list[tuple[int, str]]:
    """``(line, text)`` of each comment or docstring that gives a measured duration."""
    found = [(tok.start[0], tok.string) for tok in tokenize.generate_tokens(io.StringIO(source).readline)
             if tok.type == tokenize.COMMENT and TIMING.search(tok.string)]
    tree = ast.parse(source)
    for node in [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef,
                                                                      ast.AsyncFunctionDef)))]:
        doc = ast.get_docstring(node, clean=False)
        if doc and TIMING.search(doc):
            found.append((node.body[0].lineno, TIMING.search(doc).group(0)))
    return found


@pytest.mark.parametrize("path", list(_modules()))
def test_docstrings_are_short_and_carry_no_timings(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        source = f.read()
    assert long_docstrings(source) == [], f"{path}: docstrings over {MODULE_WORDS}/{OTHER_WORDS} words"
    assert timings(source) == [], f"{path}: measured timings belong in benchmarks/RESULTS.md"


def test_the_checks_find_what_they_look_for():
    src = ('"""' + "word " * 151 + '"""\n\n\ndef f():\n    """' + "w " * 121 + '"""\n    return 1  # costs 10-20 us\n\n\n'
           'def g():\n    """Fine: 3 ms of nothing is no figure here? It is: 0.3 ms."""\n    x = "5 ms"  # (a string)\n')
    assert long_docstrings(src) == [("<module>", 151), ("f", 121)]
    assert [line for line, _ in timings(src)] == [6, 10]
