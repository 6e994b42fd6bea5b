"""The package's shape: layered imports without cycles (import-linter and grimp), one adapter
for Dask's private graph spec, a docstring and `__all__` in every module, clear errors for
missing optional dependencies."""
from __future__ import annotations

import ast
import pathlib
import shutil
import subprocess
import sys

import pytest

import dagdiff as dd
from dagdiff.core.dag import topological
from dagdiff.errors import CycleError
from dagdiff.extras import EXTRAS, require

ROOT = pathlib.Path(dd.__file__).parent
MODULES = sorted(p for p in ROOT.rglob("*.py"))


def _lint_imports() -> list[str]:
    exe = shutil.which("lint-imports") or str(pathlib.Path(sys.executable).parent / "lint-imports")
    return [exe, "--config", str(ROOT.parent / "setup.cfg")]


def test_import_layering_contracts_hold() -> None:
    out = subprocess.run(_lint_imports(), capture_output=True, text=True, cwd=ROOT.parent,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_no_import_cycle_between_any_modules() -> None:
    """Every import (function-level ones too, TYPE_CHECKING ones not) between dagdiff's
    modules, as grimp reads them: the graph has a topological order."""
    grimp = pytest.importorskip("grimp")
    graph = grimp.build_graph("dagdiff", exclude_type_checking_imports=True)
    mods = sorted(m for m in graph.modules if m.startswith("dagdiff"))
    packages = {m for m in mods if any(o.startswith(m + ".") for o in mods)}
    deps = {m: {d for d in graph.find_modules_directly_imported_by(m)
                if d.startswith("dagdiff") and d not in packages}
            for m in mods if m not in packages}
    try:
        topological(deps)
    except CycleError as e:
        stuck = sorted(e.stuck)
        pytest.fail(f"import cycle among {stuck}: "
                    + "; ".join(f"{m} -> {sorted(deps[m] & set(stuck))}" for m in stuck))
    assert len(deps) > 40                       # the check saw the package


def test_the_cycle_check_can_fail() -> None:
    with pytest.raises(CycleError):
        topological({"a": {"b"}, "b": {"c"}, "c": {"a"}})


def _imports(path: pathlib.Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            out.append(node.module)
        elif isinstance(node, ast.Import):
            out.extend(a.name for a in node.names)
    return out


def test_private_dask_apis_only_in_their_adapter() -> None:
    users = sorted(str(p.relative_to(ROOT)) for p in MODULES
                   if any(m.startswith("dask._") for m in _imports(p)))
    assert users == ["runtime/taskspec.py"]


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_module_has_a_docstring_and_all(path: pathlib.Path) -> None:
    tree = ast.parse(path.read_text())
    doc = ast.get_docstring(tree)
    assert doc and doc.strip(), f"{path} has no module docstring"
    if path.name == "__main__.py":
        return
    names = [t.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
             for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
             if isinstance(t, ast.Name)]
    assert "__all__" in names, f"{path} has no __all__"


def test_public_names_resolve() -> None:
    for name in dd.__all__:
        assert getattr(dd, name) is not None
    errors = [getattr(dd, n) for n in dd.__all__ if n.endswith("Error") and n != "DagdiffError"]
    assert all(issubclass(e, dd.DagdiffError) for e in errors)
    assert all(issubclass(e, (ValueError, TypeError, RuntimeError, ImportError))
               for e in errors)


def test_a_missing_optional_dependency_names_its_extra() -> None:
    with pytest.raises(dd.MissingDependencyError, match=r'pip install "dagdiff\[viz\]"'):
        EXTRAS["no_such_module_xyz"] = "viz"
        try:
            require("no_such_module_xyz", "the test feature")
        finally:
            del EXTRAS["no_such_module_xyz"]


def test_importing_dagdiff_needs_no_optional_dependency() -> None:
    """`import dagdiff` and a value_and_grad step work with the optional packages hidden."""
    code = (
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('sklearn', 'matplotlib', 'orbax', 'tqdm', 'bokeh',"
        " 'graphviz'):\n"
        "            raise ImportError('hidden: ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import dask, jax.numpy as jnp, dagdiff as dd\n"
        "f = dd.layer(lambda w, x: jnp.sum(jnp.tanh(x @ w)))\n"
        "loss, g = dd.value_and_grad(lambda w, x: f(w, x))(jnp.ones((3, 2)), jnp.ones((4, 3)))\n"
        "print(float(dask.compute(loss, scheduler='sync')[0]))\n"
        "try:\n"
        "    dd.save('/tmp/nowhere', None)\n"
        "except dd.MissingDependencyError as e:\n"
        "    print('EXTRA', e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert 'dagdiff[checkpoint]' in out.stdout
