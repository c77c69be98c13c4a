"""The package installs what it uses.

* pyproject's runtime ``dependencies`` are exactly the distributions of the third-party
  packages that ``blox/`` imports when it is imported (read from the source with `ast`;
  import names are mapped to distributions by the installed metadata,
  ``importlib.metadata.packages_distributions``), and what it imports only when a
  feature is used lives in an extra.
* Each optional feature, with its package missing (blocked in ``sys.modules``), raises
  an ``ImportError`` that names the package and an extra that really provides it.
"""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys
import tomllib

import jax.numpy as jnp
import numpy as np
import pytest

import blox as bx
from tests.scripts import ROOT

PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _dist(requirement: str) -> str:
    name = re.match(r"[A-Za-z0-9_.\-]+", requirement).group(0)
    return re.sub(r"[-_.]+", "-", name).lower()


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


DEPENDENCIES = {_dist(r) for r in PYPROJECT["dependencies"]}
EXTRAS = {k: {_dist(r) for r in v} for k, v in PYPROJECT["optional-dependencies"].items()}


class _Imports(ast.NodeVisitor):
    """Top-level names of the third-party modules a file imports: ``eager`` (run when
    the module is imported) and ``lazy`` (inside functions, or through ``_require``)."""

    def __init__(self) -> None:
        self.eager: set[str] = set()
        self.lazy: set[str] = set()
        self._depth = 0

    def _add(self, name: str) -> None:
        root = name.split(".")[0]
        if root == "blox" or root in sys.stdlib_module_names:
            return
        (self.lazy if self._depth else self.eager).add(root)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level == 0 and node.module:
            self._add(node.module)

    def _nested(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _nested

    def visit_If(self, node: ast.If) -> None:
        if isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            return  # never runs
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = getattr(func, "id", getattr(func, "attr", None))
        if name in ("_require", "import_module") and node.args:
            arg = node.args[0]
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                self._depth += 1
                self._add(arg.value)
                self._depth -= 1
        self.generic_visit(node)


def _scan() -> _Imports:
    v = _Imports()
    for f in sorted((ROOT / "blox").rglob("*.py")):
        v.visit(ast.parse(f.read_text()))
    return v


def _dists_of(import_name: str) -> set[str]:
    return {_norm(d) for d in md.packages_distributions().get(import_name, [])}


def test_the_import_scanner_sees_eager_lazy_and_type_checking_imports():
    v = _Imports()
    v.visit(
        ast.parse(
            "import numpy as np\nfrom absl import flags\nimport os\n"
            "if TYPE_CHECKING:\n    import torch\n"
            "def f():\n    import matplotlib.pyplot\n    return _require('tqdm', 'x')\n"
        )
    )
    assert v.eager == {"numpy", "absl"}
    assert v.lazy == {"matplotlib", "tqdm"}


def test_runtime_dependencies_are_exactly_what_blox_imports():
    imports = _scan()
    eager = {}
    for name in sorted(imports.eager):
        dists = _dists_of(name)
        assert dists, f"blox imports {name!r} at import time but no installed distribution has it"
        eager[name] = dists
    missing = {n: d for n, d in eager.items() if not d & DEPENDENCIES}
    assert not missing, f"imported by blox but not in [project] dependencies: {missing}"
    imported = set().union(*eager.values())
    unused = DEPENDENCIES - imported
    assert not unused, f"[project] dependencies that blox never imports: {sorted(unused)}"


def test_features_imported_lazily_live_in_an_extra():
    imports = _scan()
    optional = set().union(*EXTRAS.values())
    for name in sorted(imports.lazy - imports.eager):
        dists = _dists_of(name)
        if dists & DEPENDENCIES:
            continue
        assert dists & optional, f"blox imports {name!r} lazily but no extra installs {dists}"
    # The test extra installs every optional package, so `pip install -e '.[test]'` can
    # run the whole suite.
    extras = set().union(*(v for k, v in EXTRAS.items() if k not in ("test", "docs")))
    assert extras <= EXTRAS["test"], sorted(extras - EXTRAS["test"])
    assert "torch" in EXTRAS["test"]


# ----------------------------------------------------------------------------- error paths


def _block(monkeypatch, *modules: str) -> None:
    """Makes ``import <module>`` raise ImportError, as if it were not installed."""
    for name in list(sys.modules):
        if any(name == m or name.startswith(m + ".") for m in modules):
            monkeypatch.delitem(sys.modules, name)
    for m in modules:
        monkeypatch.setitem(sys.modules, m, None)


def _assert_names_extra(message: str, package: str) -> None:
    """The message names `package` and an extra whose requirements include it."""
    assert package in message, message
    extra = re.search(r"pip install 'blox\[(\w+)\]'", message)
    assert extra, f"no `pip install 'blox[<extra>]'` in: {message}"
    assert _norm(package) in EXTRAS[extra.group(1)], (package, extra.group(1))


def test_fit_progress_bar_without_tqdm(monkeypatch):
    _block(monkeypatch, "tqdm")
    step_calls = []

    def step(params, opt_state, batch):
        step_calls.append(batch)
        return params, opt_state, {}

    with pytest.raises(ImportError, match=r"fit\(progress=True\) needs") as info:
        bx.train.fit(step, {}, (), [1, 2], progress=True)
    _assert_names_extra(str(info.value), "tqdm")
    assert not step_calls  # refused before training
    result = bx.train.fit(step, {}, (), [1, 2], progress=False)  # works without the bar
    assert result.steps == 2 and step_calls == [1, 2]


def test_tensorboard_logger_without_tensorboardx(monkeypatch, tmp_path):
    _block(monkeypatch, "tensorboardX")
    with pytest.raises(ImportError, match=r"TensorBoardLogger needs") as info:
        bx.train.TensorBoardLogger(tmp_path / "tb")
    _assert_names_extra(str(info.value), "tensorboardX")


def test_plot_history_without_matplotlib(monkeypatch, tmp_path):
    _block(monkeypatch, "matplotlib")
    history = bx.train.History([{"epoch": 1, "train/loss": 1.0}])
    with pytest.raises(ImportError, match=r"plot_history needs") as info:
        bx.train.plot_history(history, path=tmp_path / "h.png")
    _assert_names_extra(str(info.value), "matplotlib")
    assert not (tmp_path / "h.png").exists()


def test_plot_simulation_without_matplotlib(monkeypatch, tmp_path):
    _block(monkeypatch, "matplotlib")
    y = np.zeros((5, 1))
    with pytest.raises(ImportError, match=r"plot_simulation needs") as info:
        bx.ts.plot_simulation(tmp_path / "s.png", y, y, fs=1.0)
    _assert_names_extra(str(info.value), "matplotlib")


def test_display_without_treescope_names_the_extra_or_prints_plain_text(monkeypatch, capsys):
    """Without the `display` extra, asking for Treescope (``treescope=True``) raises an
    error naming the extra; the default (Treescope only in a notebook that has it) prints
    the plain-text tree and table."""
    g = bx.Graph("net")
    fc = bx.Linear(g / "fc", 2, None, kernel_init=lambda k, s, d: jnp.ones(s, d))
    _, params = fc(bx.Params(), jnp.ones((1, 3)))
    bx.display(fc, params, treescope=False)
    plain = capsys.readouterr().out
    _block(monkeypatch, "treescope")
    with pytest.raises(ImportError, match=r"pip install 'blox\[display\]'"):
        bx.display(fc, params, treescope=True)
    bx.display(fc, params)
    assert capsys.readouterr().out == plain
    assert "net/fc/kernel" in plain
