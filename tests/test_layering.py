"""The layers of attnopt, and no import that reaches upward or closes a cycle.

The imports of every module in ``attnopt/``, ``passes/`` and ``runtime/`` (installed as ``attnopt``,
``attnopt.passes`` and ``attnopt.runtime``) are read with ``ast``, those inside functions included (only
``if TYPE_CHECKING:`` blocks are skipped). Layers, lowest first; a module imports from its own layer and the
layers below it, never from one above:

1. ``attnopt`` core: the types and models every other layer reads (``site``, ``plan``, ``config``, ``hardware``,
   ``topology``, ``cost/``, ...): any ``attnopt`` module that ``runtime/`` imports. It imports nothing from
   ``runtime/`` or ``passes/``, not even inside a function. (``passes/`` also uses helpers such as ``tuning``,
   which time candidates through ``runtime/``: they sit beside ``passes/``, above ``runtime/``.)
2. ``runtime/`` (the order inside it is ``RUNTIME_LAYERS`` below):

   a. ``reference`` (the pure-PyTorch oracle; ``reference_cascade``, its shared-prefix cascade) and ``kernels/``
      (Triton kernels, one launcher each); then ``saap/`` (the SAAP index: training, the build at prefill, its
      reference decode, the run-time registry);
   b. the single-device plan kinds: ``strategies.base`` (the contract and registry), ``dense``, ``split_kv`` (its
      shared-memory estimate in ``kernel_smem``),
      ``stream_k``;
   c. the distributed algorithms, ``distributed.*`` (groups, checks, watchdog, local, graphs, tree, ring,
      cache): their local attention runs the single-device kinds;
   d. the distributed plan kinds, ``strategies.tree`` and ``strategies.ring``;
   e. the ``strategies`` package, which imports every kind and so fills the registry;
   f. ``ops``: the ``torch.ops.attnopt`` ops that a lowered graph calls, dispatching to the registry;
   g. ``distributed.hf`` (the Hugging Face integration uses the ops) and the ``distributed`` package, which
      re-exports every module of it for users: code in ``runtime/`` imports the module that owns a name.

   ``runtime/`` imports nothing from ``passes/`` and, of ``attnopt``, only the core.
3. ``passes/``: detect -> plan -> lower.
4. ``attnopt`` entry points (``api``, ``backend``, ``cli``, ``commands/``, ``bench/``, ...): they import
   ``runtime/`` and ``passes/`` only inside functions, never at module import time, so that the CLI and the cost
   model work without Triton or a GPU.

And: no import cycle among ``runtime/`` modules (inside functions included), none anywhere through module-level
imports, where importing ``a.b.c`` first runs the ``__init__`` of ``a`` and ``a.b`` (a real cycle at import time).
"""
from __future__ import annotations

import ast
import os
from dataclasses import dataclass

import networkx as nx
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
#: Source folder -> the package it is installed as (pyproject's package-dir).
ROOTS = {"attnopt": "attnopt", "passes": "attnopt.passes", "runtime": "attnopt.runtime"}
RT = "attnopt.runtime"
#: Layers inside runtime/, lowest first: (name, module-name prefixes). A module belongs to the layer of its longest
#: matching prefix; a runtime module that matches none fails ``test_every_runtime_module_has_a_layer``.
RUNTIME_LAYERS = (
    ("reference and kernels", (f"{RT}.reference", f"{RT}.reference_cascade", f"{RT}.kernels")),
    ("SAAP index", (f"{RT}.saap",)),
    ("single-device plan kinds", (f"{RT}.strategies.base", f"{RT}.strategies.dense", f"{RT}.strategies.split_kv",
                                  f"{RT}.strategies.kernel_smem", f"{RT}.strategies.stream_k",
                                  f"{RT}.strategies.cascade")),
    ("distributed algorithms", (f"{RT}.distributed.",)),
    ("distributed plan kinds", (f"{RT}.strategies.tree", f"{RT}.strategies.ring")),
    ("strategy registry", (f"{RT}.strategies",)),
    ("ops", (f"{RT}.ops",)),
    ("distributed integration", (f"{RT}.distributed.hf", f"{RT}.distributed", RT)),
)


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported module (the deepest module of ours the statement names)
    lazy: bool  # inside a function: runs at call time, not at import time
    line: int


def _modules() -> dict[str, tuple[str, bool]]:
    """{module name: (path, is package __init__)} for every .py file of the three roots."""
    mods = {}
    for folder, prefix in ROOTS.items():
        base = os.path.join(REPO, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    parts = os.path.relpath(os.path.join(dirpath, f), base)[:-3].split(os.sep)
                    is_pkg = parts[-1] == "__init__"
                    name = ".".join([prefix] + (parts[:-1] if is_pkg else parts))
                    mods[name] = (os.path.join(dirpath, f), is_pkg)
    return mods


def _is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def _imports(mods: dict[str, tuple[str, bool]]) -> list[Import]:
    found = []

    def ours(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        with open(path) as f:
            tree = ast.parse(f.read(), path)

        def visit(node: ast.AST, lazy: bool) -> None:
            for child in ast.iter_child_nodes(node):
                if _is_type_checking(child):
                    continue
                inner = lazy or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
                targets = []
                if isinstance(child, ast.Import):
                    targets = [a.name for a in child.names]
                elif isinstance(child, ast.ImportFrom):
                    if child.level:
                        parts = package.split(".")
                        parts = parts[:len(parts) - (child.level - 1)]
                        module = ".".join(parts + ([child.module] if child.module else []))
                    else:
                        module = child.module or ""
                    # ``from pkg import sub`` imports the submodule when there is one, else a name of ``pkg``
                    targets = [f"{module}.{a.name}" if f"{module}.{a.name}" in mods else module for a in child.names]
                for t in targets:
                    target = ours(t)
                    if target is not None and target != name:
                        found.append(Import(name, target, inner, child.lineno))
                visit(child, inner)

        visit(tree, False)
    return found


MODULES = _modules()
IMPORTS = _imports(MODULES)


def _root(module: str) -> str:
    if module == "attnopt.passes" or module.startswith("attnopt.passes."):
        return "passes"
    if module == RT or module.startswith(RT + "."):
        return "runtime"
    return "attnopt"


def _core() -> set[str]:
    """The attnopt modules that runtime/ imports (layer 1)."""
    return {i.target for i in IMPORTS if _root(i.source) == "runtime" and _root(i.target) == "attnopt"}


def runtime_layer(module: str) -> int | None:
    """The index in ``RUNTIME_LAYERS`` of the longest prefix matching ``module`` (a prefix ending in "." matches its
    submodules only, any other the module itself and its submodules); None when none does."""
    best, best_len = None, -1
    for index, (_, prefixes) in enumerate(RUNTIME_LAYERS):
        for p in prefixes:
            hit = module.startswith(p) if p.endswith(".") else (module == p or module.startswith(p + "."))
            if hit and len(p) > best_len:
                best, best_len = index, len(p)
    return best


def _where(i: Import) -> str:
    return f"{i.source} (line {i.line}{', in a function' if i.lazy else ''}) imports {i.target}"


def test_the_scan_sees_the_packages():
    """A guard against a scan that finds nothing and so passes: known modules and imports are there."""
    assert {f"{RT}.ops", f"{RT}.distributed", f"{RT}.distributed.tree", "attnopt.passes.lower", "attnopt.api"} \
        <= set(MODULES)
    assert any(i.source == f"{RT}.strategies.tree" and i.target == f"{RT}.distributed.tree" and not i.lazy
               for i in IMPORTS)
    assert any(i.source == "attnopt.passes.lower_nodes" and i.target == f"{RT}.ops" and i.lazy for i in IMPORTS)


def test_no_import_cycle_among_runtime_modules():
    graph = nx.DiGraph()
    graph.add_nodes_from(m for m in MODULES if _root(m) == "runtime")
    graph.add_edges_from((i.source, i.target) for i in IMPORTS if _root(i.source) == _root(i.target) == "runtime")
    cycles = sorted(nx.simple_cycles(graph), key=len)[:5]
    assert not cycles, "import cycles in runtime/ (imports inside functions count):\n" + "\n".join(
        " -> ".join(c + [c[0]]) for c in cycles)


def test_no_import_cycle_at_import_time():
    """Module-level imports only; importing ``a.b.c`` also runs the ``__init__`` of ``a`` and ``a.b`` first."""
    graph = nx.DiGraph()
    for i in IMPORTS:
        if i.lazy:
            continue
        own = i.source.split(".")
        parts = i.target.split(".")
        for n in range(1, len(parts) + 1):
            target = ".".join(parts[:n])
            # the importer's own packages are already being imported: no edge to them
            if target in MODULES and own[:n] != parts[:n] and target != i.source:
                graph.add_edge(i.source, target)
    cycles = sorted(nx.simple_cycles(graph), key=len)[:5]
    assert not cycles, "import-time cycles:\n" + "\n".join(" -> ".join(c + [c[0]]) for c in cycles)


def test_attnopt_imports_no_runtime_or_passes_at_import_time():
    bad = [_where(i) for i in IMPORTS
           if _root(i.source) == "attnopt" and _root(i.target) != "attnopt" and not i.lazy]
    assert not bad, "attnopt/ must import runtime/ and passes/ only inside functions:\n" + "\n".join(bad)


def test_attnopt_core_imports_no_runtime_or_passes_at_all():
    core = _core()
    bad = [_where(i) for i in IMPORTS if i.source in core and _root(i.target) != "attnopt"]
    assert not bad, "attnopt modules that runtime/ imports must not import runtime/ or passes/:\n" + "\n".join(bad)


def test_runtime_imports_no_passes():
    bad = [_where(i) for i in IMPORTS if _root(i.source) == "runtime" and _root(i.target) == "passes"]
    assert not bad, "runtime/ must not import passes/:\n" + "\n".join(bad)


def test_every_runtime_module_has_a_layer():
    missing = sorted(m for m in MODULES if _root(m) == "runtime" and runtime_layer(m) is None)
    assert not missing, f"place these modules in RUNTIME_LAYERS (tests/test_layering.py): {missing}"


def test_no_runtime_layer_reaches_upward():
    bad = []
    for i in IMPORTS:
        if _root(i.source) == _root(i.target) == "runtime":
            src, tgt = runtime_layer(i.source), runtime_layer(i.target)
            if src is not None and tgt is not None and tgt > src:
                bad.append(f"{_where(i)}: layer {RUNTIME_LAYERS[src][0]!r} below {RUNTIME_LAYERS[tgt][0]!r}")
    assert not bad, "runtime/ imports reaching upward:\n" + "\n".join(bad)


@pytest.mark.parametrize("module,layer", [
    (f"{RT}.kernels.split_kv", "reference and kernels"), (f"{RT}.strategies.split_kv", "single-device plan kinds"),
    (f"{RT}.distributed.tree", "distributed algorithms"), (f"{RT}.strategies.tree", "distributed plan kinds"),
    (f"{RT}.strategies", "strategy registry"), (f"{RT}.distributed.hf", "distributed integration"),
    (f"{RT}.distributed", "distributed integration")])
def test_layer_of_known_modules(module, layer):
    assert RUNTIME_LAYERS[runtime_layer(module)][0] == layer
