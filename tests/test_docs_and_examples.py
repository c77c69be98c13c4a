"""Docs and examples: every public name documented, README code runs, examples run tiny."""

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
PUBLIC_MODULES = {"core": blox.core, "nn": blox.nn, "train": blox.train}


@pytest.mark.parametrize("name", sorted(PUBLIC_MODULES))
def test_every_public_name_has_a_docstring_and_an_api_page(name):
    module = PUBLIC_MODULES[name]
    # The module's API page, plus any `docs/api/<name>-<topic>.md` pages.
    pages = [ROOT / "docs" / "api" / f"{name}.md", *(ROOT / "docs" / "api").glob(f"{name}-*.md")]
    page = "\n".join(p.read_text() for p in pages)
    missing_doc = [n for n in module.__all__ if not (getattr(module, n).__doc__ or "").strip()]
    missing_page = [n for n in module.__all__ if f"`{n}`" not in page]
    assert not missing_doc, f"no docstring: {missing_doc}"
    assert not missing_page, f"not on docs/api/{name}.md: {missing_page}"


def test_top_level_reexports_are_the_same_objects():
    for name in blox.__all__:
        obj = getattr(blox, name)
        origin = (
            getattr(blox.core, name, None)
            or getattr(blox.nn, name, None)
            or getattr(blox.train, name, None)
        )
        assert obj is origin, name


def test_readme_code_runs():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks
    for block in blocks:
        proc = subprocess.run(
            [sys.executable, "-c", block], capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]


def test_demo_example_runs_tiny_and_learns():
    out = run_script("examples/mlp_regression.py", "--size", "tiny")
    losses = [float(m) for m in re.findall(r"loss (\d+\.\d+)", out)]
    assert losses[-1] < 0.5 * losses[0], out
    assert "total:" in out and "net/fc1/kernel" in out
