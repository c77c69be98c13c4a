"""docs/parallel.md runs (as one script on 8 devices) and prints its `text` blocks; every
public name of blox.parallel has a docstring and a line on docs/api/parallel.md."""

import os
import re
import subprocess
import sys

import pytest

import blox.parallel
from tests.scripts import ROOT


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
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu")  # fmt: skip
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=600, cwd=ROOT,
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind, block in blocks:
        if kind == "text":
            assert block.strip() in proc.stdout, (block, proc.stdout)
