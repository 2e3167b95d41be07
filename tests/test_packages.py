"""The packages import one way (docs/architecture.md, "Packages"): `protocol`
neither of the others, the frontend and the worker never each other, and inside
the worker each job only those below it: `model` (torch math) under `engine`
(slot bookkeeping) under `serve` (the process) under `launch` (the supervisor)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from bench.stack import REPO_ROOT

# Each package, and the packages of this repository it may import.
MAY_IMPORT = {
    "protocol": {"protocol"},
    "frontend": {"protocol", "frontend"},
    "worker.model": {"protocol", "worker.model"},
    "worker.engine": {"protocol", "worker.model", "worker.engine"},
    "worker.serve": {"protocol", "worker.model", "worker.engine", "worker.serve"},
    "worker.launch": {"protocol", "worker.model", "worker.engine", "worker.serve", "worker.launch"},
}
OURS = ("protocol", "frontend", "worker", "bench", "tests")


def _imported(path: Path) -> set[str]:
    """The modules of this repository that ``path`` imports, at any depth,
    relative imports read from its own package."""
    package = path.relative_to(REPO_ROOT).parent.parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else ()
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {name for name in names if name.split(".")[0] in OURS}


def _package_of(module: str) -> str:
    """The entry of MAY_IMPORT a module belongs to (``worker.serve.load``:
    worker.serve)."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "worker" else parts[0]


def test_every_package_of_the_worker_has_its_place() -> None:
    """A new one, or one renamed, would otherwise be checked by nothing."""
    inits = (REPO_ROOT / "worker").glob("*/__init__.py")
    packages = {f"worker.{init.parent.name}" for init in inits}
    assert packages == {package for package in MAY_IMPORT if package.startswith("worker.")}


@pytest.mark.parametrize("package", sorted(MAY_IMPORT))
def test_a_package_imports_only_those_below_it(package: str) -> None:
    allowed = MAY_IMPORT[package]
    paths = sorted((REPO_ROOT / package.replace(".", "/")).rglob("*.py"))
    assert paths, f"{package} has no modules"
    wrong = {
        f"{path.relative_to(REPO_ROOT)} imports {module}"
        for path in paths
        for module in _imported(path)
        if _package_of(module) not in allowed
    }
    assert not wrong, sorted(wrong)
