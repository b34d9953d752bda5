"""The package's import structure: every module imports in a fresh interpreter, module-level imports form
no cycle, and the lower layers (reading, decoding, writing, family knowledge) never import a command.

Read from the source (ast), so a lazy import inside a function counts for the layering rule too: a
decoder that reaches up into a command module is a knot however it is spelt. Lazy imports do not count
for cycles (breaking one at a call site is a deliberate choice)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ckpt

ROOT = Path(ckpt.__file__).parent
# Commands and what composes them: nothing below may import these.
COMMANDS = ("ckpt.convert", "ckpt.merge", "ckpt.lora", "ckpt.batch", "ckpt.inspect", "ckpt.cli", "ckpt.cli_options",
            "ckpt.cli_report", "ckpt.run")
LOWER = ("ckpt.io", "ckpt.quant", "ckpt.families", "ckpt.report", "ckpt.errors", "ckpt.dtypes", "ckpt.cast",
         "ckpt.progress", "ckpt.interrupts")
# `ckpt dequant` is a command that lives beside the decoders it drives.
LOWER_EXCEPT = ("ckpt.quant.dequant",)


def _modules() -> dict[str, Path]:
    out = {}
    for p in sorted(ROOT.rglob("*.py")):
        parts = ("ckpt",) + p.relative_to(ROOT).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = p
    return out


MODULES = _modules()


def _under(name: str, heads) -> bool:
    return any(name == h or name.startswith(h + ".") for h in heads)


def _imports(name: str, path: Path, top_only: bool) -> set[str]:
    """The ckpt modules `name` imports (`from a import b` counts as a.b where that is a module)."""
    tree = ast.parse(path.read_text(), str(path))
    nodes = tree.body if top_only else list(ast.walk(tree))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.split(".")[0] == "ckpt"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] != "ckpt":
                continue
            for a in node.names:
                out.add(f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base)
    return out & MODULES.keys()


def test_every_module_imports_in_a_fresh_interpreter():
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    r = subprocess.run([sys.executable, "-c", code, *sorted(MODULES)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]


def test_module_level_imports_have_no_cycle():
    graph = {m: _imports(m, p, top_only=True) - {m} for m, p in MODULES.items()}
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
    assert not cycles, "\n".join(" -> ".join(c) for c in cycles)


def test_lower_layers_import_no_command():
    knots = [f"{m} imports {n}" for m, p in MODULES.items()
             if _under(m, LOWER) and m not in LOWER_EXCEPT
             for n in sorted(_imports(m, p, top_only=False)) if _under(n, COMMANDS)]
    assert not knots, "\n".join(knots)
