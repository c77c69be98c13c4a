"""Which accelerator devices each process of a host drives (its *local rank*'s share).

Pure functions of the environment (a mapping) and of the device files a host lists, so
the assignment is tested without a GPU. `launch` uses them to give each process it starts
its own GPUs (``JAX_LOCAL_DEVICE_IDS``), `initialize` to pick the devices of a process
started by another launcher (torchrun-style ``LOCAL_RANK``, Slurm, Open MPI, MPICH).

JAX's ``local_device_ids`` restricts the GPUs (CUDA or ROCm) a process drives; it does not
apply to CPU devices, nor to TPU chips (several processes on one TPU host need the
``TPU_VISIBLE_CHIPS`` / ``TPU_PROCESS_BOUNDS`` family, which JAX's Cloud TPU support sets
for one process per host).
"""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Mapping, Sequence

__all__ = [
    "LocalRank",
    "accelerators",
    "assign_devices",
    "local_rank",
    "parse_device_ids",
    "resolve_platform",
]

# (rank variable, size variable or None, who sets them), in the order they are read.
LOCAL_RANK_VARS: tuple[tuple[str, str | None, str], ...] = (
    ("BLOX_LOCAL_RANK", "BLOX_LOCAL_WORLD_SIZE", "python -m blox.launch"),
    ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "torchrun-style launcher"),
    ("SLURM_LOCALID", None, "Slurm"),
    ("OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE", "Open MPI"),
    ("MPI_LOCALRANKID", "MPI_LOCALNRANKS", "MPICH / Intel MPI"),
)
# The variables a GPU runtime (or a scheduler, e.g. Slurm's --gpus-per-task) uses to
# restrict the GPUs a process sees.
VISIBLE_VARS = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
PLATFORMS = ("cpu", "gpu", "tpu")
_ALIASES = {"cuda": "gpu", "rocm": "gpu", "gpu": "gpu", "cpu": "cpu", "tpu": "tpu"}


@dataclasses.dataclass(frozen=True)
class LocalRank:
    """A process's index among the processes of its host, and their number (if known)."""

    rank: int
    size: int | None
    source: str  # the variable it was read from


def _nonneg_int(env: Mapping[str, str], name: str) -> int:
    value = env[name]
    try:
        out = int(value)
    except ValueError:
        out = -1
    if out < 0:
        raise ValueError(
            f"environment variable {name}={value!r} is not a non-negative integer (the local "
            "rank of this process on its host); fix or unset it."
        )
    return out


def _slurm_tasks_on_node(env: Mapping[str, str]) -> int | None:
    """``SLURM_STEP_TASKS_PER_NODE`` (or ``SLURM_TASKS_PER_NODE``), e.g. ``'4(x2),3'``,
    at index ``SLURM_NODEID``; None when absent or malformed."""
    value = env.get("SLURM_STEP_TASKS_PER_NODE") or env.get("SLURM_TASKS_PER_NODE")
    node = env.get("SLURM_NODEID")
    if not value or node is None or not node.isdigit():
        return None
    counts: list[int] = []
    for part in value.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m is None:
            return None
        counts += [int(m[1])] * int(m[2] or 1)
    return counts[int(node)] if int(node) < len(counts) else None


def local_rank(env: Mapping[str, str]) -> LocalRank | None:
    """The local rank the environment gives this process, from the first variable of
    `LOCAL_RANK_VARS` that is set; None when none is.

    Raises:
      ValueError: a rank or size that is not a non-negative integer, or a rank not
        below the size.
    """
    for rank_var, size_var, _ in LOCAL_RANK_VARS:
        if env.get(rank_var, "") == "":
            continue
        rank = _nonneg_int(env, rank_var)
        if size_var is None:
            size = _slurm_tasks_on_node(env)
        elif env.get(size_var, "") != "":
            size = _nonneg_int(env, size_var)
        else:
            size = None
        if size is not None and not rank < size:
            raise ValueError(
                f"environment variable {rank_var}={rank} is not below the number of "
                f"processes on this host ({size_var or 'SLURM_STEP_TASKS_PER_NODE'}={size}); "
                "fix the launcher's environment."
            )
        return LocalRank(rank, size, rank_var)
    return None


def _count_entries(value: str) -> int:
    value = value.strip()
    if value in ("", "-1", "NoDevFiles", "none"):
        return 0
    return len([v for v in value.split(",") if v.strip()])


def accelerators(
    env: Mapping[str, str], listdir: Callable[[str], Sequence[str]] = os.listdir
) -> tuple[str, int] | None:
    """``(platform, count)`` of the accelerators this host shows, found without starting
    JAX (which would take every GPU): a ``*_VISIBLE_DEVICES`` variable when set, else the
    NVIDIA driver's ``/proc/driver/nvidia/gpus`` or ``/dev/nvidia<N>`` entries (GPU), else
    ``/dev/accel<N>`` or ``/dev/vfio/<N>`` (TPU). None when nothing is found.

    `listdir` lists a directory (``os.listdir``; raising ``OSError`` for a missing one).
    """
    for name in VISIBLE_VARS:
        if name in env:
            return "gpu", _count_entries(env[name])

    def entries(path: str) -> list[str]:
        try:
            return list(listdir(path))
        except OSError:
            return []

    gpus = entries("/proc/driver/nvidia/gpus")
    if gpus:
        return "gpu", len(gpus)
    dev = entries("/dev")
    nvidia = [d for d in dev if re.fullmatch(r"nvidia\d+", d)]
    if nvidia:
        return "gpu", len(nvidia)
    accel = [d for d in dev if re.fullmatch(r"accel\d+", d)]
    if accel:
        return "tpu", len(accel)
    vfio = [d for d in entries("/dev/vfio") if d.isdigit()]
    if vfio:
        return "tpu", len(vfio)
    return None


def resolve_platform(
    requested: str | None, env: Mapping[str, str], found: tuple[str, int] | None
) -> str:
    """``'cpu'``, ``'gpu'`` or ``'tpu'``: `requested` (``'cuda'``/``'rocm'`` mean
    ``'gpu'``), else the first entry of ``JAX_PLATFORMS``, else the accelerators `found`
    (see `accelerators`), else ``'cpu'``.

    Raises:
      ValueError: an unknown platform name.
    """
    if requested is not None:
        name, where = requested, f"platform={requested!r}"
    elif env.get("JAX_PLATFORMS"):
        name = env["JAX_PLATFORMS"].split(",")[0].strip()
        where = f"JAX_PLATFORMS={env['JAX_PLATFORMS']!r}"
    elif found is not None and found[1] > 0:
        return found[0]
    else:
        return "cpu"
    if name.lower() not in _ALIASES:
        raise ValueError(f"{where}: unknown platform {name!r}; use one of cpu, gpu, tpu.")
    return _ALIASES[name.lower()]


def parse_device_ids(value: str, where: str) -> tuple[int, ...]:
    """``'0,1'`` -> ``(0, 1)``; ValueError naming `where` when malformed or repeated."""
    try:
        ids = tuple(int(v) for v in value.split(","))
    except ValueError:
        ids = ()
    if not ids or any(i < 0 for i in ids) or len(set(ids)) != len(ids):
        raise ValueError(
            f"{where}={value!r} is not a comma-separated list of distinct device ids "
            "(e.g. '0,1'); fix or unset it."
        )
    return ids


def assign_devices(
    rank: int,
    size: int | None,
    *,
    device_count: int | None = None,
    devices_per_process: int | None = None,
    strict: bool = True,
) -> tuple[int, ...] | None:
    """The device ids local process `rank` of `size` drives, or None (every visible one).

    * `devices_per_process` K given: ids ``K*rank .. K*rank+K-1``.
    * Else, with `device_count` known: the devices split evenly, ``device_count // size``
      each; unknown: one each (JAX's and torchrun's convention for ``LOCAL_RANK``).
    * A process alone on its host (`size` 1) without K keeps every device.
    * Not `strict` (a scheduler's environment): fewer visible devices than processes means
      the scheduler already gave each process its own (e.g. Slurm's ``--gpus-per-task``
      sets ``CUDA_VISIBLE_DEVICES`` per task): None.

    Raises:
      ValueError: more devices asked for than the host has, or (without K) a count that
        does not split evenly over the processes; the message says what to pass.
    """
    if devices_per_process is not None and devices_per_process < 1:
        raise ValueError(f"devices_per_process={devices_per_process} must be >= 1.")
    if devices_per_process is None and size == 1:
        return None
    if device_count is not None and size is not None and devices_per_process is None:
        if device_count < size and not strict:
            return None
        if device_count < size or device_count % size:
            raise ValueError(
                f"{device_count} visible GPUs do not split evenly over {size} processes on "
                "this host; pass --devices-per-process K (launch(devices_per_process=K)) "
                "with K * processes <= GPUs, or start a number of processes that divides "
                f"{device_count}."
            )
        per = device_count // size
    else:
        per = 1 if devices_per_process is None else devices_per_process
    ids = tuple(range(rank * per, (rank + 1) * per))
    if device_count is not None and ids[-1] >= device_count:
        if not strict and device_count <= per:
            return None
        raise ValueError(
            f"local process {rank} would drive GPUs {list(ids)}, but this host shows "
            f"{device_count} ({', '.join(VISIBLE_VARS[:1])} or the driver's list); start "
            f"fewer processes or pass a smaller --devices-per-process (now {per})."
        )
    return ids
