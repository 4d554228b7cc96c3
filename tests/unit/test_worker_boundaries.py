"""The workers configure an engine and call its methods; they never write its state. Every
assignment in prefill_worker/ and decode_worker/ targets the worker's own attributes (`self.x`)
or local names, never an attribute of something else (`self.core.scheduler.x = ...`,
`req.num_computed_tokens = ...`), and nothing is set through setattr."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FILES = sorted(p for pkg in ("prefill_worker", "decode_worker") for p in (ROOT / pkg).glob("*.py"))


def _written(target: ast.expr) -> list[ast.expr]:
    """What an assignment target writes: each element of a tuple, the container of a subscript
    (`self._stages[rid] = x` writes `self._stages`)."""
    if isinstance(target, (ast.Tuple, ast.List)):
        return [w for elt in target.elts for w in _written(elt)]
    while isinstance(target, ast.Subscript):
        target = target.value
    return [target]


def _foreign_targets(tree: ast.AST) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr":
            bad.append(f"line {node.lineno}: setattr")
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else [])
        for w in (w for t in targets for w in _written(t)):
            if isinstance(w, ast.Attribute) and not (isinstance(w.value, ast.Name) and w.value.id == "self"):
                bad.append(f"line {node.lineno}: {ast.unparse(w)}")
    return bad


def test_the_files_are_found():
    assert {p.name for p in FILES} >= {"worker.py", "types.py"} and len(FILES) >= 6


@pytest.mark.parametrize("path", FILES, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_no_worker_assigns_to_an_engine_attribute(path):
    assert _foreign_targets(ast.parse(path.read_text())) == []


def test_the_check_catches_what_it_forbids():
    code = "def f(self, req):\n    self.core.scheduler.on_retire = f\n    req.num_computed_tokens = 3\n    setattr(req, 'x', 1)\n"
    assert len(_foreign_targets(ast.parse(code))) == 3
