"""The curated public API: every subpackage ``__init__`` declares a sorted ``__all__`` of names that exist.

Sorted means alphabetical, or ruff's isort-style order (constants, classes, functions), which
``ruff check --select RUF022 --fix`` produces.

Modules that declare their own ``__all__`` are checked too (names exist, no duplicates).
"""

from __future__ import annotations

import ast
import importlib
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("schema", "recorder", "replay", "analyzers", "tools")


def _isort_key(name: str) -> tuple[int, str]:
    """ruff's RUF022 "isort-style" order: CONSTANTS, then Classes, then functions, each alphabetical."""
    if name.isupper() or (name.replace("_", "").isupper() and "_" in name):
        return 0, name
    return (1 if name[:1].isupper() else 2), name


@pytest.mark.parametrize("package", PACKAGES)
def test_subpackage_all_is_sorted_unique_and_resolves(package):
    mod = importlib.import_module(f"trainrec.{package}")
    assert hasattr(mod, "__all__"), f"trainrec.{package}/__init__.py has no __all__"
    names = list(mod.__all__)
    assert all(isinstance(n, str) for n in names)
    assert names in (sorted(names), sorted(names, key=_isort_key)), f"trainrec.{package}.__all__ is not sorted"
    assert len(set(names)) == len(names), f"trainrec.{package}.__all__ has duplicates"
    missing = [n for n in names if not hasattr(mod, n)]
    assert missing == [], f"trainrec.{package}.__all__ names missing attributes: {missing}"
    assert [n for n in names if n.startswith("_")] == []
    namespace: dict = {}
    exec(f"from trainrec.{package} import *", namespace)  # noqa: S102 - the star import users may write
    assert set(names) <= set(namespace)


def _declared_all(path: str) -> list[str] | None:
    with open(path, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        targets = []
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(value))
    return None


def _modules_with_all() -> list[tuple[str, list[str]]]:
    found = []
    for package in PACKAGES:
        folder = os.path.join(ROOT, package)
        for name in sorted(os.listdir(folder)):
            if name.endswith(".py") and name != "__init__.py":
                declared = _declared_all(os.path.join(folder, name))
                if declared is not None:
                    found.append((f"trainrec.{package}.{name[:-3]}", declared))
    return found


def test_module_level_all_names_exist():
    modules = _modules_with_all()
    assert modules, "no module declares __all__: is the scan looking in the right place?"
    problems = []
    for dotted, declared in modules:
        mod = importlib.import_module(dotted)
        if len(set(declared)) != len(declared):
            problems.append(f"{dotted}: duplicate names in __all__")
        problems.extend(f"{dotted}: __all__ names {n!r}, which does not exist" for n in declared if not hasattr(mod, n))
    assert problems == []
