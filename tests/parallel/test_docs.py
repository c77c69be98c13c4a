"""docs/parallel.md runs (as one script on 8 devices) and prints its `text` blocks; every
public name of blox.parallel has a docstring and a line on docs/api/parallel.md."""

import re

import pytest

import blox.parallel
from tests.scripts import ROOT, run_ok


def test_every_public_name_has_a_docstring_and_an_api_line():
    page = (ROOT / "docs" / "api" / "parallel.md").read_text()
    names = blox.parallel.__all__
    assert not [n for n in names if not (getattr(blox.parallel, n).__doc__ or "").strip()]
    assert not [n for n in names if f"`{n}`" not in page]


@pytest.mark.slow
def test_parallel_guide_runs_and_prints_what_it_shows():
    text = (ROOT / "docs" / "parallel.md").read_text()
    blocks = re.findall(r"```(python|text)\n(.*?)```", text, re.S)
    code = "\n".join(b for kind, b in blocks if kind == "python")
    # The environment of tests/conftest.py: 8 devices, the faster-compiling XLA flags.
    out = run_ok("-c", code, timeout=600)
    for kind, block in blocks:
        if kind == "text":
            assert block.strip() in out, (block, out)
