"""The dependency direction of the subpackages, checked on their source (ast) and at run time.

::

    schema  <-  recorder                     (recorder: the only subpackage that imports torch)
    schema  <-  replay  <-  analyzers
    tools on top of schema, replay, analyzers
    integrations on top of recorder          (trainer callbacks: may import torch, recorder, schema)
    recorder  ->  tools.live_export          (a runtime edge: a process started by module name)

Rules, per module of each subpackage (relative imports resolved):

* ``schema`` imports nothing of trainrec; ``recorder`` and ``replay`` only ``schema``; ``analyzers``
  only ``schema`` and ``replay``; ``tools`` ``schema``, ``replay`` and ``analyzers``; ``integrations``
  ``schema`` and ``recorder``.
* ``torch`` is imported only in ``recorder`` (and ``integrations``, which stands on it): the CLI and the
  replay side run where torch is not installed (torch is no dependency of the package).
* Runtime edges: the recorder starts ``python -m trainrec.tools.live_export`` for csv/tensorboard
  configs. Every ``-m trainrec...`` a subpackage starts must be declared in ``RUNTIME_EDGES``, and the
  subpackage graph, imports and runtime edges together, has no cycle: that is why ``tools`` may not
  import ``recorder`` (lazily or not), and the live export never loads torch.
* Importing trainrec, any of its subpackages or the CLI never imports a trainer library
  (transformers, lightning, accelerate): an integration is loaded only when its module is imported.
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
    "tools": {"schema", "replay", "analyzers"},
    "integrations": {"schema", "recorder"},
}
TORCH_OK = {"recorder", "integrations"}
# (module that starts it, module started with `python -m`): a dependency without an import statement
RUNTIME_EDGES = {("trainrec.recorder.runinfo", "trainrec.tools.live_export")}


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
        where = " (inside a function)" if e.lazy else ""
        if top[0] == "torch" and package not in TORCH_OK:
            bad.append(f"{e.module}:{e.line} imports torch{where} (only recorder may)")
        elif top[0] == "trainrec" and len(top) > 1 and top[1] != package and top[1] not in ALLOWED[package]:
            bad.append(f"{e.module}:{e.line} imports {e.target}{where} "
                       f"({package} may import {sorted(ALLOWED[package])})")
    return bad


def runtime_edges_of(source: str, module: str) -> set[tuple[str, str]]:
    """``(module, started)`` for every ``"-m", "trainrec..."`` pair in a list or tuple of ``source``:
    a process started by module name (``[sys.executable, "-m", "trainrec.tools.live_export", ...]``)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.List, ast.Tuple)):
            items = [n.value if isinstance(n, ast.Constant) else None for n in node.elts]
            for flag, target in zip(items, items[1:], strict=False):
                if flag == "-m" and isinstance(target, str) and target.startswith("trainrec."):
                    found.add((module, target))
    return found


def subpackage_cycles(edges: set[tuple[str, str]]) -> list[list[str]]:
    """Cycles of the graph whose nodes are subpackages (``trainrec.X``) of the module-level ``edges``
    (imports and runtime edges alike); each cycle once, as the path that closes it."""
    graph: dict[str, set[str]] = {}
    for source, target in edges:
        a, b = source.split(".")[:2], target.split(".")[:2]
        if a[0] == b[0] == "trainrec" and len(a) == len(b) == 2 and a[1] != b[1]:
            graph.setdefault(a[1], set()).add(b[1])
    cycles: list[list[str]] = []
    seen: set[frozenset[str]] = set()

    def walk(node: str, path: list[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in path:
                ring = path[path.index(nxt):]
                first = ring.index(min(ring))  # each cycle told from its least subpackage, whatever the start
                if frozenset(ring) not in seen:
                    seen.add(frozenset(ring))
                    cycles.append(ring[first:] + ring[:first] + [ring[first]])
            else:
                walk(nxt, path + [nxt])

    for start in sorted(graph):
        walk(start, [start])
    return cycles


def _sources(package: str):
    """``(module name, source)`` of every module of a subpackage."""
    folder = os.path.join(ROOT, package)
    for dirpath, _dirs, files in os.walk(folder):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            rel = os.path.relpath(os.path.join(dirpath, name), folder)
            sub = os.path.dirname(rel).replace(os.sep, ".")
            pkg = f"{package}.{sub}" if sub else package
            with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                yield _module_name(pkg, name), name == "__init__.py", f.read()


def _scan(package: str) -> list[Edge]:
    edges: list[Edge] = []
    for module, is_package, source in _sources(package):
        edges.extend(imports_of(source, module, is_package))
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
    tools_src = "import torch\nfrom trainrec.recorder import writer\ndef f():\n    import trainrec.recorder\n"
    bad = violations("tools", imports_of(tools_src, "trainrec.tools.x", False))
    assert [b.split(":")[1].split()[0] for b in bad] == ["1", "2", "4"] and "inside a function" in bad[2]
    ok = "from .reader import LogReader\nfrom trainrec.schema import codec\n"
    assert violations("replay", imports_of(ok, "trainrec.replay", True)) == []


def test_runtime_edges_are_declared_and_started_modules_exist():
    """Every ``python -m trainrec...`` a subpackage starts is in RUNTIME_EDGES, and nothing else is."""
    found = set()
    for package in PACKAGES:
        for module, _is_package, source in _sources(package):
            found |= runtime_edges_of(source, module)
    assert found == RUNTIME_EDGES
    for _source, started in RUNTIME_EDGES:
        assert os.path.isfile(os.path.join(ROOT, *started.split(".")[1:]) + ".py"), started


def test_no_cycle_between_subpackages_counting_runtime_edges():
    edges = {(e.module, e.target) for package in PACKAGES for e in _scan(package)}
    assert subpackage_cycles(edges | RUNTIME_EDGES) == []
    allowed = {(f"trainrec.{a}", f"trainrec.{b}") for a, targets in ALLOWED.items() for b in targets}
    assert subpackage_cycles(allowed | RUNTIME_EDGES) == []  # the rules themselves leave no way to make one


def test_the_cycle_and_runtime_edge_finders_catch_what_they_look_for():
    src = 'import subprocess, sys\nsubprocess.Popen([sys.executable, "-u", "-m", "trainrec.tools.live_export"])\n' \
          'cmd = ("python", "-m", "json.tool")\n'
    assert runtime_edges_of(src, "trainrec.recorder.x") == {("trainrec.recorder.x", "trainrec.tools.live_export")}
    edges = {("trainrec.tools.cli", "trainrec.replay.run"), ("trainrec.replay.run", "trainrec.schema.codec"),
             ("trainrec.recorder.x", "trainrec.tools.live_export"), ("trainrec.recorder.x", "trainrec.recorder.y")}
    assert subpackage_cycles(edges) == []
    assert subpackage_cycles(edges | {("trainrec.tools.cmd_x", "trainrec.recorder.config")}) == [
        ["recorder", "tools", "recorder"]]
    three = edges | {("trainrec.schema.codec", "trainrec.tools.cli")}
    assert subpackage_cycles(three) == [["replay", "schema", "tools", "replay"]]


def test_replaying_never_loads_torch_at_run_time():
    """Import everything a replay needs, the CLI with all its subcommands included, in a fresh process."""
    code = (
        "import sys\n"
        "import trainrec.schema, trainrec.replay, trainrec.analyzers, trainrec.tools\n"
        "import trainrec.tools.live_export  # what the recorder starts: it must not load torch again\n"
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


def module_imports_at_load(source: str, module: str, is_package: bool, known: set[str]) -> set[str]:
    """The trainrec modules ``module`` imports when it is loaded: statements at module level (not in a
    function, not under ``if TYPE_CHECKING``), ``from pkg import name`` resolved to ``pkg.name`` where that
    is a module."""
    here = module if is_package else module.rpartition(".")[0]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda, ast.ClassDef)):
                continue
            if isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test):
                visit(ast.Module(body=child.orelse, type_ignores=[]))
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names if a.name in known)
            elif isinstance(child, ast.ImportFrom):
                base = here.split(".")[: len(here.split(".")) - (child.level - 1)] if child.level else []
                target = ".".join([*base, child.module] if child.module else base) if child.level else child.module
                for a in child.names:
                    sub = f"{target}.{a.name}"
                    found.add(sub if sub in known else target)
            else:
                visit(child)

    visit(ast.parse(source))
    return {m for m in found if m in known and m != module}


def module_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import cycles of a module graph, each once (told from its least module)."""
    cycles: set[tuple[str, ...]] = set()

    def walk(node: str, path: list[str], on_path: set[str]) -> None:
        for nxt in sorted(graph.get(node, ())):
            if nxt in on_path:
                ring = path[path.index(nxt):]
                first = ring.index(min(ring))
                cycles.add(tuple(ring[first:] + ring[:first]))
            elif nxt not in done:
                walk(nxt, [*path, nxt], on_path | {nxt})
        done.add(node)

    done: set[str] = set()
    for start in sorted(graph):
        if start not in done:
            walk(start, [start], {start})
    return [[*c, c[0]] for c in sorted(cycles)]


def test_no_import_cycle_between_modules():
    """No module of trainrec imports, at load time, a module that imports it back, directly or not (a
    package's ``__init__`` included: a module importing a name from its own package is a cycle too)."""
    sources = [(m, p, s) for package in PACKAGES for m, p, s in _sources(package)]
    known = {m for m, _p, _s in sources} | _extension_modules()
    graph = {m: module_imports_at_load(s, m, p, known) for m, p, s in sources}
    assert module_cycles(graph) == []


def _extension_modules() -> set[str]:
    """Compiled modules (``recorder/_fused.c``): imported by name like a module, without a ``.py``."""
    return {f"trainrec.{package}.{name[:-2]}" for package in PACKAGES
            for name in os.listdir(os.path.join(ROOT, package)) if name.endswith(".c")}


def test_the_module_cycle_finder_catches_a_cycle():
    known = {"trainrec.recorder.a", "trainrec.recorder.b", "trainrec.recorder.c"}
    a = "from __future__ import annotations\nfrom typing import TYPE_CHECKING\nfrom . import b\n" \
        "if TYPE_CHECKING:\n    from .c import C\n"
    b = "from .c import C\ndef f():\n    from .a import x\n"
    c = "from trainrec.recorder import a\n"
    graph = {"trainrec.recorder.a": module_imports_at_load(a, "trainrec.recorder.a", False, known),
             "trainrec.recorder.b": module_imports_at_load(b, "trainrec.recorder.b", False, known),
             "trainrec.recorder.c": module_imports_at_load(c, "trainrec.recorder.c", False, known)}
    assert graph["trainrec.recorder.a"] == {"trainrec.recorder.b"}  # (TYPE_CHECKING's import is not run)
    assert graph["trainrec.recorder.b"] == {"trainrec.recorder.c"}  # (a function's import is not run at load)
    assert module_cycles(graph) == [["trainrec.recorder.a", "trainrec.recorder.b", "trainrec.recorder.c",
                                     "trainrec.recorder.a"]]
    del graph["trainrec.recorder.c"]
    assert module_cycles(graph) == []


def test_the_faces_sit_on_the_session_not_on_each_other():
    """``TrainerMon`` (monitor.py) and ``record()`` (native.py) each drive a ``RecordingSession``; no
    module of the recorder but the package's ``__init__`` imports a face."""
    faces = {"trainrec.recorder.monitor", "trainrec.recorder.native"}
    sources = list(_sources("recorder"))
    known = {m for m, _p, _s in sources}
    for module, is_package, source in sources:
        if module != "trainrec.recorder":
            assert not (module_imports_at_load(source, module, is_package, known) & faces), module
            assert not {e.target for e in imports_of(source, module, is_package)} & faces, module
    for face in faces:
        src = dict((m, s) for m, _p, s in sources)[face]
        assert "trainrec.recorder.session" in module_imports_at_load(src, face, False, known)
