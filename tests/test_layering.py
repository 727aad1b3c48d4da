"""The packages' layering, as docs/design.md ("Where the code is") states it.

- ``spade_core`` (sampling parameters, the sampling transform, the acceptance rule) imports
  none of our packages and no web framework or schema library: plain torch.
- ``gateway`` (the OpenAI HTTP layer) imports only ``spade_core``, and no torch at all.
- the edge sees only the verifier's wire module (``verifier_service.protocol``).
- the package graph has no cycle.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("spade_core", "gateway", "spade_models", "verifier_service", "edge_agent", "spade_bench")
ALLOWED = {
    "spade_core": set(),
    "gateway": {"spade_core"},
    "spade_models": {"gateway"},  # gateway.cli's --version and plain-text help only
    "verifier_service": {"spade_core", "gateway", "spade_models"},
    "edge_agent": {"spade_core", "gateway", "spade_models", "verifier_service.protocol"},
    "spade_bench": {"spade_core", "gateway", "spade_models", "verifier_service", "edge_agent"},
}


def imported_modules(package: str) -> set[str]:
    """Absolute imports of our other packages anywhere in ``package`` (lazy ones included)."""
    found = set()
    for path in (ROOT / package).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
    return {name for name in found if name.split(".")[0] in PACKAGES and name.split(".")[0] != package}


def allowed(package: str, module: str) -> bool:
    """A rule names a whole package ("gateway") or one module of it ("verifier_service.protocol")."""
    return any(
        module.split(".")[0] == rule if "." not in rule else module == rule or module.startswith(rule + ".") for rule in ALLOWED[package]
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_layers_below_it(package):
    assert sorted(module for module in imported_modules(package) if not allowed(package, module)) == []


def test_the_package_graph_has_no_cycle():
    graph = {package: {module.split(".")[0] for module in imported_modules(package)} for package in PACKAGES}
    visiting, done = set(), set()

    def visit(package: str, path: tuple[str, ...]) -> None:
        assert package not in visiting, f"import cycle: {' -> '.join(path + (package,))}"
        if package in done:
            return
        visiting.add(package)
        for dependency in graph[package]:
            visit(dependency, path + (package,))
        visiting.discard(package)
        done.add(package)

    for package in PACKAGES:
        visit(package, ())


def module_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (dotted) -> the modules of ``package`` it imports, lazy ones included."""
    modules = {}
    for path in (ROOT / package).rglob("*.py"):
        name = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.add(node.module)
                found.update(f"{node.module}.{alias.name}" for alias in node.names)  # from package import module
            elif isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
        modules[name] = found
    return {name: {other for other in found if other in modules and other != name} for name, found in modules.items()}


def test_the_benchmarks_modules_import_one_another_without_a_cycle():
    graph = module_imports("spade_bench")
    assert "spade_bench.capacity.sessions" in graph and "spade_bench.micro.forward_bench" in graph
    visiting, done = set(), set()

    def visit(module: str, path: tuple[str, ...]) -> None:
        assert module not in visiting, f"import cycle: {' -> '.join(path + (module,))}"
        if module in done:
            return
        visiting.add(module)
        for dependency in sorted(graph[module]):
            if not module.startswith(dependency + "."):  # a module importing its own package's __init__
                visit(dependency, path + (module,))
        visiting.discard(module)
        done.add(module)

    for module in sorted(graph):
        visit(module, ())


def loaded_after_importing(modules: list[str], watched: tuple[str, ...]) -> list[str]:
    code = (
        f"import importlib, sys\nfor m in {modules!r}: importlib.import_module(m)\n"
        f"print(sorted(w for w in {watched!r} if w in sys.modules))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    return eval(result.stdout)  # a list literal printed above


def test_the_http_layer_imports_no_torch():
    modules = sorted(f"gateway.{path.stem}" for path in (ROOT / "gateway").glob("*.py") if path.stem != "__init__")
    assert loaded_after_importing(modules, ("torch", "transformers", "numpy")) == []


def test_the_core_imports_no_web_framework_or_schema_library():
    modules = [f"spade_core.{path.stem}" for path in (ROOT / "spade_core").glob("*.py") if path.stem != "__init__"]
    assert loaded_after_importing(modules, ("fastapi", "starlette", "pydantic", "httpx")) == []
