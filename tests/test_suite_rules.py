"""Rules of the test suite itself: a test module never imports another `test_*.py` (shared helpers live in
tests/helpers/ and the older shared makers beside it), so running or moving one module never collects or
breaks another."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_no_test_module_imports_another():
    found = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            found += [f"{path.relative_to(TESTS)}:{node.lineno} imports {n}" for n in names
                      if n.split(".")[-1].startswith("test_") or n.startswith("tests.")]
    assert found == []
