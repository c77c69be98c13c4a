"""`launch`: run one script as N local processes of a ``jax.distributed`` group (the engine
behind ``python -m blox.launch``)."""

from __future__ import annotations

import argparse
import functools
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

from blox.distributed._devices import accelerators, assign_devices, resolve_platform
from blox.distributed._init import (
    ENV_COORDINATOR,
    ENV_LAUNCH_DIR,
    ENV_LOCAL_DEVICE_IDS,
    ENV_NUM_PROCESSES,
    ENV_PROCESS_ID,
)
from blox.distributed._rendezvous import ENV_LISTEN_FD, listen

__all__ = ["launch", "main"]

_DEVICE_FLAG = "--xla_force_host_platform_device_count"
# The runner each process starts through (run as a file: it must not import JAX first).
_CHILD = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_child.py")
DEFAULT_JOIN_TIMEOUT = 120.0
_NO_JOIN = "blox.distributed.initialize()"


def free_port() -> int:
    """A TCP port that is free on this machine now (the OS picks it; another program may
    take it before it is used: `launch` holds its coordinator port open instead)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def device_env(
    platform: str,
    local_rank: int,
    local_size: int,
    devices_per_process: int | None,
    found: tuple[str, int] | None,
    xla_flags: str = "",
) -> dict[str, str]:
    """The variables that give local process `local_rank` of `local_size` its devices
    (a pure function; `found` is `accelerators` of the host):

    * ``'cpu'``: with `devices_per_process` K, ``JAX_PLATFORMS=cpu`` and K simulated
      devices (``--xla_force_host_platform_device_count=K`` in ``XLA_FLAGS``);
    * ``'gpu'``: ``JAX_LOCAL_DEVICE_IDS`` (JAX's ``local_device_ids``): K GPUs each, or
      an even split of the GPUs found, ``LOCAL_RANK``-style (`assign_devices`);
    * ``'tpu'``: nothing for one process; several per host are refused.

    Raises:
      ValueError: GPUs that do not split as asked, or several processes on a TPU host.
    """
    out: dict[str, str] = {
        "BLOX_LOCAL_RANK": str(local_rank),
        "BLOX_LOCAL_WORLD_SIZE": str(local_size),
    }
    if platform == "cpu":
        if devices_per_process is not None:
            flags = re.sub(rf"{_DEVICE_FLAG}=\S*", "", xla_flags)
            out["XLA_FLAGS"] = f"{flags} {_DEVICE_FLAG}={devices_per_process}".strip()
            out["JAX_PLATFORMS"] = "cpu"
    elif platform == "gpu":
        count = found[1] if found is not None and found[0] == "gpu" else None
        ids = assign_devices(
            local_rank, local_size, device_count=count, devices_per_process=devices_per_process
        )
        if ids is not None:
            out[ENV_LOCAL_DEVICE_IDS] = ",".join(str(i) for i in ids)
    elif local_size > 1 or devices_per_process is not None:
        raise ValueError(
            f"launch: {local_size} processes on a TPU host: JAX's local_device_ids does not "
            "split TPU chips, and several processes per TPU host need the TPU_VISIBLE_CHIPS/"
            "TPU_PROCESS_BOUNDS variables; run one process per host (JAX's Cloud TPU "
            "support), or pass --platform cpu to simulate devices on the CPU."
        )
    return out


def _child_env(
    base: dict[str, str],
    address: str,
    count: int,
    rank: int,
    devices: dict[str, str],
    launch_dir: str,
) -> dict[str, str]:
    env = dict(base)
    env.pop(ENV_LISTEN_FD, None)
    if "BLOX_LOCAL_RANK" in devices:  # a GPU assignment from an outer launcher is stale
        env.pop(ENV_LOCAL_DEVICE_IDS, None)
    env.update(devices)
    env[ENV_COORDINATOR] = address
    env[ENV_NUM_PROCESSES] = str(count)
    env[ENV_PROCESS_ID] = str(rank)
    env[ENV_LAUNCH_DIR] = launch_dir
    env["BLOX_LAUNCHER_PID"] = str(os.getpid())
    env["PYTHONUNBUFFERED"] = "1"  # lines arrive as they are printed
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
    platform: str | None = None,
    coordinator_address: str | None = None,
    first_process_id: int = 0,
    total_processes: int | None = None,
    grace: float = 5.0,
    kill_after: float = 5.0,
    join_timeout: float | None = DEFAULT_JOIN_TIMEOUT,
    env: dict[str, str] | None = None,
    stdout: IO[str] | None = None,
    stderr: IO[str] | None = None,
) -> int:
    """Runs `command` (``[script.py, *args]``, or ``['-m', module, *args]``) as
    `num_processes` processes of one ``jax.distributed`` group on this machine; returns
    the first non-zero exit code (0 when all succeed).

    Each process gets ``BLOX_COORDINATOR_ADDRESS`` (a localhost port the launcher binds
    and hands to process 0, unless given), ``BLOX_NUM_PROCESSES``, ``BLOX_PROCESS_ID`` and
    its local rank ``BLOX_LOCAL_RANK`` of ``BLOX_LOCAL_WORLD_SIZE``, which `initialize`
    reads. Its devices depend on the platform (`platform`, else ``JAX_PLATFORMS``, else
    the GPUs or TPU chips the host shows, else CPU):

    * CPU: with `devices_per_process` K, ``JAX_PLATFORMS=cpu`` and K simulated devices
      (``--xla_force_host_platform_device_count=K`` in ``XLA_FLAGS``);
    * GPU: its own GPUs, ``JAX_LOCAL_DEVICE_IDS`` (K each, or the GPUs split evenly:
      ``-n 8`` on 8 GPUs gives process r GPU r), as torchrun's ``LOCAL_RANK`` does;
    * TPU: one process per host.

    Every line a process prints is prefixed with ``[<rank>] `` (stdout to stdout, stderr
    to stderr). Each process runs through a small runner that tells the launcher its
    exit status as soon as the script ends (before JAX's shutdown barrier).

    A process fails when it exits non-zero (an exception, ``sys.exit(3)``, a signal),
    exits 0 without having called ``blox.distributed.initialize()`` (it ran alone, not in
    the group), or has not called it `join_timeout` seconds after it started. Then the
    others get `grace` seconds to notice on their own, then SIGTERM, then SIGKILL after
    `kill_after` more: nothing is left running and nothing hangs. Each process runs in
    its own session (its own children, e.g. data workers, are stopped with it) and, on
    Linux, dies with the launcher even if the launcher is SIGKILLed. A signal to the
    launcher (Ctrl-C, SIGTERM) is passed on the same way. `launch` may be called from
    any thread of a program (it starts processes without a ``preexec_fn``).

    Args:
      command: the script and its arguments, or ``'-m'``, a module and its arguments.
      num_processes: how many processes to start here.
      devices_per_process: devices per process: simulated CPU devices on CPU, GPUs on
        GPU (``None``: leave CPU settings alone; split the GPUs evenly).
      platform: ``'cpu'``, ``'gpu'`` (``'cuda'``, ``'rocm'``) or ``'tpu'`` (default:
        detected as above, without starting JAX).
      coordinator_address: ``'host:port'`` of process 0 (default: a free port on
        127.0.0.1, for a group that lives on this machine).
      first_process_id: the rank of the first process started here (for a group spread
        over hosts: one launcher per host).
      total_processes: the group's size (default `num_processes`).
      grace: seconds between the first failure and SIGTERM to the others.
      kill_after: seconds between SIGTERM and SIGKILL.
      join_timeout: seconds a process may run before calling `initialize` (``None``: no
        check, for scripts that join through ``jax.distributed`` themselves).
      env: the environment to start from (default ``os.environ``).
      stdout, stderr: where the prefixed lines go (default ``sys.stdout``/``sys.stderr``).

    Returns:
      The exit code of the first process that failed (``128 + n`` for a process ended by
      signal ``n``; 1 for one that did not join), or 0. Of processes seen to end in the
      same 50 ms, one ended by a signal counts as first: its peers fail because it
      vanished.

    Raises:
      ValueError: an empty command, counts that are not positive, ranks that do not fit
        in the group, an unknown platform, or GPUs that do not split as asked.

    Example::

        code = launch(['train.py', '--steps', '10'], num_processes=2, devices_per_process=4)
    """
    command = list(command)
    total = num_processes if total_processes is None else total_processes
    _check_launch_args(command, num_processes, total, first_process_id, devices_per_process)
    if join_timeout is not None and join_timeout <= 0:
        raise ValueError(f"launch: join_timeout={join_timeout} must be positive (or None).")
    stdout = sys.stdout if stdout is None else stdout
    stderr = sys.stderr if stderr is None else stderr
    base = dict(os.environ if env is None else env)
    found = accelerators(base)
    kind = resolve_platform(platform, base, found)
    devices = {
        rank: device_env(
            kind, i, num_processes, devices_per_process, found, base.get("XLA_FLAGS", "")
        )
        for i, rank in enumerate(range(first_process_id, first_process_id + num_processes))
    }
    listener, address = _coordinator(coordinator_address)
    launch_dir = tempfile.mkdtemp(prefix="blox-launch-")
    lock = threading.Lock()
    procs = _start_processes(command, devices, base, address, total, listener, launch_dir)
    threads = _pump_output(procs, stdout, stderr, lock)
    received: list[int] = []
    previous = _catch_signals(received)
    send = functools.partial(_send, procs)
    first_failure: tuple[int, int] | None = None
    watch = _Watch(launch_dir, total, join_timeout)
    try:
        first_failure = _supervise(
            procs, grace, kill_after, received, functools.partial(_note, stderr, lock), send, watch
        )
    finally:
        _clean_up(procs, threads, previous, launch_dir, send)
    if first_failure is not None:
        return _shell_code(first_failure[1])
    if received:
        return 128 + received[0]
    return 0


def _coordinator(coordinator_address: str | None) -> tuple[socket.socket | None, str]:
    """The coordinator's ``host:port``, and the socket the launcher holds for it when it
    picked the port itself (held until process 0 takes it over: no other program can)."""
    if coordinator_address is not None:
        return None, coordinator_address
    listener = listen(0)
    return listener, f"127.0.0.1:{listener.getsockname()[1]}"


def _start_processes(
    command: list[str],
    devices: dict[int, dict[str, str]],
    base: dict[str, str],
    address: str,
    total: int,
    listener: socket.socket | None,
    launch_dir: str,
) -> dict[int, subprocess.Popen]:
    """Starts one process per rank of `devices`, each in its own session; process 0
    inherits the coordinator's `listener`. If a start fails, those started are killed
    and `launch_dir` removed. The launcher's copy of `listener` is closed either way."""
    procs: dict[int, subprocess.Popen] = {}
    try:
        for rank, extra in devices.items():
            child = _child_env(base, address, total, rank, extra, launch_dir)
            fds: tuple[int, ...] = ()
            if rank == 0 and listener is not None:
                child[ENV_LISTEN_FD] = str(listener.fileno())
                fds = (listener.fileno(),)
            procs[rank] = subprocess.Popen(
                [sys.executable, "-u", _CHILD, *command],
                env=child,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                start_new_session=True,
                pass_fds=fds,
            )
    except BaseException:
        for p in procs.values():
            p.kill()
            p.wait()
        shutil.rmtree(launch_dir, ignore_errors=True)
        raise
    finally:
        if listener is not None:
            listener.close()
    return procs


def _pump_output(
    procs: dict[int, subprocess.Popen], stdout: IO[str], stderr: IO[str], lock: threading.Lock
) -> list[threading.Thread]:
    """One daemon thread per process stream, copying its lines prefixed ``[<rank>] ``."""
    threads: list[threading.Thread] = []
    for rank, proc in procs.items():
        for stream, out in ((proc.stdout, stdout), (proc.stderr, stderr)):
            t = threading.Thread(target=_pump, args=(stream, out, f"[{rank}] ", lock))
            t.daemon = True
            t.start()
            threads.append(t)
    return threads


def _note(stderr: IO[str], lock: threading.Lock, text: str) -> None:
    """Writes a ``[launch] `` line of the launcher's own to `stderr`."""
    with lock:
        stderr.write(f"[launch] {text}\n")
        stderr.flush()


def _catch_signals(received: list[int]) -> dict[int, Any]:
    """From the main thread: SIGINT and SIGTERM are appended to `received` (the supervisor
    passes them on) instead of stopping the launcher. Returns the handlers replaced."""
    previous: dict[int, Any] = {}

    def on_signal(signum, frame):  # noqa: ARG001
        received.append(signum)

    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, on_signal)
    return previous


def _send(procs: dict[int, subprocess.Popen], sig: int, ranks) -> None:
    """Sends `sig` to the process groups of `ranks` (those already gone are skipped)."""
    for r in ranks:
        try:
            os.killpg(procs[r].pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def _clean_up(
    procs: dict[int, subprocess.Popen],
    threads: list[threading.Thread],
    previous: dict[int, Any],
    launch_dir: str,
    send: Callable[[int, Any], None],
) -> None:
    """Leaves nothing behind: kills what still runs (and what the processes left in their
    groups), joins the output threads, restores the signal handlers, removes `launch_dir`."""
    leftover = [r for r, p in procs.items() if p.poll() is None]
    send(signal.SIGKILL, leftover)
    for p in procs.values():
        p.wait()
    send(signal.SIGKILL, procs)  # anything the processes left in their groups
    for t in threads:
        t.join(timeout=5.0)
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    shutil.rmtree(launch_dir, ignore_errors=True)


class _Watch:
    """What the processes tell the launcher through its directory: ``joined.<rank>``
    (written by `initialize`) and ``exit.<rank>`` (the runner's non-zero exit status)."""

    def __init__(self, directory: str, total: int, join_timeout: float | None):
        self.directory = directory
        self.total = total
        self.join_timeout = join_timeout
        self.started = time.monotonic()

    def joined(self, rank: int) -> bool:
        return os.path.exists(os.path.join(self.directory, f"joined.{rank}"))

    def reported(self, rank: int) -> int | None:
        try:
            with open(os.path.join(self.directory, f"exit.{rank}")) as f:
                return int(f.read().strip() or 0) or None
        except (OSError, ValueError):
            return None

    def reported_at(self, rank: int) -> float:
        """When process `rank` reported its exit status (``exit.<rank>``'s modification
        time in ns; infinity when it has not): of several failures seen in one look the
        earliest report is the cause, the later ones the peers that lost it."""
        try:
            return float(os.stat(os.path.join(self.directory, f"exit.{rank}")).st_mtime_ns)
        except OSError:
            return float("inf")

    def problem(self, rank: int, code: int | None) -> tuple[int, str] | None:
        """``(exit code, message)`` when process `rank` failed in a way its own exit
        code does not show (`code`: its exit code, None while it runs)."""
        if self.join_timeout is None or self.joined(rank):
            pass
        elif code == 0:
            return 1, (
                f"process {rank} exited with code 0 without calling {_NO_JOIN}: it ran "
                f"alone instead of as process {rank} of {self.total}. Call {_NO_JOIN} "
                "first thing in the script (or launch(join_timeout=None) / --join-timeout 0 "
                "for a script that joins through jax.distributed itself)"
            )
        elif code is None and time.monotonic() - self.started > self.join_timeout:
            return 1, (
                f"process {rank} has not called {_NO_JOIN} {self.join_timeout:g} s after "
                f"it started: it runs alone instead of as process {rank} of {self.total}. "
                f"Call {_NO_JOIN} first thing in the script, or raise --join-timeout"
            )
        if code is None and (reported := self.reported(rank)) is not None:
            return reported, f"process {rank} is exiting with code {reported}"
        return None


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
    watch: _Watch,
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
        # Of the others, the one that reported its exit status first.
        order = sorted(ended.items(), key=lambda rc: (rc[1] >= 0, watch.reported_at(rc[0]), rc[0]))
        for r, code in order:
            running.discard(r)
            found = watch.problem(r, code) if code == 0 else None
            if code == 0 and found is None:
                continue
            code, text = found if found else (code, f"process {r} exited with {_signal_name(code)}")
            if first_failure is None:
                first_failure = (r, code)
                note(f"{text}; stopping the others in {grace:g} s")
                stop_at = time.monotonic() + grace
            else:
                note(text)
        if first_failure is None:
            # Processes still running that reported a failure (or missed the join): the
            # earliest report is the cause (a peer's report can be seen while the
            # process that failed first has not ended yet).
            for r in sorted(running, key=lambda r: (watch.reported_at(r), r)):
                if (found := watch.problem(r, None)) is not None:
                    first_failure = (r, found[0])
                    note(f"{found[1]}; stopping the others in {grace:g} s")
                    stop_at = time.monotonic() + grace
                    break
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


def _parser() -> argparse.ArgumentParser:
    """The command line of ``python -m blox.launch``."""
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
        help="devices per process: simulated CPU devices (sets JAX_PLATFORMS=cpu and "
        "XLA_FLAGS) or GPUs (sets JAX_LOCAL_DEVICE_IDS)",
    )
    parser.add_argument(
        "--platform",
        default=None,
        choices=("cpu", "gpu", "cuda", "rocm", "tpu"),
        help="the devices to split (default: JAX_PLATFORMS, else the GPUs/TPU the host shows, "
        "else cpu)",
    )
    parser.add_argument(
        "--join-timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT,
        help="seconds a process may run before calling blox.distributed.initialize() (0: no check)",
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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m blox.launch``: parses the command line and calls `launch`."""
    parser = _parser()
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
            platform=args.platform,
            coordinator_address=args.coordinator,
            first_process_id=args.process_id or 0,
            total_processes=args.num_processes,
            grace=args.grace,
            kill_after=args.kill_after,
            join_timeout=args.join_timeout or None,
        )
    except ValueError as e:
        parser.error(str(e))
