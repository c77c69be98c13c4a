"""`save` starts the checksums without copying a leaf to the host or compiling in the
caller's thread: on CPU every save keeps views of the leaves (summed in Orbax's commit
thread); on accelerators (here: CPU devices told otherwise) the first save of a state
layout copies the leaves asynchronously to host memory while one program for all leaves
compiles in a background thread, and later saves dispatch that program. The sums stay the
documented ones.

References: JAX's compilation events (``jax.monitoring``), with the thread that compiled;
the host copies (``numpy.asarray`` of a jax array) and host sums that the saving thread
makes, against those of a plain Orbax save of the same state (Orbax's own copies, one per
distinct shard); the
checksum computed with Python integers from the values' bytes (``test_dtypes``).
"""

from __future__ import annotations

import json
import threading

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from jax.sharding import NamedSharding, PartitionSpec

from blox import ckpt
from blox.ckpt import _checksum
from blox.ckpt._manager import _type_handlers
from tests.ckpt.test_dtypes import _reference

COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


def _state(mesh, n_small: int = 12):
    """A large leaf (above the 1 MiB that earlier versions summed on the host), small
    leaves replicated over the mesh, a sharded one and an uncommitted one."""
    rs = np.random.default_rng(0)
    replicated = NamedSharding(mesh, PartitionSpec())
    state = {
        "big": jax.device_put(rs.standard_normal((600, 600)).astype(np.float32), replicated),
        "rows": jax.device_put(
            rs.standard_normal((16, 6)).astype(np.float32), NamedSharding(mesh, PartitionSpec("d"))
        ),
        "count": jnp.asarray(7, jnp.int32),
    }
    for i in range(n_small):
        state[f"small{i}"] = jax.device_put(
            rs.standard_normal(32 + i).astype(np.float32), replicated
        )
    return jax.block_until_ready(state)


class _Calls:
    """Records what the calling thread does: compilations; host copies of jax arrays
    through ``numpy.asarray``/``numpy.array`` (how Orbax and earlier blox versions copy;
    on CPU a NumPy view of a buffer is no copy and not counted); and checksum arithmetic
    on the host."""

    def __init__(self, monkeypatch):
        self.thread = threading.get_ident()
        self.compiles = self.copies = self.sums = 0
        for name in ("asarray", "array"):
            monkeypatch.setattr(np, name, self._copying(getattr(np, name)))
        for name in ("_host_sums", "_part_sums"):
            if hasattr(_checksum, name):
                monkeypatch.setattr(_checksum, name, self._summing(getattr(_checksum, name)))
        jax.monitoring.register_event_duration_secs_listener(self._on_event)

    def _mine(self) -> bool:
        return threading.get_ident() == self.thread

    def _copying(self, original):
        def wrapper(x, *args, **kwargs):
            out = original(x, *args, **kwargs)
            if isinstance(x, jax.Array) and self._mine() and not _is_view(out, x):
                self.copies += 1
            return out

        return wrapper

    def _summing(self, original):
        def wrapper(*args, **kwargs):
            if self._mine():
                self.sums += 1
            return original(*args, **kwargs)

        return wrapper

    def _on_event(self, event, duration, **kwargs):
        if event == COMPILE_EVENT and self._mine():
            self.compiles += 1

    def reset(self):
        self.compiles = self.copies = self.sums = 0

    def close(self):
        jax.monitoring.unregister_event_duration_listener(self._on_event)


def _is_view(out, x: jax.Array) -> bool:
    """Whether the NumPy array `out` is the buffer of the single-device array `x`."""
    if len(x.devices()) != 1 or not isinstance(out, np.ndarray) or out.size == 0:
        return False
    return out.__array_interface__["data"][0] == x.unsafe_buffer_pointer()


def test_save_neither_copies_nor_sums_nor_compiles_in_the_callers_thread(tmp_path, monkeypatch):
    mesh = jax.make_mesh((8,), ("d",))
    state = _state(mesh)
    calls = _Calls(monkeypatch)
    try:
        # Orbax alone, configured as the manager configures it: its host copies (one per
        # distinct shard, none on CPU) are the reference.
        handler = ocp.PyTreeCheckpointHandler(type_handler_registry=_type_handlers())
        orbax = ocp.AsyncCheckpointer(handler)
        calls.reset()
        orbax.save(tmp_path / "orbax", args=ocp.args.PyTreeSave(state))
        orbax_copies = calls.copies
        orbax.wait_until_finished()
        orbax.close()

        mngr = ckpt.CheckpointManager(tmp_path / "blox", save_on_exit=False)
        for step in (1, 2, 3):
            calls.reset()
            mngr.save(step, state)
            assert calls.compiles == 0, f"save {step} compiled in the caller's thread"
            assert calls.sums == 0, f"save {step} summed {calls.sums} leaves in the caller's thread"
            assert calls.copies == orbax_copies, (
                f"save {step} copied {calls.copies - orbax_copies} leaves to the host in "
                "the caller's thread besides Orbax's copies"
            )
            mngr.wait()
        mngr.close()
    finally:
        calls.close()
    want = {name: _reference(np.asarray(x)) for name, x in state.items()}
    for step in (1, 2, 3):
        sums = json.loads((tmp_path / "blox" / str(step) / "blox" / "checksums.json").read_text())
        assert sums == want, step
    restored = ckpt.CheckpointManager(tmp_path / "blox").restore(state)
    np.testing.assert_array_equal(restored["big"], state["big"])


@pytest.mark.parametrize("views_only", [True, False], ids=["cpu", "accelerator-way"])
@pytest.mark.parametrize("x64", [False, True])
def test_the_first_and_later_saves_write_the_documented_sums(
    tmp_path, monkeypatch, x64, views_only
):
    """Sharded, replicated and single-device leaves of several dtypes: the first save (host
    snapshots, summed shard by shard) and a later one (snapshots again on CPU; the
    accelerators' way, the compiled program under the same x64 setting as the caller)
    write the checksum of the Python-integer reference. The CPU case sums every block
    with the compiled block program (as blocks above 1 MiB are), the other with NumPy."""
    monkeypatch.setattr(_checksum, "_views_only", lambda arrays: views_only)
    if views_only:
        monkeypatch.setattr(_checksum, "HOST_BYTES", 0)
    mesh = jax.make_mesh((4, 2), ("a", "b"))
    rs = np.random.default_rng(1)
    dtypes = ["float32", "bfloat16", "int8", "bool", "complex64"]
    if x64:
        dtypes += ["float64", "uint64", "complex128"]
    specs = [PartitionSpec(), PartitionSpec("a"), PartitionSpec("a", "b"), PartitionSpec("b")]
    with jax.enable_x64(x64):
        state = {}
        for dtype in dtypes:
            x = rs.standard_normal((8, 6)) * 40
            if dtype.startswith("complex"):
                x = x + 1j * rs.standard_normal((8, 6))
            values = jnp.asarray(x > 0 if dtype == "bool" else x, dtype)
            for i, spec in enumerate(specs):
                state[f"{dtype}_{i}"] = jax.device_put(values, NamedSharding(mesh, spec))
            state[f"{dtype}_single"] = values
            state[f"{dtype}_vector"] = values.reshape(-1)[:29]  # 3 chunks, the last short
        want = {name: _reference(np.asarray(x)) for name, x in state.items()}
        mngr = ckpt.CheckpointManager(tmp_path)
        mngr.save(1, state)
        mngr.wait()
        mngr._checksums.wait()
        mngr.save(2, state)
        mngr.close()
        for step in (1, 2):
            sums = json.loads((tmp_path / str(step) / "blox" / "checksums.json").read_text())
            assert sums == want, step
        restored = ckpt.CheckpointManager(tmp_path).restore(state)
        for name, x in state.items():
            assert np.asarray(restored[name]).tobytes() == np.asarray(x).tobytes(), name
