"""The documentation site: `mkdocs build --strict` (what `make docs` runs) succeeds with no
warning, the API pages hold the entries generated from the docstrings, and a strict build
fails on a broken link or a docstring that mkdocstrings cannot parse."""

import html
import inspect
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import blox
from tests.scripts import ROOT

pytestmark = pytest.mark.slow

# (page, dotted name, a phrase of its rendered docstring that is not in its first line)
SAMPLE = [
    ("core", "blox.core.Params", "Every change returns a new"),
    ("nn", "blox.nn.Linear", "Shapes:"),
    ("nn-recurrent", "blox.nn.GRU", "recurrent_kernel_init"),  # assembled at import time
    ("nn-transformer", "blox.nn.MultiHeadAttention", "multi-query attention"),
    ("nn-conv", "blox.nn.ConvTranspose", "transpose_kernel"),
    ("nn-cnn-blocks", "blox.nn.BatchNorm", "running_var"),
    ("train", "blox.train.softmax_cross_entropy", "label_smoothing"),
    ("parallel", "blox.parallel.make_mesh", "axis_types"),
    ("data", "blox.data.pipeline", "batch_size"),
    ("ckpt", "blox.ckpt.CheckpointManager", "max_to_keep"),
    ("distributed", "blox.distributed.launch", "num_processes"),
    ("ts", "blox.ts.RNNModel", "hidden_size"),
]


def _mkdocs(config: Path, site: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, NO_MKDOCS_2_WARNING="1")
    return subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        capture_output=True, text=True, timeout=600, cwd=ROOT, env=env,
    )  # fmt: skip


def _letters(text: str) -> str:
    """Only the letters and digits of `text`: Markdown and HTML markup drop out."""
    return re.sub(r"[^A-Za-z0-9]", "", text)


def _text(page: Path) -> str:
    """The page's text (tags removed, entities decoded) as `_letters`."""
    return _letters(html.unescape(re.sub(r"<[^>]+>", "", page.read_text())))


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    proc = _mkdocs(ROOT / "mkdocs.yml", site)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-5000:]
    assert "WARNING" not in log, log[-5000:]
    return site


def test_strict_build_renders_every_page(site):
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]

    def pages(items):
        for item in items:
            for value in item.values() if isinstance(item, dict) else [item]:
                yield from pages(value) if isinstance(value, list) else [value]

    listed = sorted(pages(nav))
    on_disk = sorted(p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md"))
    assert listed == on_disk  # every Markdown file of docs/ is in the nav, and nothing else
    for page in listed:
        out = site / ("index.html" if page == "index.md" else page[: -len(".md")] + "/index.html")
        assert out.is_file(), page
    # Doctests render as code, never as the nested block quotes `>>>` gives in Markdown.
    assert not [p for p in (site / "api").rglob("*.html") if "<blockquote>" in p.read_text()]


@pytest.mark.parametrize(("page", "dotted", "phrase"), SAMPLE)
def test_api_entries_hold_the_rendered_docstrings(site, page, dotted, phrase):
    raw = (site / "api" / page / "index.html").read_text()
    assert f'id="{dotted}"' in raw  # the heading mkdocstrings made for the entry
    module, name = dotted.rsplit(".", 1)
    obj = getattr(getattr(blox, module.split(".")[1]), name)
    summary = _letters(inspect.getdoc(obj).split("\n\n")[0])
    text = _text(site / "api" / page / "index.html")
    assert summary in text, (dotted, summary)
    entry = text[text.index(summary) :]
    assert _letters(phrase) in entry[:20000], (dotted, phrase)


def test_docstring_conventions_render(site):
    """What docs/_griffe_blox.py rewrites: grouped arguments, reStructuredText `::`."""
    # `kernel_init, bias_init: passed to each Linear.` in MLP's Args: one table row per name.
    raw = (site / "api" / "nn" / "index.html").read_text()
    entry = raw[raw.index('id="blox.nn.MLP"') : raw.index('id="blox.nn.Sequential"')]
    for name in ("kernel_init", "bias_init", "dtype", "param_dtype"):
        assert f"<code>{name}</code>" in entry, name
    # "... (Ba et al., 2016)::" then an indented formula: a colon, then a code block.
    raw = (site / "api" / "nn-transformer" / "index.html").read_text()
    entry = raw[raw.index('id="blox.nn.LayerNorm"') : raw.index('id="blox.nn.RMSNorm"')]
    assert "2016):</p>" in entry and "2016)::" not in entry
    assert "<pre" in entry[entry.index("2016):</p>") :][:300]


def _mini_site(tmp_path: Path, page: str, module_source: str) -> subprocess.CompletedProcess:
    """A strict build with the real configuration over one page, with `tmp_path` on the
    handler's path (for a throwaway module)."""
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    docs = tmp_path / "docs"
    docs.mkdir(parents=True)
    (docs / "index.md").write_text(page)
    (tmp_path / "docmod.py").write_text(module_source)
    python = config["plugins"][1]["mkdocstrings"]["handlers"]["python"]
    python["paths"] = [str(tmp_path)]
    python["options"]["extensions"] = [str(ROOT / "docs" / "_griffe_blox.py")]
    config.update(docs_dir=str(docs), nav=[{"Home": "index.md"}])
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    return _mkdocs(tmp_path / "mkdocs.yml", tmp_path / "site")


GOOD = '''
def double(x: float) -> float:
    """Doubles.

    Shapes: any ``x`` -> the same shape.

    Args:
      x: the input.
    """
    return 2 * x
'''


def test_strict_build_fails_on_a_broken_link_or_an_unparsable_docstring(tmp_path):
    ok = _mini_site(tmp_path / "ok", "# Home\n\n::: docmod.double\n", GOOD)
    assert ok.returncode == 0, (ok.stdout + ok.stderr)[-3000:]
    # One build with three faults: each is a warning of its own (any warning fails a
    # strict build), and the build fails.
    page = (
        "# Home\n\n::: docmod.double\n\nSee [the guide](missing.md).\n\nSee [`x`][docmod.triple].\n"
    )
    bad = GOOD.replace("x: the input.", "y: not an argument of double.")
    built = _mini_site(tmp_path / "bad", page, bad)
    warnings = [s for s in built.stderr.splitlines() if s.startswith("WARNING")]
    assert built.returncode != 0, built.stderr[-3000:]
    for needle in ("missing.md", "docmod.triple", "'y' does not appear"):
        assert [s for s in warnings if needle in s], (needle, built.stderr[-3000:])
