"""Running the repo's own scripts (examples, benchmarks) from tests, in a subprocess with
this interpreter and the repo root as working directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEPT = "# Benchmarks\n\nKept text.\n"


def run_script(relpath: str, *args: str, timeout: int = 300) -> str:
    """Runs ``ROOT / relpath`` with `args`; returns its stdout. Fails the test with the
    tail of stdout and stderr when the script exits non-zero."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / relpath), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def run_benchmark_quick(script: str, section: str, out: Path, *args: str) -> str:
    """Runs ``benchmarks/<script> --quick --out <out>`` on a file that already holds other
    text, checks that the text is kept and that `section` is written once between its
    markers, and returns the file's text."""
    if not out.exists():
        out.write_text(KEPT)
    run_script(f"benchmarks/{script}", "--quick", *args, "--out", str(out))
    text = out.read_text()
    assert text.startswith(KEPT), text[:200]
    for marker in (f"<!-- bench:{section}:begin -->", f"<!-- bench:{section}:end -->"):
        assert text.count(marker) == 1, (marker, text)
    return text
