"""The stack of docs/architecture.md, read off the source: every import (module level or
inside a function) points down the stack, no module imports itself round a circle, and
`import models.llama` loads nothing of lp_jax."""
from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# Bottom to top. A module may import from its own layer and the layers below it, never
# from a layer above. Within a layer, the packages named are peers.
STACK = (
    ("errors", ("lp_jax.errors", "lp_jax.lazy_exports")),
    ("numerics", ("lp_jax.numerics",)),
    ("recipes", ("lp_jax.recipes",)),
    ("model layer scope", ("models.layer_scope",)),
    ("kernels", ("lp_jax.kernels",)),
    ("quantize dispatch", ("lp_jax.quantizer",)),
    ("trace context", ("lp_jax.context",)),
    ("gemm", ("lp_jax.gemm",)),
    ("surgery and the public API", ("lp_jax.surgery", "lp_jax")),
    ("models", ("models",)),
    ("model registry", ("lp_jax.model_registry",)),
    ("config", ("lp_jax.config",)),
    ("parallel", ("lp_jax.parallel",)),
    ("data", ("lp_jax.data",)),
    ("runs", ("lp_jax.runs",)),
    ("telemetry", ("lp_jax.telemetry",)),
    ("training", ("lp_jax.training",)),
    ("evaluation", ("lp_jax.evaluation",)),
    ("commands", ("lp_jax.inspect", "lp_jax.study", "lp_jax.export", "lp_jax.plan")),
)
# Layers that import nothing of the project at all.
LEAVES = ("lp_jax.errors", "lp_jax.lazy_exports", "lp_jax.numerics", "lp_jax.recipes", "models.layer_scope")


def _modules() -> dict[str, pathlib.Path]:
    mods = {}
    for path in sorted([*(ROOT / "lp_jax").rglob("*.py"), *(ROOT / "models").rglob("*.py")]):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _is_main_block(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` runs the file as another module (__main__)."""
    return (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
            and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__")


def _import_nodes(tree: ast.AST):
    for node in ast.iter_child_nodes(tree):
        if _is_main_block(node):
            continue
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        yield from _import_nodes(node)


def _project_module(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str) -> set[str]:
    """The project modules ``module`` imports, wherever in the file the import stands."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        found.update(m for m in map(_project_module, names) if m and m != module)
    return found


def layer_of(module: str) -> int:
    """The index of the layer whose longest matching package holds ``module``."""
    best, rank = -1, None
    for i, (_, packages) in enumerate(STACK):
        for package in packages:
            if (module == package or module.startswith(package + ".")) and len(package) > best:
                best, rank = len(package), i
    if rank is None:
        raise AssertionError(f"{module} is in no layer of the stack: add it to STACK and docs/architecture.md")
    return rank


def test_every_module_has_a_layer():
    for module in MODULES:
        layer_of(module)


def test_every_import_points_down_the_stack():
    upward = [f"{m} ({STACK[layer_of(m)][0]}) imports {t} ({STACK[layer_of(t)][0]})"
              for m in MODULES for t in sorted(imports_of(m)) if layer_of(t) > layer_of(m)]
    assert not upward, "imports up the stack:\n" + "\n".join(upward)


@pytest.mark.parametrize("leaf", LEAVES)
def test_leaves_import_nothing_of_the_project_outside_themselves(leaf):
    members = [m for m in MODULES if m == leaf or m.startswith(leaf + ".")]
    outside = [f"{m} imports {t}" for m in members for t in sorted(imports_of(m))
               if not (t == leaf or t.startswith(leaf + "."))]
    assert members and not outside, outside


def test_models_import_nothing_of_lp_jax():
    bad = [f"{m} imports {t}" for m in MODULES if m.split(".")[0] == "models"
           for t in sorted(imports_of(m)) if t.split(".")[0] == "lp_jax"]
    assert not bad, bad


def test_no_import_circles():
    graph = {m: imports_of(m) for m in MODULES}
    done, on_path = set(), []

    def visit(m):
        if m in on_path:
            circle = on_path[on_path.index(m):] + [m]
            raise AssertionError("import circle: " + " -> ".join(circle))
        if m in done:
            return
        on_path.append(m)
        for t in sorted(graph[m]):
            visit(t)
        on_path.pop()
        done.add(m)

    for module in MODULES:
        visit(module)


def test_import_models_llama_loads_no_lp_jax_module():
    code = ("import sys, models.llama; "
            "print(sorted(m for m in sys.modules if m == 'lp_jax' or m.startswith('lp_jax.')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         check=True, timeout=120).stdout
    assert out.strip() == "[]", out


def test_the_stack_is_written_down_in_docs():
    text = (ROOT / "docs" / "architecture.md").read_text()
    for name, packages in STACK:
        for package in packages:
            assert f"`{package}`" in text, f"docs/architecture.md does not name {package}"
