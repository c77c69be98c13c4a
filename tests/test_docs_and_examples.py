"""Docs and examples: every public name documented, README code runs, examples run tiny."""

import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import blox
import blox.core
import blox.nn
import blox.train
from tests.scripts import run_script

ROOT = Path(__file__).resolve().parent.parent
PUBLIC_MODULES = {
    name: getattr(blox, name)
    for name in ("core", "nn", "train", "parallel", "data", "ckpt", "distributed", "ts")
}


# Functions whose docstrings must state shapes, besides every public `Module` subclass
# outside blox.core (layers and models) and every function of blox.nn.
SHAPED_FUNCTIONS = {
    "train": {
        "mse",
        "mae",
        "rmse",
        "normalized_mse",
        "normalized_mae",
        "softmax_cross_entropy",
        "sigmoid_binary_cross_entropy",
    },
}
_SHAPES = re.compile(r"^Shapes( \([^)\n]*\))?:")


def _shapes_paragraph(doc: str) -> str | None:
    """The paragraph of `doc` that starts with `Shapes:` (or `Shapes (...):`), joined."""
    paragraphs = re.split(r"\n\s*\n", doc)
    found = [p for p in paragraphs if _SHAPES.match(p.lstrip())]
    return " ".join(found[0].split()) if found else None


@pytest.mark.parametrize("name", sorted(PUBLIC_MODULES))
def test_every_public_name_has_a_docstring_and_an_api_page(name):
    """Every public name of `blox.<name>` has a docstring and a mkdocstrings entry
    `::: blox.<name>.<n>` on `docs/api/<name>.md` or a `docs/api/<name>-<topic>.md` page
    (or the package has a `::: blox.<name>` entry), and the pages have no entry for a
    name that is not public. Every layer or model (a public `Module` subclass outside
    blox.core), every function of blox.nn and every loss states its shapes in a
    paragraph that starts with `Shapes:` and maps inputs to outputs with `->`. (The
    strict site build in tests/test_docs_site.py renders these entries and fails on a
    docstring mkdocstrings cannot parse.)"""
    module = PUBLIC_MODULES[name]
    pages = [ROOT / "docs" / "api" / f"{name}.md", *(ROOT / "docs" / "api").glob(f"{name}-*.md")]
    text = "\n".join(p.read_text() for p in pages if p.exists())
    entries = set(re.findall(r"^::: ([\w.]+)\s*$", text, re.M))
    public = set(module.__all__)
    docs = {n: inspect.getdoc(getattr(module, n)) or "" for n in public}
    missing_doc = sorted(n for n in public if not docs[n].strip())
    missing_entry = sorted(
        n for n in public if f"blox.{name}.{n}" not in entries and f"blox.{name}" not in entries
    )
    stray = sorted(
        e for e in entries if e != f"blox.{name}" and e.removeprefix(f"blox.{name}.") not in public
    )
    shaped = []
    for n in sorted(public):
        obj = getattr(module, n)
        if (inspect.isclass(obj) and issubclass(obj, blox.core.Module) and name != "core") or (
            inspect.isfunction(obj) and (name == "nn" or n in SHAPED_FUNCTIONS.get(name, ()))
        ):
            shaped.append(n)
    no_shapes = [n for n in shaped if "->" not in (_shapes_paragraph(docs[n]) or "")]
    assert not missing_doc, f"no docstring: {missing_doc}"
    assert not missing_entry, f"no '::: blox.{name}.<name>' entry on docs/api/{name}*.md: " + (
        ", ".join(missing_entry)
    )
    assert not stray, f"entries on docs/api/{name}*.md for names not in __all__: {stray}"
    assert not no_shapes, f"no 'Shapes: <in> -> <out>' paragraph in the docstring: {no_shapes}"
    if name == "nn":  # the check sees the layers and functions it is meant for
        assert {"Linear", "LSTM", "max_pool", "apply_rotary"} <= set(shaped)
    if name == "train":
        assert SHAPED_FUNCTIONS["train"] <= set(shaped)


def test_top_level_reexports_are_the_same_objects():
    for name in blox.__all__:
        obj = getattr(blox, name)
        origin = (
            getattr(blox.core, name, None)
            or getattr(blox.nn, name, None)
            or getattr(blox.train, name, None)
        )
        assert obj is origin, name


def _table_names(text: str) -> set[str]:
    """Names in the `name` / `names` column of every Markdown table in `text`: each
    backticked identifier there, up to its first non-identifier character (so `Graph(name)`
    gives Graph)."""
    found: set[str] = set()
    column = None
    for line in text.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if column is None:  # a header row
            column = next((i for i, c in enumerate(cells) if c in ("name", "names")), -1)
            continue
        if column < 0 or column >= len(cells) or set(cells[0]) <= set("-: "):
            continue
        found.update(re.findall(r"`([A-Za-z_]\w*)", cells[column]))
    return found


def _resolve(root, dotted: str) -> bool:
    obj = root
    for part in dotted.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def test_every_name_the_docs_list_resolves_under_bx():
    """The API pages and the README list names (tables) and the guides write `bx.<name>`;
    each must exist there (docs/api/core.md once promised bx.graph_tree and
    bx.format_path, which did not exist). Names on the core/nn/train pages and in the
    README resolve as `bx.<name>`; a page `docs/api/<pkg>[-topic].md` of another
    subpackage lists names of `blox.<pkg>`; `bx.a.b` written anywhere must resolve
    attribute by attribute from `bx`."""
    top = {"core", "nn", "train"}
    problems = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = page.read_text()
        where = page.relative_to(ROOT).as_posix()
        for dotted in sorted(set(re.findall(r"\bbx\.([A-Za-z_][\w.]*\w|[A-Za-z_])", text))):
            if not _resolve(blox, dotted):
                problems.append(f"{where}: bx.{dotted}")
        if page.parent.name == "api":
            pkg = page.stem.split("-")[0]
            root = blox if pkg in top else importlib.import_module(f"blox.{pkg}")
        elif page.name == "README.md":
            root = blox
        else:
            continue
        for name in sorted(_table_names(text)):
            if not hasattr(root, name):
                problems.append(f"{where}: {root.__name__}.{name}")
    assert not problems, "listed in the docs but missing:\n" + "\n".join(problems)
    assert blox.graph_tree is blox.core.graph_tree and blox.format_path is blox.core.format_path
    assert "graph_tree" in _table_names((ROOT / "docs" / "api" / "core.md").read_text())


@pytest.mark.slow
def test_readme_code_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        proc = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
def test_demo_example_runs_tiny_and_learns():
    out = run_script("examples/mlp_regression.py", "--size", "tiny")
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < 0.5 * losses[0], out
    assert "total:" in out and "net/fc1/kernel" in out
