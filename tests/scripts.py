"""Running the repo's own scripts (examples, benchmarks, multi-process workers) from
tests, in subprocesses with this interpreter and the repo root as working directory.

Their environment is this process's (`clean_env`): the XLA flags, device count and shared
compile cache of tests/conftest.py included (the scripts compile as fast as the tests),
without the ``BLOX_`` variables a launched group sets per process."""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
KEPT = "# Benchmarks\n\nKept text.\n"
LAUNCH = ("-m", "blox.launch")


def clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without the ``BLOX_`` variables, updated with `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BLOX_")}
    env.update(extra)
    return env


def tail(out: str, err: str = "") -> str:
    """The ends of a process's stdout and stderr, for an assertion message."""
    return out[-3000:] + err[-3000:]


def start(*argv: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``python *argv`` (a script path relative to `ROOT`, or ``-m module ...``) started
    in `ROOT` with text pipes; `env` defaults to ``clean_env()``."""
    return subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=clean_env() if env is None else env,
    )


def finish(procs: dict[str, subprocess.Popen], timeout: float = 600) -> dict[str, str]:
    """Waits for each process (they run side by side); their stdouts by key. Fails the
    test naming the key, with the tails of its output, on a non-zero exit; kills the
    processes still running when it fails or times out."""
    outs = {}
    try:
        for key, proc in procs.items():
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, (key, tail(out, err))
            outs[key] = out
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    return outs


def run(
    *argv: str, timeout: float = 300, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python *argv`` in `ROOT` to its end (any exit status); `env` as `start`."""
    return subprocess.run(
        [sys.executable, *argv],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=clean_env() if env is None else env,
    )


def run_ok(*argv: str, timeout: float = 300, env: dict[str, str] | None = None) -> str:
    """`run`, failing the test with the tails of its output on a non-zero exit; stdout."""
    proc = run(*argv, timeout=timeout, env=env)
    assert proc.returncode == 0, tail(proc.stdout, proc.stderr)
    return proc.stdout


def run_script(relpath: str, *args: str, timeout: int = 300) -> str:
    """Runs ``ROOT / relpath`` with `args`; returns its stdout. Fails the test with the
    tail of stdout and stderr when the script exits non-zero."""
    return run_ok(str(ROOT / relpath), *args, timeout=timeout)


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


@functools.cache
def load_example(name: str):
    """``examples/<name>.py`` as a module, imported once per test process and registered
    under `name` (``examples/`` is not a package; an example's own ``import cartpole``
    then finds the same module)."""
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, ROOT / "examples" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
