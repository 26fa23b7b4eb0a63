"""The layout holds: small files, small functions, and the import rules of the design.

Every ``.py`` file of the repository (outside the virtualenv and the migrations' bodies)
is parsed; no file may exceed 500 lines and no function 100 lines. Imports, including
the ones made inside functions, must follow who-may-import-whom.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_FILE_LINES = 500
MAX_FUNCTION_LINES = 100
SKIP_DIRS = {".venv", ".git", "node_modules", "__pycache__", ".adaflash", "build", "dist"}
# No file is exempt from the size rules (migrations aside).
BEING_SPLIT: set[str] = set()

# The repository's own top-level packages.
PACKAGES = ("adaflash", "dataplane", "learner", "governance", "controlplane", "bench", "migrations", "stack",
            "demo", "promptsets", "tests")
# Who may import whom (DESIGN.md "Who may import whom"); bench and tests may use everything.
# dataplane.kernels is checked on its own below: torch and triton only.
MAY_IMPORT = {
    "adaflash": set(),
    "governance": {"adaflash"},
    "dataplane": {"adaflash", "governance"},
    "learner": {"adaflash", "governance", "dataplane", "promptsets"},
    "controlplane": {"adaflash", "governance", "dataplane"},
    "migrations": {"adaflash", "controlplane"},
    "promptsets": {"adaflash"},
    "stack": {"adaflash", "governance"},  # the parts run as child processes, started by their CLI
    "demo": {"adaflash", "stack", "promptsets"},
}


def _sources() -> list[Path]:
    out = []
    for p in sorted(ROOT.rglob("*.py")):
        rel = p.relative_to(ROOT)
        if SKIP_DIRS.intersection(rel.parts):
            continue
        out.append(p)
    return out


SOURCES = _sources()


def _rel(p: Path) -> str:
    return p.relative_to(ROOT).as_posix()


def _tree(p: Path) -> ast.Module:
    return ast.parse(p.read_text(), filename=str(p))


def _imported(tree: ast.Module) -> set[str]:
    """Absolute module names imported anywhere in the file (relative imports stay inside a package)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
    return names


def test_sources_are_found():
    rels = {_rel(p) for p in SOURCES}
    assert "adaflash/config.py" in rels and "stack/supervisor.py" in rels
    assert not any(r.startswith(".venv/") for r in rels)


def test_no_file_over_the_limit():
    too_long = {}
    for p in SOURCES:
        rel = _rel(p)
        if rel in BEING_SPLIT or rel.startswith("migrations/versions/"):
            continue
        n = len(p.read_text().splitlines())
        if n > MAX_FILE_LINES:
            too_long[rel] = n
    assert not too_long, f"files over {MAX_FILE_LINES} lines: {too_long}"


def test_no_function_over_the_limit():
    too_long = {}
    for p in SOURCES:
        rel = _rel(p)
        if rel in BEING_SPLIT or rel.startswith("migrations/versions/"):
            continue
        for node in ast.walk(_tree(p)):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    too_long[f"{rel}:{node.lineno} {node.name}"] = n
    assert not too_long, f"functions over {MAX_FUNCTION_LINES} lines: {too_long}"


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_import_rules(package):
    allowed = MAY_IMPORT[package] | {package}
    broken = {}
    for p in SOURCES:
        rel = _rel(p)
        if rel.split("/", 1)[0] != package or rel in BEING_SPLIT:
            continue
        tops = {m.split(".", 1)[0] for m in _imported(_tree(p))}
        bad = sorted(t for t in tops if t in PACKAGES and t not in allowed)
        if bad:
            broken[rel] = bad
    assert not broken, f"{package}/ may import only {sorted(allowed)}; found {broken}"


def test_kernels_import_only_torch_and_triton():
    broken = {}
    for p in SOURCES:
        rel = _rel(p)
        if not rel.startswith("dataplane/kernels/"):
            continue
        for mod in _imported(_tree(p)):
            top = mod.split(".", 1)[0]
            if top in PACKAGES and not mod.startswith("dataplane.kernels"):
                broken.setdefault(rel, []).append(mod)
    assert not broken, f"dataplane/kernels/ imports only torch and triton (and itself); found {broken}"


def test_the_rules_see_a_violation(tmp_path):
    """The import walk finds imports made inside functions, so a lazy import cannot slip through."""
    src = "def f():\n    from learner.service import Learner\n    import controlplane.api\n"
    p = tmp_path / "m.py"
    p.write_text(src)
    assert _imported(_tree(p)) == {"learner.service", "controlplane.api"}
