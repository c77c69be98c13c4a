"""Each process of a GPU host drives its own GPUs, without a GPU here.

The assignment is a pure function of the environment and of the device files a host
lists; these tests feed it the environments of ``python -m blox.launch``, torchrun-style
launchers, Slurm, Open MPI and MPICH, and hosts with 0, 4 or 8 GPUs or a TPU. The
reference is the closed form: local process r of n with K devices each drives ids
``K*r .. K*r+K-1`` (K = devices per process, or GPUs / n), written out by hand.
"""

from __future__ import annotations

import io
import json
import sys

import pytest

from blox.distributed import _devices as dv
from blox.distributed import initialize
from blox.distributed._init import local_device_ids_from_env
from blox.distributed._launch import device_env, launch
from tests.scripts import ROOT


def _lister(tree: dict[str, list[str]]):
    def listdir(path):
        if path not in tree:
            raise FileNotFoundError(path)
        return tree[path]

    return listdir


# --- local rank -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "env, want",
    [
        ({}, None),
        ({"BLOX_LOCAL_RANK": "1", "BLOX_LOCAL_WORLD_SIZE": "4"}, (1, 4, "BLOX_LOCAL_RANK")),
        ({"LOCAL_RANK": "3", "LOCAL_WORLD_SIZE": "8"}, (3, 8, "LOCAL_RANK")),
        ({"LOCAL_RANK": "3"}, (3, None, "LOCAL_RANK")),
        (
            {"OMPI_COMM_WORLD_LOCAL_RANK": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "4"},
            (2, 4, "OMPI_COMM_WORLD_LOCAL_RANK"),
        ),
        ({"MPI_LOCALRANKID": "0", "MPI_LOCALNRANKS": "2"}, (0, 2, "MPI_LOCALRANKID")),
        # Slurm: the task count of this node (SLURM_NODEID) from the compressed list.
        (
            {"SLURM_LOCALID": "1", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3"},
            (1, 4, "SLURM_LOCALID"),
        ),
        (
            {"SLURM_LOCALID": "2", "SLURM_NODEID": "2", "SLURM_STEP_TASKS_PER_NODE": "4(x2),3"},
            (2, 3, "SLURM_LOCALID"),
        ),
        (
            {"SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_TASKS_PER_NODE": "2,1"},
            (0, 1, "SLURM_LOCALID"),
        ),
        ({"SLURM_LOCALID": "0"}, (0, None, "SLURM_LOCALID")),
        # The launcher's own variables win over an outer launcher's.
        (
            {"LOCAL_RANK": "5", "BLOX_LOCAL_RANK": "0", "BLOX_LOCAL_WORLD_SIZE": "1"},
            (0, 1, "BLOX_LOCAL_RANK"),
        ),
        ({"LOCAL_RANK": "", "SLURM_LOCALID": "1"}, (1, None, "SLURM_LOCALID")),
    ],
)
def test_local_rank_reads_each_launchers_variables(env, want):
    got = dv.local_rank(env)
    assert (got if got is None else (got.rank, got.size, got.source)) == want


@pytest.mark.parametrize(
    "env, match",
    [
        ({"LOCAL_RANK": "one"}, r"LOCAL_RANK='one' is not a non-negative integer"),
        ({"SLURM_LOCALID": "-1"}, r"SLURM_LOCALID='-1' is not a non-negative integer"),
        (
            {"LOCAL_RANK": "4", "LOCAL_WORLD_SIZE": "4"},
            r"LOCAL_RANK=4 is not below .*LOCAL_WORLD_SIZE=4",
        ),
    ],
)
def test_local_rank_errors_name_the_variable(env, match):
    with pytest.raises(ValueError, match=match):
        dv.local_rank(env)


# --- what the host shows --------------------------------------------------------------


@pytest.mark.parametrize(
    "env, tree, want",
    [
        ({}, {}, None),
        ({"CUDA_VISIBLE_DEVICES": "0,1,2,3"}, {"/proc/driver/nvidia/gpus": ["a"] * 8}, ("gpu", 4)),
        ({"CUDA_VISIBLE_DEVICES": ""}, {}, ("gpu", 0)),
        ({"HIP_VISIBLE_DEVICES": "0,1"}, {}, ("gpu", 2)),
        ({}, {"/proc/driver/nvidia/gpus": [f"0000:{i:02x}:00.0" for i in range(8)]}, ("gpu", 8)),
        ({}, {"/dev": ["nvidia0", "nvidia1", "nvidiactl", "nvidia-uvm", "null"]}, ("gpu", 2)),
        ({}, {"/dev": ["accel0", "accel1", "accel2", "accel3", "tty"]}, ("tpu", 4)),
        ({}, {"/dev": ["null"], "/dev/vfio": ["0", "1", "vfio"]}, ("tpu", 2)),
        ({}, {"/dev": ["null", "tty"]}, None),
    ],
)
def test_accelerators_are_counted_without_starting_jax(env, tree, want):
    assert dv.accelerators(env, _lister(tree)) == want


@pytest.mark.parametrize(
    "requested, env, found, want",
    [
        (None, {}, None, "cpu"),
        (None, {}, ("gpu", 8), "gpu"),
        (None, {}, ("gpu", 0), "cpu"),
        (None, {}, ("tpu", 4), "tpu"),
        (None, {"JAX_PLATFORMS": "cpu"}, ("gpu", 8), "cpu"),
        (None, {"JAX_PLATFORMS": "cuda,cpu"}, None, "gpu"),
        ("rocm", {"JAX_PLATFORMS": "cpu"}, None, "gpu"),
        ("cpu", {}, ("gpu", 8), "cpu"),
    ],
)
def test_platform_is_asked_then_jax_platforms_then_found(requested, env, found, want):
    assert dv.resolve_platform(requested, env, found) == want


def test_unknown_platform_is_refused():
    with pytest.raises(ValueError, match=r"JAX_PLATFORMS='metal': unknown platform 'metal'"):
        dv.resolve_platform(None, {"JAX_PLATFORMS": "metal"}, None)


# --- the assignment -------------------------------------------------------------------


@pytest.mark.parametrize(
    "size, count, per, want",
    [
        (8, 8, None, [[0], [1], [2], [3], [4], [5], [6], [7]]),  # -n 8 on 8 GPUs
        (4, 8, None, [[0, 1], [2, 3], [4, 5], [6, 7]]),  # an even split
        (2, 8, 2, [[0, 1], [2, 3]]),  # K each, the rest unused
        (2, None, None, [[0], [1]]),  # count unknown: one each (JAX, torchrun)
        (3, None, 2, [[0, 1], [2, 3], [4, 5]]),
        (1, 8, None, [None]),  # alone on the host: every GPU
        (1, 8, 4, [[0, 1, 2, 3]]),
    ],
)
def test_each_local_rank_gets_its_own_block(size, count, per, want):
    got = [
        dv.assign_devices(r, size, device_count=count, devices_per_process=per) for r in range(size)
    ]
    assert [None if g is None else list(g) for g in got] == want


def test_a_scheduler_that_already_split_the_gpus_is_kept():
    # Slurm --gpus-per-task=1: each task sees one GPU (CUDA_VISIBLE_DEVICES=<its own>).
    assert dv.assign_devices(2, 4, device_count=1, strict=False) is None
    assert dv.assign_devices(2, 4, device_count=1, devices_per_process=1, strict=False) is None


@pytest.mark.parametrize(
    "rank, size, count, per, match",
    [
        (0, 3, 8, None, r"8 visible GPUs do not split evenly over 3 processes"),
        (0, 4, 2, None, r"2 visible GPUs do not split evenly over 4 processes"),
        (3, 4, 8, 3, r"local process 3 would drive GPUs \[9, 10, 11\], but this host shows 8"),
        (0, 2, 8, 0, r"devices_per_process=0 must be >= 1"),
    ],
)
def test_assignments_that_do_not_fit_are_refused(rank, size, count, per, match):
    with pytest.raises(ValueError, match=match):
        dv.assign_devices(rank, size, device_count=count, devices_per_process=per)


def test_device_ids_are_parsed_strictly():
    assert dv.parse_device_ids("2,3", "X") == (2, 3)
    for bad in ("", "a", "1,1", "-1"):
        with pytest.raises(ValueError, match="X=.* is not a comma-separated list"):
            dv.parse_device_ids(bad, "X")


# --- what the launcher sets -----------------------------------------------------------


@pytest.mark.parametrize(
    "n, per, want",
    [
        (8, None, [str(r) for r in range(8)]),
        (4, None, ["0,1", "2,3", "4,5", "6,7"]),
        (2, 3, ["0,1,2", "3,4,5"]),
    ],
)
def test_launcher_gives_each_process_its_gpus(n, per, want):
    envs = [device_env("gpu", r, n, per, ("gpu", 8)) for r in range(n)]
    assert [e["JAX_LOCAL_DEVICE_IDS"] for e in envs] == want
    assert [(e["BLOX_LOCAL_RANK"], e["BLOX_LOCAL_WORLD_SIZE"]) for e in envs] == [
        (str(r), str(n)) for r in range(n)
    ]
    assert not any("XLA_FLAGS" in e or "JAX_PLATFORMS" in e for e in envs)


def test_launcher_on_cpu_simulates_devices_and_leaves_gpus_alone():
    env = device_env("cpu", 1, 2, 4, None, "--xla_foo=1 --xla_force_host_platform_device_count=8")
    assert env["XLA_FLAGS"] == "--xla_foo=1  --xla_force_host_platform_device_count=4"
    assert env["JAX_PLATFORMS"] == "cpu" and "JAX_LOCAL_DEVICE_IDS" not in env
    assert device_env("cpu", 0, 2, None, None) == {
        "BLOX_LOCAL_RANK": "0",
        "BLOX_LOCAL_WORLD_SIZE": "2",
    }
    assert "JAX_LOCAL_DEVICE_IDS" not in device_env("gpu", 0, 1, None, ("gpu", 8))


def test_launcher_refuses_what_does_not_fit():
    with pytest.raises(ValueError, match="8 visible GPUs do not split evenly over 3"):
        device_env("gpu", 0, 3, None, ("gpu", 8))
    with pytest.raises(ValueError, match="2 processes on a TPU host"):
        device_env("tpu", 0, 2, None, ("tpu", 4))
    assert device_env("tpu", 0, 1, None, ("tpu", 4)) == {
        "BLOX_LOCAL_RANK": "0",
        "BLOX_LOCAL_WORLD_SIZE": "1",
    }


def test_launched_processes_get_their_gpus_in_the_environment(tmp_path):
    # The processes run a script that prints the variables (no JAX: it never joins, so the
    # join check is off). The host's GPUs are those CUDA_VISIBLE_DEVICES lists.
    script = tmp_path / "show.py"
    keys = ["BLOX_LOCAL_RANK", "BLOX_LOCAL_WORLD_SIZE", "JAX_LOCAL_DEVICE_IDS", "XLA_FLAGS"]
    script.write_text(
        f"import json, os\nprint(json.dumps({{k: os.environ.get(k) for k in {keys!r}}}))\n"
    )
    out, err = io.StringIO(), io.StringIO()
    env = {"PATH": "/usr/bin:/bin", "CUDA_VISIBLE_DEVICES": "0,1,2,3", "PYTHONPATH": str(ROOT)}
    code = launch(
        [str(script)], num_processes=2, env=env, join_timeout=None, stdout=out, stderr=err
    )
    assert code == 0, err.getvalue()
    got = {}
    for line in out.getvalue().splitlines():
        rank, text = line.split(" ", 1)
        got[rank] = json.loads(text)
    assert got == {
        "[0]": {
            **dict.fromkeys(keys),
            "BLOX_LOCAL_RANK": "0",
            "BLOX_LOCAL_WORLD_SIZE": "2",
            "JAX_LOCAL_DEVICE_IDS": "0,1",
        },
        "[1]": {
            **dict.fromkeys(keys),
            "BLOX_LOCAL_RANK": "1",
            "BLOX_LOCAL_WORLD_SIZE": "2",
            "JAX_LOCAL_DEVICE_IDS": "2,3",
        },
    }
    with pytest.raises(ValueError, match="4 visible GPUs do not split evenly over 3"):
        launch([str(script)], num_processes=3, env=env, join_timeout=None)


# --- what initialize passes to JAX ----------------------------------------------------


@pytest.mark.parametrize(
    "env, found, want",
    [
        ({"JAX_LOCAL_DEVICE_IDS": "2,3", "LOCAL_RANK": "0"}, ("gpu", 8), (2, 3)),  # launcher
        ({"LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4"}, ("gpu", 8), (2, 3)),  # torchrun
        ({"LOCAL_RANK": "1"}, None, None),  # a CPU host
        ({"LOCAL_RANK": "1", "JAX_PLATFORMS": "cpu"}, ("gpu", 8), None),
        ({"LOCAL_RANK": "1", "JAX_PLATFORMS": "cuda"}, None, (1,)),  # count unknown
        ({}, ("gpu", 8), None),  # no local rank: every GPU
        # Slurm, 4 tasks sharing 4 GPUs, vs --gpus-per-task=1 (each sees its own one).
        (
            {"SLURM_LOCALID": "2", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4"},
            ("gpu", 4),
            (2,),
        ),
        (
            {"SLURM_LOCALID": "2", "SLURM_NODEID": "0", "SLURM_STEP_TASKS_PER_NODE": "4"},
            ("gpu", 1),
            None,
        ),
        (
            {
                "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                "BLOX_DEVICES_PER_PROCESS": "2",
            },
            ("gpu", 8),
            (2, 3),
        ),
        ({"MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"}, ("tpu", 4), None),  # not TPU chips
    ],
)
def test_initialize_picks_the_devices_of_its_local_rank(env, found, want):
    assert local_device_ids_from_env(env, found) == want


def test_initialize_device_errors():
    with pytest.raises(ValueError, match=r"JAX_LOCAL_DEVICE_IDS='0,x' is not a comma-separated"):
        local_device_ids_from_env({"JAX_LOCAL_DEVICE_IDS": "0,x"}, None)
    with pytest.raises(ValueError, match=r"BLOX_DEVICES_PER_PROCESS='two' is not an integer"):
        local_device_ids_from_env(
            {"LOCAL_RANK": "0", "BLOX_DEVICES_PER_PROCESS": "two"}, ("gpu", 8)
        )
    with pytest.raises(TypeError, match=r"local_device_ids must be a non-empty list of"):
        initialize(local_device_ids=["0"])
    with pytest.raises(ValueError, match=r"local_device_ids=\[1, 1\] repeats a device"):
        initialize(local_device_ids=[1, 1])


# --- the JAX internals initialize reads fail clearly when moved ----------------------


def test_a_jax_without_the_cluster_detection_fails_clearly(monkeypatch):
    import jax._src

    monkeypatch.delattr(jax._src, "clusters", raising=False)
    monkeypatch.setitem(sys.modules, "jax._src.clusters", None)  # import fails
    for name in ("BLOX_COORDINATOR_ADDRESS", "BLOX_NUM_PROCESSES", "BLOX_PROCESS_ID"):
        monkeypatch.delenv(name, raising=False)
    assert initialize().num_processes == 1  # no scheduler around: still a single process
    monkeypatch.setenv("SLURM_JOB_ID", "7")
    with pytest.raises(RuntimeError, match=r"reads the cluster detection .* moved it"):
        initialize()
