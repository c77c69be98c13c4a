"""Joining a group of processes through ``jax.distributed``, or staying a single process.

The group's settings come, in this order, from the arguments of `initialize`, from the
``BLOX_*`` environment variables that ``python -m blox.launch`` sets (or a user sets by
hand), or from a cluster scheduler's environment that JAX recognises (Slurm, Open MPI,
Kubernetes, Cloud TPU). With none of them the process is alone and nothing is done.
"""

from __future__ import annotations

import atexit
import dataclasses
import logging
import os
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import jax

from blox.distributed._devices import (
    accelerators,
    assign_devices,
    local_rank,
    parse_device_ids,
    resolve_platform,
)
from blox.distributed._rendezvous import inherited_listener, roll_call, split_address

__all__ = ["ProcessInfo", "describe", "initialize"]

ENV_COORDINATOR = "BLOX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "BLOX_NUM_PROCESSES"
ENV_PROCESS_ID = "BLOX_PROCESS_ID"
ENV_INIT_TIMEOUT = "BLOX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "BLOX_HEARTBEAT_TIMEOUT"
ENV_DEVICES_PER_PROCESS = "BLOX_DEVICES_PER_PROCESS"
ENV_LOCAL_DEVICE_IDS = "JAX_LOCAL_DEVICE_IDS"  # JAX's own variable (jax.distributed reads it)
ENV_LAUNCH_DIR = "BLOX_LAUNCH_DIR"  # the launcher's directory for joined.<rank>/exit.<rank>
EXIT_WATCHDOG_S = 10.0

DEFAULT_INIT_TIMEOUT = 300.0
DEFAULT_HEARTBEAT_TIMEOUT = 30


@dataclasses.dataclass(frozen=True)
class ProcessInfo:
    """What `initialize` and `describe` return: this process's place in the group.

    Attributes:
      process_id: this process's index, ``jax.process_index()``.
      num_processes: the group's size, ``jax.process_count()``.
      local_devices: the devices this process drives, ``jax.local_devices()``.
      devices: every device of the group, ``jax.devices()``.
      coordinator_address: ``'host:port'`` of process 0's coordinator, ``None`` alone.
      source: where the settings came from: ``'single process'``, ``'arguments'``,
        ``'environment'`` (the ``BLOX_*`` variables, e.g. from ``blox.launch``), or the
        name of the cluster environment JAX detected (``'slurm'``, ``'ompi'``, ...).
    """

    process_id: int
    num_processes: int
    local_devices: tuple[Any, ...]
    devices: tuple[Any, ...]
    coordinator_address: str | None
    source: str

    @property
    def is_multiprocess(self) -> bool:
        """True in a group of two or more processes."""
        return self.num_processes > 1

    def __str__(self) -> str:
        platform = self.local_devices[0].platform if self.local_devices else "?"
        where = f", coordinator {self.coordinator_address}" if self.coordinator_address else ""
        return (
            f"process {self.process_id} of {self.num_processes} ({self.source}{where}): "
            f"{len(self.local_devices)} local {platform} devices "
            f"{[d.id for d in self.local_devices]} of {len(self.devices)}"
        )


def describe(*, source: str | None = None) -> ProcessInfo:
    """This process's place in the group, as `initialize` returns it.

    Calling it starts JAX's backends (it lists devices), so in a group call `initialize`
    first.

    >>> from blox import distributed as bd
    >>> info = bd.describe()
    >>> info.process_id, info.num_processes
    (0, 1)
    """
    initialized = jax.distributed.is_initialized()
    if source is None:
        source = "initialized" if initialized else "single process"
    address = _coordinator_address() if initialized else None
    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=tuple(jax.local_devices()),
        devices=tuple(jax.devices()),
        coordinator_address=address,
        source=source,
    )


# --- the JAX internals blox reads, one small function each --------------------------------
# JAX has no public accessor for these (checked for jax 0.10). Each import sits in its own
# function, so a JAX that moved it fails there with an error saying what to do.


def _private_jax_error(what: str, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"blox.distributed reads {what} from JAX's internals (present in jax 0.10), but this "
        f"JAX {jax.__version__} moved it ({type(err).__name__}: {err}). Install a jax version "
        "that pyproject.toml allows, or pass coordinator_address, num_processes and "
        "process_id to initialize() explicitly."
    )


def _coordinator_address() -> str | None:
    """The address the group joined through (``jax._src.distributed.global_state``)."""
    try:
        from jax._src import distributed as _distributed

        return _distributed.global_state.coordinator_address
    except (ImportError, AttributeError) as e:  # pragma: no cover - a future JAX moved it
        raise _private_jax_error("the coordinator address", e) from e


def _backends_started() -> bool | None:
    """Whether JAX has started its backends (``jax._src.xla_bridge``); None when this JAX
    moved it (``jax.distributed.initialize`` then raises its own error, translated)."""
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - a future JAX moved it
        return None


def _cluster_env_types() -> list[Any]:
    """JAX's cluster environments (``jax._src.clusters``: Slurm, Open MPI, Kubernetes,
    Cloud TPU), the code behind ``jax.distributed.initialize()`` without arguments."""
    try:
        from jax._src import clusters

        return list(clusters.ClusterEnv._cluster_types)
    except (ImportError, AttributeError) as e:  # pragma: no cover - a future JAX moved it
        raise _private_jax_error("the cluster detection (Slurm, Open MPI, ...)", e) from e


def _int_env(name: str) -> int | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer.") from None


def _float_env(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not a number.") from None


# Variables of the schedulers JAX detects (Slurm, Open MPI, Kubernetes jobs, Cloud TPU).
_SCHEDULER_HINTS = (
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "JOB_COMPLETION_INDEX",
    "CLOUD_TPU_TASK_ID",
    "TPU_WORKER_HOSTNAMES",
)


def _detect_cluster(timeout: float) -> tuple[str | None, int | None, int | None, str | None]:
    """JAX's own cluster detection (`_cluster_env_types`): (address, count, id, name)."""
    try:
        types = _cluster_env_types()
    except RuntimeError:
        if any(v in os.environ for v in _SCHEDULER_HINTS):
            raise
        return None, None, None, None  # no scheduler around: a single process
    env = next((e for e in types if not e.opt_in_only_method and e.is_env_present()), None)
    if env is None:
        return None, None, None, None
    count, pid = env.get_process_count(), env.get_process_id()
    if count <= 1:
        return None, count, pid, env.name or env.__name__
    port = os.environ.get("JAX_COORDINATOR_PORT")
    address = os.environ.get("JAX_COORDINATOR_ADDRESS") or env.get_coordinator_address(
        timeout_secs=int(timeout), override_coordinator_port=port
    )
    return address, count, pid, env.name or env.__name__


def _flush() -> None:
    """Flushes (and closes) every logging handler and the standard streams."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _reported_exit(launch_dir: str | None, rank: int) -> int | None:
    """The non-zero exit status the launcher's runner reported for this process."""
    if not launch_dir:
        return None
    try:
        with open(os.path.join(launch_dir, f"exit.{rank}")) as f:
            return int(f.read().strip() or 0) or None
    except (OSError, ValueError):
        return None


def _install_exit_guard(exit_on_error: bool, launch_dir: str | None, rank: int) -> None:
    """A process of a group that fails must not wait at JAX's shutdown barrier (its
    ``atexit`` handler ``jax.distributed.shutdown``) for peers that are still computing.

    * an ``atexit`` handler, registered after JAX's and so run before it: when the process
      fails (an uncaught exception seen by the hook below, or a non-zero exit status the
      launcher's runner reported, e.g. ``sys.exit(3)``) it flushes the logging handlers
      and streams, then ``os._exit(status)``: the ``atexit`` handlers registered after
      `initialize` (and the interpreter's joining of non-daemon threads) have run, JAX's
      barrier is skipped.
    * with `exit_on_error`, ``sys.excepthook`` is chained: the previous hook prints the
      traceback, the failure is recorded for the handler above, and a daemon watchdog ends
      the process after `EXIT_WATCHDOG_S` seconds should the shutdown itself hang.
    """
    failed: list[int] = []

    def at_exit() -> None:
        code = failed[0] if failed else _reported_exit(launch_dir, rank)
        if code:
            _flush()
            os._exit(code)

    atexit.register(at_exit)
    previous = sys.excepthook
    if not exit_on_error or getattr(previous, "_blox_exit_on_error", False):
        return

    def watchdog() -> None:  # pragma: no cover - only when the shutdown hangs
        sys.stderr.write(
            f"blox.distributed: process {rank} did not finish exiting within "
            f"{EXIT_WATCHDOG_S:g} s of its uncaught exception; ending it (exit code 1).\n"
        )
        _flush()
        os._exit(1)

    def hook(kind, value, tb):
        previous(kind, value, tb)
        if issubclass(kind, KeyboardInterrupt):
            return
        failed.append(1)
        sys.stderr.write(
            f"blox.distributed: process {rank} ends on the uncaught {kind.__name__} above "
            "(exit code 1) without waiting for the other processes.\n"
        )
        timer = threading.Timer(EXIT_WATCHDOG_S, watchdog)
        timer.daemon = True
        timer.start()

    hook._blox_exit_on_error = True  # type: ignore[attr-defined]
    sys.excepthook = hook


def _mark_joining(env: Mapping[str, str]) -> None:
    """Tells ``python -m blox.launch`` that this process called `initialize` (it ends the
    group with an error when a process exits, or runs too long, without doing so)."""
    directory = env.get(ENV_LAUNCH_DIR)
    if not directory:
        return
    try:
        with open(os.path.join(directory, f"joined.{env.get(ENV_PROCESS_ID, '0')}"), "w"):
            pass
    except OSError:  # the launcher is gone
        pass


def local_device_ids_from_env(
    env: Mapping[str, str], found: tuple[str, int] | None
) -> tuple[int, ...] | None:
    """The GPUs this process drives, from its environment (a pure function: `found` is
    `accelerators` of the host): ``JAX_LOCAL_DEVICE_IDS`` when set (``python -m
    blox.launch`` sets it on GPU hosts); else, on a GPU platform, this process's share by
    its local rank (``BLOX_LOCAL_RANK``, ``LOCAL_RANK``, ``SLURM_LOCALID``,
    ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``) and ``BLOX_DEVICES_PER_PROCESS``
    (`assign_devices`, not strict); else None (every device it sees)."""
    if env.get(ENV_LOCAL_DEVICE_IDS):
        return parse_device_ids(env[ENV_LOCAL_DEVICE_IDS], ENV_LOCAL_DEVICE_IDS)
    if resolve_platform(None, env, found) != "gpu":
        return None
    rank = local_rank(env)
    if rank is None:
        return None
    per = None
    if env.get(ENV_DEVICES_PER_PROCESS):
        per = _int_from(env, ENV_DEVICES_PER_PROCESS)
    count = found[1] if found is not None and found[0] == "gpu" else None
    return assign_devices(
        rank.rank, rank.size, device_count=count, devices_per_process=per, strict=False
    )


def _int_from(env: Mapping[str, str], name: str) -> int:
    try:
        return int(env[name])
    except ValueError:
        raise ValueError(f"environment variable {name}={env[name]!r} is not an integer.") from None


def _check_device_ids(given: Any) -> tuple[int, ...] | None:
    if given is None:
        return None
    ids = (given,) if isinstance(given, int) and not isinstance(given, bool) else given
    try:
        ids = tuple(ids)
    except TypeError:
        ids = ()
    if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise TypeError(
            "initialize: local_device_ids must be a non-empty list of non-negative ints (the "
            f"GPU ordinals this process drives, e.g. [0, 1]), got {given!r}."
        )
    if len(set(ids)) != len(ids):
        raise ValueError(f"initialize: local_device_ids={list(ids)} repeats a device.")
    return ids


def _pick_devices(given: tuple[int, ...] | None) -> tuple[int, ...] | None:
    if given is not None:
        return given
    env = dict(os.environ)
    if jax.config.jax_platforms:  # set in code: it wins over JAX_PLATFORMS
        env["JAX_PLATFORMS"] = jax.config.jax_platforms
    return local_device_ids_from_env(env, accelerators(env))


def _check_int(name: str, value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"initialize: {name} must be an int, got {type(value).__name__}.")
    return value


def initialize(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    *,
    initialization_timeout: float | None = None,
    heartbeat_timeout: int | None = None,
    shutdown_timeout: int = 300,
    roll_call_first: bool = True,
    exit_on_error: bool = True,
    local_device_ids: Sequence[int] | None = None,
) -> ProcessInfo:
    """Joins this process to its group through ``jax.distributed.initialize``, or does
    nothing when the process is alone; returns its `ProcessInfo` either way.

    Call it at the top of the script, before anything that touches a device (creating an
    array, ``jax.devices()``, a jitted call): the same script then runs unchanged as one
    process, under ``python -m blox.launch -n N``, or under a cluster scheduler.

    The settings are taken from, in order:

    1. the arguments (all three of `coordinator_address`, `num_processes`, `process_id`);
    2. ``BLOX_COORDINATOR_ADDRESS``, ``BLOX_NUM_PROCESSES``, ``BLOX_PROCESS_ID`` (set by
       ``python -m blox.launch``, or by hand on each host);
    3. a cluster environment JAX detects (Slurm's ``srun``, Open MPI's ``mpirun``,
       Kubernetes, Cloud TPU) with more than one process;
    4. none: a single process; JAX is left untouched.

    Before JAX's own join, every process reports to process 0 on the coordinator's port
    (a *roll call*), so that a process that never comes is named in a ``TimeoutError``
    instead of JAX aborting every process with ``DEADLINE_EXCEEDED``.

    After joining, a process that dies (killed, or exits on an error) stops sending
    heartbeats; after `heartbeat_timeout` seconds JAX ends every other process with
    ``The following tasks are unhealthy (stopped sending heartbeats): <id>`` rather than
    letting it hang in a collective. On CPU the cross-process collectives are Gloo's
    (``jax_cpu_collectives_implementation``, set to ``'gloo'`` here when unset).

    On a GPU host each process drives its own GPUs (JAX's ``local_device_ids``): those
    given, else ``JAX_LOCAL_DEVICE_IDS`` (``python -m blox.launch`` sets it per process),
    else its share by its local rank on the host (``BLOX_LOCAL_RANK``, torchrun-style
    ``LOCAL_RANK``, ``SLURM_LOCALID``, ``OMPI_COMM_WORLD_LOCAL_RANK``, ``MPI_LOCALRANKID``;
    ``BLOX_DEVICES_PER_PROCESS`` GPUs each, default an even split, or one each when the
    count is unknown). A process alone on its host, or whose scheduler already restricted
    ``CUDA_VISIBLE_DEVICES`` to fewer GPUs than processes, keeps every GPU it sees.

    A process of a group that fails would wait at JAX's shutdown barrier (for
    `shutdown_timeout` seconds) for peers that are still computing. Joined, the process
    instead ends at once with its status when it fails: on an uncaught exception (with
    `exit_on_error`: ``sys.excepthook`` is chained, the traceback printed, exit code 1),
    or, under ``python -m blox.launch``, on any non-zero exit such as ``sys.exit(3)``.
    The ``atexit`` handlers registered after `initialize` still run and the logging
    handlers are flushed first; only JAX's barrier is skipped. The others learn of it
    through the launcher or the heartbeat. (Without the launcher, ``sys.exit(n)`` is an
    ordinary exit and waits at the barrier: raise instead.)

    Calling it again once joined returns the description and does nothing else.

    Args:
      coordinator_address: ``'host:port'`` of process 0 (which starts the coordinator);
        every process passes the same value.
      num_processes: the group's size.
      process_id: this process's index in ``0..num_processes-1``.
      initialization_timeout: seconds to wait for every process to join (default
        ``BLOX_INIT_TIMEOUT`` or 300).
      heartbeat_timeout: seconds of silence after which a process is declared dead
        (default ``BLOX_HEARTBEAT_TIMEOUT`` or 30; JAX's own default is 100).
      shutdown_timeout: seconds a finishing process waits for the others at exit.
      roll_call_first: run the roll call described above (``False``: JAX's join alone).
      exit_on_error: in a group, end the process at once on an uncaught exception.
      local_device_ids: the GPU ordinals this process drives (default: from the
        environment, as above); ignored by CPU and TPU devices.

    Returns:
      A `ProcessInfo`: process id and count, local and global devices, the coordinator
      and where the settings came from.

    Raises:
      ValueError: only some of the three settings given, an id outside
        ``0..num_processes-1``, a malformed address, two processes with one id, processes
        started with different counts, a call after JAX has started its backends, a
        repeated device id, a malformed ``JAX_LOCAL_DEVICE_IDS`` or local-rank variable.
      TypeError: a count or id that is not an int, device ids that are not ints.
      TimeoutError: processes that did not join within `initialization_timeout`, named.

    >>> from blox import distributed as bd
    >>> info = bd.initialize()  # alone: nothing to join
    >>> info.num_processes, info.source
    (1, 'single process')
    """
    _mark_joining(os.environ)
    device_ids = _check_device_ids(local_device_ids)
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": _check_int("num_processes", num_processes),
        "process_id": _check_int("process_id", process_id),
    }
    timeout, heartbeat = _timeouts(initialization_timeout, heartbeat_timeout)
    settings = _group_settings(given, timeout)
    if settings is None:  # alone
        if jax.distributed.is_initialized():
            return describe()
        return describe(source="single process")
    address, count, pid, source = settings
    _check_rank(count, pid)
    split_address(address)  # validates
    if count == 1:
        return describe(source=source)
    if jax.distributed.is_initialized():
        joined = (jax.process_index(), jax.process_count())
        if joined != (pid, count):
            raise ValueError(
                f"initialize: already joined as process {joined[0]} of {joined[1]}, now "
                f"asked to be process {pid} of {count}."
            )
        return describe(source=source)
    _join(
        address,
        count,
        pid,
        _pick_devices(device_ids),
        timeout=timeout,
        heartbeat=heartbeat,
        shutdown_timeout=shutdown_timeout,
        roll_call_first=roll_call_first,
    )
    _install_exit_guard(exit_on_error, os.environ.get(ENV_LAUNCH_DIR), pid)
    return describe(source=source)


def _timeouts(
    initialization_timeout: float | None, heartbeat_timeout: int | None
) -> tuple[float, int]:
    """The join and heartbeat timeouts in seconds: as given, else from ``BLOX_INIT_TIMEOUT``
    and ``BLOX_HEARTBEAT_TIMEOUT``, else the defaults; both must be positive."""
    timeout = (
        float(initialization_timeout)
        if initialization_timeout is not None
        else _float_env(ENV_INIT_TIMEOUT, DEFAULT_INIT_TIMEOUT)
    )
    if timeout <= 0:
        raise ValueError(f"initialize: initialization_timeout={timeout} must be positive.")
    heartbeat = (
        int(heartbeat_timeout)
        if heartbeat_timeout is not None
        else int(_float_env(ENV_HEARTBEAT_TIMEOUT, DEFAULT_HEARTBEAT_TIMEOUT))
    )
    if heartbeat <= 0:
        raise ValueError(f"initialize: heartbeat_timeout={heartbeat} must be positive.")
    return timeout, heartbeat


def _group_settings(given: Mapping[str, Any], timeout: float) -> tuple[str, int, int, str] | None:
    """``(address, count, id, source)`` of the group, from the arguments, else the
    ``BLOX_*`` environment, else a cluster JAX detects; ``None`` for a process alone."""
    if _all_or_none(
        given,
        "missing; pass all three of coordinator_address, num_processes and process_id, or "
        "none (then the BLOX_* environment or the cluster's is used).",
    ):
        return (
            given["coordinator_address"],
            given["num_processes"],
            given["process_id"],
            "arguments",
        )
    env = {
        ENV_COORDINATOR: os.environ.get(ENV_COORDINATOR) or None,
        ENV_NUM_PROCESSES: _int_env(ENV_NUM_PROCESSES),
        ENV_PROCESS_ID: _int_env(ENV_PROCESS_ID),
    }
    if _all_or_none(
        env,
        "not set while other BLOX_* variables are; set all three (python -m blox.launch "
        "does) or none.",
    ):
        address, count, pid = env.values()
        return address, count, pid, "environment"
    address, count, pid, source = _detect_cluster(timeout)
    if count is None or count <= 1:
        return None
    return address, count, pid, source


def _all_or_none(settings: Mapping[str, Any], problem: str) -> bool:
    """Whether `settings` are given: all of them (True) or none (False); only some raise
    a ``ValueError`` naming the missing ones, then `problem`."""
    if all(v is None for v in settings.values()):
        return False
    missing = [k for k, v in settings.items() if v is None]
    if missing:
        raise ValueError(f"initialize: {', '.join(missing)} {problem}")
    return True


def _check_rank(count: int, pid: int) -> None:
    """The group has at least one process and `pid` is one of them."""
    if count < 1:
        raise ValueError(f"initialize: num_processes={count} must be at least 1.")
    if not 0 <= pid < count:
        raise ValueError(
            f"initialize: process_id={pid} is outside 0..{count - 1} (num_processes={count}); "
            "number the processes from 0."
        )


def _join(
    address: str,
    count: int,
    pid: int,
    devices: tuple[int, ...] | None,
    *,
    timeout: float,
    heartbeat: int,
    shutdown_timeout: int,
    roll_call_first: bool,
) -> None:
    """Joins the group through ``jax.distributed.initialize`` (after the roll call), with
    Gloo's collectives on CPU unless another implementation is set."""
    if _backends_started():
        raise ValueError(_STARTED)
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    listener = inherited_listener(os.environ, split_address(address)[1]) if pid == 0 else None
    if roll_call_first:
        roll_call(address, pid, count, timeout, listener=listener)
    elif listener is not None:
        listener.close()  # JAX's coordinator binds the port itself
    try:
        jax.distributed.initialize(
            coordinator_address=address,
            num_processes=count,
            process_id=pid,
            local_device_ids=devices,
            initialization_timeout=max(1, int(timeout)),
            heartbeat_timeout_seconds=heartbeat,
            shutdown_timeout_seconds=int(shutdown_timeout),
            # blox has every setting (devices included): JAX detects nothing itself.
            cluster_detection_method="deactivate",
        )
    except RuntimeError as e:
        if "must be called before" in str(e):
            raise ValueError(_STARTED) from e
        raise


_STARTED = (
    "initialize: JAX has already started its backends in this process (something created an "
    "array, listed devices or ran a jitted function), so it can no longer join a group. Call "
    "blox.distributed.initialize() first thing in the script, before any other JAX call."
)
