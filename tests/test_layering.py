"""The packages' layering, as docs/design.md ("Where the code is") states it.

- ``spade_core`` (sampling parameters, the sampling transform, the acceptance rule) imports
  none of our packages and no web framework or schema library: plain torch.
- ``gateway`` (the OpenAI HTTP layer) imports only ``spade_core``, and no torch at all.
- the edge sees only the verifier's wire modules (``verifier_service.protocol``, and
  ``verifier_service.pipeline_protocol`` for the experimental pipelined-session wire).
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
    "edge_agent": {"spade_core", "gateway", "spade_models", "verifier_service.protocol", "verifier_service.pipeline_protocol"},
    "spade_bench": {"spade_core", "gateway", "spade_models", "verifier_service", "edge_agent"},
}


def imports_in(path: Path) -> set[str]:
    """The absolute imports of one file (lazy ones included); for ``from a import b``, both ``a``
    and ``a.b`` (b may be a module)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return found


def imported_modules(package: str) -> set[str]:
    """Absolute imports of our other packages anywhere in ``package`` (lazy ones included)."""
    found = set().union(*(imports_in(path) for path in (ROOT / package).rglob("*.py")))
    return {name for name in found if name.split(".")[0] in PACKAGES and name.split(".")[0] != package}


def assert_no_cycle(graph: dict[str, set[str]], skip=lambda node, dependency: False) -> None:
    """Fails naming the first import cycle of ``graph`` (node -> the nodes it imports)."""
    visiting, done = set(), set()

    def visit(node: str, path: tuple[str, ...]) -> None:
        assert node not in visiting, f"import cycle: {' -> '.join(path + (node,))}"
        if node in done:
            return
        visiting.add(node)
        for dependency in sorted(graph[node]):
            if not skip(node, dependency):
                visit(dependency, path + (node,))
        visiting.discard(node)
        done.add(node)

    for node in sorted(graph):
        visit(node, ())


def allowed(package: str, module: str) -> bool:
    """A rule names a whole package ("gateway") or one module of it ("verifier_service.protocol")."""
    return any(
        module.split(".")[0] == rule if "." not in rule else module == rule or module.startswith(rule + ".") for rule in ALLOWED[package]
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_imports_only_the_layers_below_it(package):
    assert sorted(module for module in imported_modules(package) if not allowed(package, module)) == []


def test_the_package_graph_has_no_cycle():
    assert_no_cycle({package: {module.split(".")[0] for module in imported_modules(package)} for package in PACKAGES})


def module_imports(package: str) -> dict[str, set[str]]:
    """Each module of ``package`` (dotted) -> the modules of ``package`` it imports, lazy ones included."""
    paths = {
        ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): path for path in (ROOT / package).rglob("*.py")
    }
    return {name: {other for other in imports_in(path) if other in paths and other != name} for name, path in paths.items()}


def test_the_benchmarks_modules_import_one_another_without_a_cycle():
    graph = module_imports("spade_bench")
    assert "spade_bench.capacity.sessions" in graph and "spade_bench.micro.forward_bench" in graph
    # a module importing its own package's __init__ is not a cycle
    assert_no_cycle(graph, skip=lambda module, dependency: module.startswith(dependency + "."))


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
