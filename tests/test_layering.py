"""The dependency direction of the subpackages, checked on their source (ast) and at run time.

::

    schema  <-  recorder                     (recorder: the only subpackage that imports torch)
    schema  <-  replay  <-  analyzers
    tools on top of everything
    integrations on top of recorder          (trainer callbacks: may import torch, recorder, schema)

Rules, per module of each subpackage (relative imports resolved):

* ``schema`` imports nothing of trainrec; ``recorder`` and ``replay`` only ``schema``; ``analyzers``
  only ``schema`` and ``replay``; ``tools`` anything; ``integrations`` ``schema`` and ``recorder``.
* ``torch`` is imported only in ``recorder`` (and ``integrations``, which stands on it).
* Importing trainrec, any of its subpackages or the CLI never imports a trainer library
  (transformers, lightning, accelerate): an integration is loaded only when its module is imported.
* ``tools`` may import ``recorder`` or ``torch`` only *inside functions* (lazily), never at module
  level: the CLI imports every ``tools/cmd_*.py`` at start-up to discover subcommands, so a
  module-level import would cost every command seconds of torch start-up and break replaying logs
  where torch is not installed.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from dataclasses import dataclass

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGES = ("schema", "recorder", "replay", "analyzers", "tools", "integrations")
ALLOWED = {
    "schema": set(),
    "recorder": {"schema"},
    "replay": {"schema"},
    "analyzers": {"schema", "replay"},
    "tools": {"schema", "replay", "analyzers", "recorder"},
    "integrations": {"schema", "recorder"},
}
LAZY_ONLY = {"tools": {"recorder", "torch"}}  # allowed, but only inside a function
TORCH_OK = {"recorder", "tools", "integrations"}


@dataclass(frozen=True)
class Edge:
    module: str  # importing module, dotted (trainrec.replay.reader)
    target: str  # imported module, dotted
    line: int
    lazy: bool  # inside a function


def _module_name(package: str, filename: str) -> str:
    stem = os.path.splitext(filename)[0]
    return f"trainrec.{package}" if stem == "__init__" else f"trainrec.{package}.{stem}"


def imports_of(source: str, module: str, is_package: bool) -> list[Edge]:
    """Every import statement of ``source`` as absolute dotted targets."""
    tree = ast.parse(source)
    here = module if is_package else module.rpartition(".")[0]  # package that relative imports start from
    edges: list[Edge] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                edges.extend(Edge(module, a.name, child.lineno, lazy) for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = here.split(".")
                    base = base[: len(base) - (child.level - 1)]
                    prefix = ".".join(base)
                    target = f"{prefix}.{child.module}" if child.module else prefix
                else:
                    target = child.module or ""
                if target == "trainrec":  # from trainrec import schema / from .. import replay
                    edges.extend(Edge(module, f"trainrec.{a.name}", child.lineno, lazy) for a in child.names)
                else:
                    edges.append(Edge(module, target, child.lineno, lazy))
            visit(child, inner)

    visit(tree, False)
    return edges


def violations(package: str, edges: list[Edge]) -> list[str]:
    bad = []
    for e in edges:
        top = e.target.split(".")
        if top[0] == "torch":
            layer = "torch"
            if package not in TORCH_OK:
                bad.append(f"{e.module}:{e.line} imports torch (only recorder may)")
                continue
        elif top[0] == "trainrec" and len(top) > 1:
            layer = top[1]
            if layer != package and layer not in ALLOWED[package]:
                bad.append(f"{e.module}:{e.line} imports {e.target} ({package} may import {sorted(ALLOWED[package])})")
                continue
        else:
            continue
        if layer in LAZY_ONLY.get(package, ()) and not e.lazy:
            bad.append(f"{e.module}:{e.line} imports {e.target} at module level (only inside functions)")
    return bad


def _scan(package: str) -> list[Edge]:
    folder = os.path.join(ROOT, package)
    edges: list[Edge] = []
    for dirpath, _dirs, files in os.walk(folder):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            sub = os.path.dirname(rel).replace(os.sep, ".")
            pkg = f"{package}.{sub}" if sub else package
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                source = f.read()
            edges.extend(imports_of(source, _module_name(pkg, name), name == "__init__.py"))
    return edges


@pytest.mark.parametrize("package", PACKAGES)
def test_no_wrong_way_imports(package):
    edges = _scan(package)
    assert edges, f"no imports found in {package}/: is the scan looking in the right place?"
    assert violations(package, edges) == []


def test_the_checker_catches_wrong_way_edges():
    src = (
        "from __future__ import annotations\n"
        "import torch\n"
        "from ..replay import reader\n"
        "from . import codec\n"
        "from trainrec import analyzers\n"
        "def f():\n"
        "    import trainrec.tools.cli\n"
    )
    bad = violations("schema", imports_of(src, "trainrec.schema.x", False))
    assert len(bad) == 4 and "torch" in bad[0] and "imports trainrec.replay " in bad[1]
    assert "trainrec.analyzers" in bad[2] and "trainrec.tools.cli" in bad[3]
    tools_src = "import torch\nfrom trainrec.recorder import writer\ndef f():\n    import torch\n"
    bad = violations("tools", imports_of(tools_src, "trainrec.tools.x", False))
    assert [b.split(":")[1].split()[0] for b in bad] == ["1", "2"]
    ok = "from .reader import LogReader\nfrom trainrec.schema import codec\n"
    assert violations("replay", imports_of(ok, "trainrec.replay", True)) == []


def test_replaying_never_loads_torch_at_run_time():
    """Import everything a replay needs, the CLI with all its subcommands included, in a fresh process."""
    code = (
        "import sys\n"
        "import trainrec.schema, trainrec.replay, trainrec.analyzers, trainrec.tools\n"
        "from trainrec.tools import cli\n"
        "cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'trainrec.recorder'))))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_no_trainer_library_is_imported_unless_an_integration_module_is():
    code = (
        "import sys\n"
        "import trainrec.schema, trainrec.recorder, trainrec.replay, trainrec.analyzers, trainrec.integrations\n"
        "from trainrec.tools import cli\n"
        "cli.build_parser()\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('transformers', 'lightning', 'pytorch_lightning', 'accelerate')))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
