"""The package's import structure: every module imports in a fresh interpreter, module-level imports form
no cycle, and the lower layers (reading, decoding, writing, family knowledge) never import a command.

Read from the source (ast), so a lazy import inside a function counts too: a decoder that reaches up into a
command module is a knot however it is spelt, and two modules that import each other, at any depth, form a
cycle however the imports are placed (a lazy import is for start-up time, never to hide a cycle). And no module imports another's `_private` name: a name another module needs gets a public
spelling in its home module, so what a module offers is what its public names say."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckpt

ROOT = Path(ckpt.__file__).parent
# The commands: each one package, composed by the CLI and by batch; no command imports another.
COMMAND_PACKAGES = ("ckpt.convert", "ckpt.dequant", "ckpt.inspect", "ckpt.lora", "ckpt.merge", "ckpt.merge_lora")
COMPOSERS = ("ckpt.batch", "ckpt.cli")  # run commands (batch: one per job); may import any of them
COMMANDS = COMMAND_PACKAGES + COMPOSERS
# Nothing below may import a command: reading, decoding, the output side and the write run (`ckpt.run`), family
# and adapter knowledge.
LOWER = ("ckpt.io", "ckpt.quant", "ckpt.families", "ckpt.adapters", "ckpt.targets", "ckpt.layout", "ckpt.run",
         "ckpt.options", "ckpt.report", "ckpt.errors", "ckpt.dtypes", "ckpt.cast", "ckpt.progress", "ckpt.interrupts")
LOWER_EXCEPT = ()


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = ("ckpt",) + p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _under(name: str, heads) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def _package(name: str, path: Path) -> str:
    return name if path.name == "__init__.py" else name.rpartition(".")[0]


def _absolute(node: ast.ImportFrom, package: str) -> str:
    base = node.module or ""
    if node.level:
        base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
    return base


def _imports(name: str, path: Path, top_only: bool) -> set[str]:
    """The ckpt modules `name` imports (`from a import b` counts as a.b where that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_only else list(ast.walk(tree))
    package = _package(name, path)
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ckpt"}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base.split(".")[0] != "ckpt":
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out & MODULES.keys()


def test_every_module_imports_in_a_fresh_interpreter_without_torch():
    """Every module imports on its own, and importing all of them imports neither torch nor numpy: they are used
    through the lazy proxy (`ckpt.lazy`) only, so no module touches them until a command does tensor math, and
    every path that needs none (help, inspect of headers, every refusal before reading data) stays torch-free by
    construction, whatever it imports."""
    code = ("import importlib, json, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
            "print(json.dumps(sorted(n for n in ('torch', 'numpy') if n in sys.modules)))\n")
    r = subprocess.run([sys.executable, "-c", code, *sorted(MODULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.split() == ["[]"], "imported at module import: " + r.stdout


def test_torch_and_numpy_are_imported_one_way():
    """`from ckpt.lazy import torch` (and `numpy as np`), never `import torch` at any depth: one spelling, so the
    rule above holds by structure and a function-level import cannot slip a module-level one in later."""
    found = []
    for m, p in MODULES.items():
        if m == "ckpt.lazy":
            continue
        for node in ast.walk(ast.parse(p.read_text(), str(p))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            found += [f"{m}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in ("torch", "numpy")]
    assert not found, "\n".join(found)


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    state: dict[str, int] = {}  # 1: on the path, 2: done
    cycles = []

    def visit(m, path):
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(path[path.index(n):] + [n])
            elif n not in state:
                visit(n, path + [n])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_module_level_imports_have_no_cycle():
    cycles = _cycles({m: _imports(m, p, top_only=True) - {m} for m, p in MODULES.items()})
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_no_cycle_even_through_function_level_imports():
    """A lazy import (inside a function) breaks a cycle at import time but not in the design: two modules that
    need each other are one module, or share a third. So none, at any depth."""
    cycles = _cycles({m: _imports(m, p, top_only=False) - {m} for m, p in MODULES.items()})
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _private_imports(name: str, path: Path) -> list[str]:
    """`from ckpt.x import _name`, `import ckpt.x._mod`, and `m._name` on a ckpt module `m` this module
    imported (`from ckpt import x`, `import ckpt.x as m`), at any depth: each reaches into another module's
    private names."""
    tree = ast.parse(path.read_text(), str(path))
    package, modules, out = _package(name, path), {}, []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if base.split(".")[0] != "ckpt":
                continue
            for a in node.names:
                if _private(a.name):
                    out.append(f"{name}:{node.lineno} imports {base}.{a.name}")
                elif f"{base}.{a.name}" in MODULES:
                    modules[a.asname or a.name] = f"{base}.{a.name}"
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name.split(".")[0] != "ckpt":
                    continue
                if any(_private(part) for part in a.name.split(".")):
                    out.append(f"{name}:{node.lineno} imports {a.name}")
                if a.asname:
                    modules[a.asname] = a.name
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules \
                and _private(node.attr) and modules[node.value.id] != name:
            out.append(f"{name}:{node.lineno} uses {modules[node.value.id]}.{node.attr}")
    return out


def test_no_module_imports_another_modules_private_names():
    found = [f for m, p in MODULES.items() for f in _private_imports(m, p)]
    assert not found, "\n".join(found)


def test_lower_layers_import_no_command():
    knots = [f"{m} imports {n}" for m, p in MODULES.items()
             if _under(m, LOWER) and m not in LOWER_EXCEPT
             for n in sorted(_imports(m, p, top_only=False)) if _under(n, COMMANDS)]
    assert not knots, "\n".join(knots)


def test_no_command_imports_another_command():
    """A shared engine lives in a lower package (`ckpt.adapters`, `ckpt.layout`, `ckpt.targets`, ...), never in the
    command that happened to need it first."""
    knots = []
    for m, p in MODULES.items():
        own = next((c for c in COMMAND_PACKAGES if _under(m, (c,))), None)
        if own is None:
            continue
        knots += [f"{m} imports {n}" for n in sorted(_imports(m, p, top_only=False))
                  if _under(n, COMMAND_PACKAGES) and not _under(n, (own,))]
    assert not knots, "\n".join(knots)
