"""`launch`: run one script as N local processes of a ``jax.distributed`` group (the engine
behind ``python -m blox.launch``)."""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from blox.distributed._init import (
    ENV_COORDINATOR,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)

__all__ = ["launch", "main"]

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
_PR_SET_PDEATHSIG = 1


def free_port() -> int:
    """A TCP port that is free on this machine now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Linux: the child gets SIGKILL if the launcher dies (even by SIGKILL): no orphans."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def _child_env(
    base: dict[str, str], address: str, count: int, rank: int, devices: int | None
) -> dict[str, str]:
    env = dict(base)
    env[ENV_COORDINATOR] = address
    env[ENV_NUM_PROCESSES] = str(count)
    env[ENV_PROCESS_ID] = str(rank)
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
    if devices is not None:
        flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


def _pump(stream: IO[bytes], out: IO[str], prefix: str, lock: threading.Lock) -> None:
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", errors="replace").rstrip("\n")
        with lock:
            out.write(f"{prefix}{line}\n")
            out.flush()
    stream.close()


def _signal_name(code: int) -> str:
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"code {code}"


def _shell_code(code: int) -> int:
    return 128 - code if code < 0 else code


def launch(
    command: Sequence[str],
    *,
    num_processes: int,
    devices_per_process: int | None = None,
    coordinator_address: str | None = None,
    first_process_id: int = 0,
    total_processes: int | None = None,
    grace: float = 5.0,
    kill_after: float = 5.0,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Runs `command` (``[script.py, *args]``, or ``['-m', module, *args]``) as
    `num_processes` processes of one ``jax.distributed`` group on this machine; returns
    the first non-zero exit code (0 when all succeed).

    Each process gets ``BLOX_COORDINATOR_ADDRESS`` (a free localhost port unless given),
    ``BLOX_NUM_PROCESSES`` and ``BLOX_PROCESS_ID``, which `initialize` reads; with
    `devices_per_process` also ``JAX_PLATFORMS=cpu`` and that many simulated CPU devices
    (``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``). Every line a process
    prints is prefixed with ``[<rank>] `` (stdout to stdout, stderr to stderr).

    When a process exits non-zero (an exception, a signal), the others get `grace`
    seconds to notice on their own, then SIGTERM, then SIGKILL after `kill_after` more:
    nothing is left running and nothing hangs. Each process runs in its own process
    group (its own children, e.g. data workers, are stopped with it) and, on Linux, dies
    with the launcher even if the launcher is SIGKILLed. A signal to the launcher
    (Ctrl-C, SIGTERM) is passed on the same way.

    Args:
      command: the script and its arguments, or ``'-m'``, a module and its arguments.
      num_processes: how many processes to start here.
      devices_per_process: simulated CPU devices per process (``None``: leave the
        platform and ``XLA_FLAGS`` alone).
      coordinator_address: ``'host:port'`` of process 0 (default: a free port on
        127.0.0.1, for a group that lives on this machine).
      first_process_id: the rank of the first process started here (for a group spread
        over hosts: one launcher per host).
      total_processes: the group's size (default `num_processes`).
      grace: seconds between the first failure and SIGTERM to the others.
      kill_after: seconds between SIGTERM and SIGKILL.
      env: the environment to start from (default ``os.environ``).
      stdout, stderr: where the prefixed lines go (default ``sys.stdout``/``sys.stderr``).

    Returns:
      The exit code of the first process that failed (``128 + n`` for a process ended by
      signal ``n``), or 0. Of processes seen to end in the same 50 ms, one ended by a
      signal counts as first: its peers fail because it vanished.

    Raises:
      ValueError: an empty command, counts that are not positive, or ranks that do not
        fit in the group.
    """
    command = list(command)
    total = num_processes if total_processes is None else total_processes
    _check_launch_args(command, num_processes, total, first_process_id, devices_per_process)
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    address = coordinator_address or f"127.0.0.1:{free_port()}"
    base = dict(os.environ if env is None else env)
    lock = threading.Lock()

    def note(text: str) -> None:
        with lock:
            stderr.write(f"[launch] {text}\n")
            stderr.flush()

    procs: dict[int, subprocess.Popen] = {}
    threads: list[threading.Thread] = []
    for rank in range(first_process_id, first_process_id + num_processes):
        procs[rank] = subprocess.Popen(
            [sys.executable, "-u", *command],
            env=_child_env(base, address, total, rank, devices_per_process),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
            preexec_fn=_die_with_parent if sys.platform.startswith("linux") else None,
        )
    for rank, proc in procs.items():
        for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[{rank}] ", lock))
            t.daemon = True
            t.start()
            threads.append(t)

    received: list[int] = []

    def on_signal(signum, frame):  # noqa: ARG001
        received.append(signum)

    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)

    def send(sig: int, ranks) -> None:
        for r in ranks:
            try:
                os.killpg(procs[r].pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    first_failure: tuple[int, int] | None = None
    try:
        first_failure = _supervise(procs, grace, kill_after, received, note, send)
    finally:
        leftover = [r for r, p in procs.items() if p.poll() is None]
        send(signal.SIGKILL, leftover)
        for p in procs.values():
            p.wait()
        send(signal.SIGKILL, procs)  # anything the processes left in their groups
        for t in threads:
            t.join(timeout=5.0)
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if first_failure is not None:
        return _shell_code(first_failure[1])
    if received:
        return 128 + received[0]
    return 0


def _check_launch_args(
    command: Sequence[str],
    num_processes: int,
    total: int,
    first_process_id: int,
    devices_per_process: int | None,
) -> None:
    if not command or (command[0] == "-m" and len(command) < 2):
        raise ValueError("launch: no script given; pass [script.py, *args] or ['-m', module].")
    if num_processes < 1 or total < 1:
        raise ValueError(
            f"launch: num_processes={num_processes} and total_processes={total} must be >= 1."
        )
    if not 0 <= first_process_id <= total - num_processes:
        raise ValueError(
            f"launch: processes {first_process_id}..{first_process_id + num_processes - 1} "
            f"do not fit in a group of {total} (ranks 0..{total - 1})."
        )
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"launch: devices_per_process={devices_per_process} must be >= 1.")
    if command[0] != "-m" and not os.path.exists(command[0]):
        raise ValueError(f"launch: script {command[0]!r} not found (cwd {os.getcwd()}).")


def _supervise(
    procs: dict[int, subprocess.Popen],
    grace: float,
    kill_after: float,
    received: list[int],
    note: Callable[[str], None],
    send: Callable[[int, Any], None],
) -> tuple[int, int] | None:
    """Waits for every process; after the first failure (or a signal to the launcher)
    sends SIGTERM to the rest after `grace` s, then SIGKILL after `kill_after` s more.
    Returns ``(rank, exit code)`` of the first failure, or None."""
    first_failure: tuple[int, int] | None = None
    stop_at: float | None = None
    kill_at: float | None = None
    running = set(procs)
    while running:
        ended = {r: c for r in sorted(running) if (c := procs[r].poll()) is not None}
        # Processes that ended since the last look (50 ms ago): one killed by a signal
        # is taken first, as the cause. Its peers then fail on their own within
        # milliseconds (a collective's connection to it closes), with an exit code.
        for r, code in sorted(ended.items(), key=lambda rc: (rc[1] >= 0, rc[0])):
            running.discard(r)
            if code == 0:
                continue
            if first_failure is None:
                first_failure = (r, code)
                note(
                    f"process {r} exited with {_signal_name(code)}; stopping the others in "
                    f"{grace:g} s"
                )
                stop_at = time.monotonic() + grace
            else:
                note(f"process {r} exited with {_signal_name(code)}")
        if received and stop_at is None:
            note(f"got {signal.Signals(received[0]).name}; stopping every process")
            stop_at = time.monotonic()
        now = time.monotonic()
        if stop_at is not None and now >= stop_at and kill_at is None and running:
            note(f"sending SIGTERM to process(es) {sorted(running)}")
            send(signal.SIGTERM, running)
            kill_at = now + kill_after
        if kill_at is not None and now >= kill_at and running:
            note(f"sending SIGKILL to process(es) {sorted(running)}")
            send(signal.SIGKILL, running)
            kill_at = float("inf")
        time.sleep(0.05)
    return first_failure


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blox.launch``: parses the command line and calls `launch`."""
    parser = argparse.ArgumentParser(
        prog="python -m blox.launch",
        description=(
            "Run SCRIPT as N processes of one jax.distributed group: on this machine (-n N), "
            "or as one member of a group spread over hosts (--coordinator/--num-processes/"
            "--process-id). The script calls blox.distributed.initialize()."
        ),
    )
    parser.add_argument("-n", "--nproc", type=int, default=None, help="processes to start here")
    parser.add_argument(
        "--devices-per-process",
        type=int,
        default=None,
        help="simulated CPU devices per process (sets JAX_PLATFORMS=cpu and XLA_FLAGS)",
    )
    parser.add_argument("--coordinator", default=None, help="host:port of process 0")
    parser.add_argument("--num-processes", type=int, default=None, help="the group's size")
    parser.add_argument(
        "--process-id", type=int, default=None, help="rank of the first process started here"
    )
    parser.add_argument("--grace", type=float, default=5.0, help="seconds before SIGTERM")
    parser.add_argument("--kill-after", type=float, default=5.0, help="seconds before SIGKILL")
    parser.add_argument("-m", dest="module", default=None, help="run a module, like python -m")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="SCRIPT [ARGS...]")
    args = parser.parse_args(argv)
    command = ["-m", args.module, *args.command] if args.module else list(args.command)
    if not command:
        parser.error("give SCRIPT [ARGS...] (or -m MODULE [ARGS...])")
    spread = (args.coordinator, args.num_processes, args.process_id)
    if any(v is not None for v in spread) and None in spread:
        parser.error("--coordinator, --num-processes and --process-id go together")
    nproc = args.nproc if args.nproc is not None else (1 if args.coordinator else None)
    if nproc is None:
        parser.error(
            "give -n N (processes on this machine) or --coordinator/--num-processes/"
            "--process-id (one member of a group over hosts)"
        )
    try:
        return launch(
            command,
            num_processes=nproc,
            devices_per_process=args.devices_per_process,
            coordinator_address=args.coordinator,
            first_process_id=args.process_id or 0,
            total_processes=args.num_processes,
            grace=args.grace,
            kill_after=args.kill_after,
        )
    except ValueError as e:
        parser.error(str(e))
