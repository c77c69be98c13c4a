"""Joining a group of processes through ``jax.distributed``, or staying a single process.

The group's settings come, in this order, from the arguments of `initialize`, from the
``BLOX_*`` environment variables that ``python -m blox.launch`` sets (or a user sets by
hand), or from a cluster scheduler's environment that JAX recognises (Slurm, Open MPI,
Kubernetes, Cloud TPU). With none of them the process is alone and nothing is done.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any

import jax

from blox.distributed._rendezvous import roll_call, split_address

__all__ = ["ProcessInfo", "describe", "initialize"]

ENV_COORDINATOR = "BLOX_COORDINATOR_ADDRESS"
ENV_NUM_PROCESSES = "BLOX_NUM_PROCESSES"
ENV_PROCESS_ID = "BLOX_PROCESS_ID"
ENV_INIT_TIMEOUT = "BLOX_INIT_TIMEOUT"
ENV_HEARTBEAT_TIMEOUT = "BLOX_HEARTBEAT_TIMEOUT"

_EXPLICIT = ("arguments", "environment")
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
    address = _jax_state().coordinator_address if initialized else None
    return ProcessInfo(
        process_id=jax.process_index(),
        num_processes=jax.process_count(),
        local_devices=tuple(jax.local_devices()),
        devices=tuple(jax.devices()),
        coordinator_address=address,
        source=source,
    )


def _jax_state() -> Any:
    from jax._src import distributed as _distributed  # the only record of the address

    return _distributed.global_state


def _backends_started() -> bool:
    try:
        from jax._src import xla_bridge

        return bool(xla_bridge.backends_are_initialized())
    except (ImportError, AttributeError):  # pragma: no cover - a future JAX moved it
        return False


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


def _detect_cluster(timeout: float) -> tuple[str | None, int | None, int | None, str | None]:
    """JAX's own cluster detection (``jax._src.clusters``, the code behind
    ``jax.distributed.initialize()`` without arguments): (address, count, id, name)."""
    try:
        from jax._src import clusters
    except ImportError:  # pragma: no cover - a future JAX moved it
        return None, None, None, None
    env = next(
        (
            e
            for e in clusters.ClusterEnv._cluster_types
            if not e.opt_in_only_method and e.is_env_present()
        ),
        None,
    )
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


def _exit_on_uncaught_exception() -> None:
    """Wraps ``sys.excepthook``: print the traceback as usual, flush, then ``os._exit(1)``
    (JAX's exit handler would wait at the shutdown barrier for peers still computing)."""
    previous = sys.excepthook
    if getattr(previous, "_blox_exit_on_error", False):
        return

    def hook(kind, value, tb):
        try:
            previous(kind, value, tb)
            sys.stderr.write(
                f"blox.distributed: process {jax.process_index()} ends on the uncaught "
                f"{kind.__name__} above (exit code 1) without waiting for the other "
                "processes.\n"
            )
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(1)

    hook._blox_exit_on_error = True  # type: ignore[attr-defined]
    sys.excepthook = hook


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

    An uncaught exception in a process of a group would leave it waiting at JAX's shutdown
    barrier (for `shutdown_timeout` seconds) for peers that are still computing; with
    `exit_on_error` the process prints the traceback and exits at once with code 1
    (``sys.excepthook`` is wrapped; ``os._exit`` skips the barrier), so the others learn
    of it through the heartbeat or the launcher. ``sys.exit(n)`` with ``n != 0`` is an
    ordinary exit and still waits there: raise instead.

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

    Returns:
      A `ProcessInfo`: process id and count, local and global devices, the coordinator
      and where the settings came from.

    Raises:
      ValueError: only some of the three settings given, an id outside
        ``0..num_processes-1``, a malformed address, two processes with one id, processes
        started with different counts, or a call after JAX has started its backends.
      TypeError: a count or id that is not an int.
      TimeoutError: processes that did not join within `initialization_timeout`, named.

    >>> from blox import distributed as bd
    >>> info = bd.initialize()  # alone: nothing to join
    >>> info.num_processes, info.source
    (1, 'single process')
    """
    given = {
        "coordinator_address": coordinator_address,
        "num_processes": _check_int("num_processes", num_processes),
        "process_id": _check_int("process_id", process_id),
    }
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

    if any(v is not None for v in given.values()):
        missing = [k for k, v in given.items() if v is None]
        if missing:
            raise ValueError(
                f"initialize: {', '.join(missing)} missing; pass all three of "
                "coordinator_address, num_processes and process_id, or none (then the "
                "BLOX_* environment or the cluster's is used)."
            )
        source = "arguments"
        address, count, pid = coordinator_address, given["num_processes"], given["process_id"]
    else:
        env = {
            ENV_COORDINATOR: os.environ.get(ENV_COORDINATOR) or None,
            ENV_NUM_PROCESSES: _int_env(ENV_NUM_PROCESSES),
            ENV_PROCESS_ID: _int_env(ENV_PROCESS_ID),
        }
        if any(v is not None for v in env.values()):
            missing = [k for k, v in env.items() if v is None]
            if missing:
                raise ValueError(
                    f"initialize: {', '.join(missing)} not set while other BLOX_* variables "
                    "are; set all three (python -m blox.launch does) or none."
                )
            source = "environment"
            address, count, pid = env.values()
        else:
            address, count, pid, source = _detect_cluster(timeout)
            if count is None or count <= 1:
                if jax.distributed.is_initialized():
                    return describe()
                return describe(source="single process")

    if count < 1:
        raise ValueError(f"initialize: num_processes={count} must be at least 1.")
    if not 0 <= pid < count:
        raise ValueError(
            f"initialize: process_id={pid} is outside 0..{count - 1} (num_processes={count}); "
            "number the processes from 0."
        )
    split_address(address)  # validates
    if count == 1:
        return describe(source=source)
    if jax.distributed.is_initialized():
        state = _jax_state()
        if (state.process_id, state.num_processes) != (pid, count):
            raise ValueError(
                f"initialize: already joined as process {state.process_id} of "
                f"{state.num_processes}, now asked to be process {pid} of {count}."
            )
        return describe(source=source)
    if _backends_started():
        raise ValueError(
            "initialize: JAX has already started its backends in this process (something "
            "created an array, listed devices or ran a jitted function), so it can no longer "
            "join a group. Call blox.distributed.initialize() first thing in the script, "
            "before any other JAX call."
        )
    if jax.config.jax_cpu_collectives_implementation is None:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    if roll_call_first:
        roll_call(address, pid, count, timeout)
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=count,
        process_id=pid,
        initialization_timeout=max(1, int(timeout)),
        heartbeat_timeout_seconds=heartbeat,
        shutdown_timeout_seconds=int(shutdown_timeout),
        # Explicit settings skip JAX's cluster detection (which would also pick devices);
        # a detected cluster keeps it (e.g. one GPU per process under Slurm).
        cluster_detection_method="deactivate" if source in _EXPLICIT else None,
    )
    if exit_on_error:
        _exit_on_uncaught_exception()
    return describe(source=source)
