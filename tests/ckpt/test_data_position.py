"""Restoring a data-iterator position saved by another process count:
the error names the cause (saved by N processes, restored by M), never "damaged ...
delete the directory", and ``data_from_step`` positions a `blox.data.pipeline` iterator
from the step instead.

The N-process save is simulated here (the one-process step's iterator file renamed to
Grain's per-process names of 2 processes, with the state of each shard); a real
2-process save is restored in tests/ckpt/test_multiprocess_save.py. References: the
batches of an uninterrupted iterator of the same pipeline (and, for the shards, of the
2-shard pipelines, whose rows together are the 1-process batch).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from blox import ckpt
from blox.data import ArraySource, pipeline

SRC = ArraySource({"x": np.arange(48.0).reshape(24, 2)})


def _ds(shard_index=0, shard_count=1):
    return pipeline(
        SRC, batch_size=4, shuffle=True, seed=0, num_epochs=None, drop_remainder=True,
        shard_index=shard_index, shard_count=shard_count, read_threads=0, prefetch=0,
    )  # fmt: skip


def _batches(it, n):
    return [next(it)["x"] for _ in range(n)]


def _save_as_two_processes(directory, step=3):
    """Step `step` as 2 processes would write its data item: one position per process."""
    shards = [iter(_ds(i, 2)) for i in range(2)]
    for it in shards:
        _batches(it, step)
    with ckpt.CheckpointManager(directory) as mngr:
        mngr.save(step, {"step": step}, data_iterator=shards[0])
    data = directory / str(step) / "data"
    (data / "process_0-of-1.json").rename(data / "process_0-of-2.json")
    (data / "process_1-of-2.json").write_text(json.dumps(shards[1].get_state()))
    description = directory / str(step) / "blox" / "metadata"
    d = json.loads(description.read_text())
    description.write_text(json.dumps({**d, "process_count": 2}))


def test_another_process_count_names_the_cause_and_data_from_step_resumes(tmp_path):
    _save_as_two_processes(tmp_path)
    mngr = ckpt.CheckpointManager(tmp_path)
    it = iter(_ds())
    cause = "step 3 was saved by 2 processes and is restored by 1"
    with pytest.raises(ValueError, match=cause) as e:
        mngr.restore({"step": 0}, data_iterator=it)
    message = str(e.value)
    assert "data_from_step=True" in message and "The checkpoint is intact" in message
    assert "damaged" not in message and "delete" not in message
    assert not isinstance(e.value, ckpt.CheckpointError)
    # The state itself restores; the iterator is positioned at batch `step`.
    state = mngr.restore({"step": 0}, data_iterator=it, data_from_step=True)
    assert state == {"step": 3}
    reference = _batches(iter(_ds()), 6)[3:]  # an uninterrupted 1-process run
    np.testing.assert_array_equal(np.stack(_batches(it, 3)), np.stack(reference))
    # ... which is what the 2 shards would have read next, together.
    shards = [iter(_ds(i, 2)) for i in range(2)]
    nxt = [_batches(s, 4)[3] for s in shards]
    np.testing.assert_array_equal(np.concatenate(nxt), reference[0])


def test_data_from_step_options_and_errors(tmp_path):
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(2, {"step": 2})  # no data item: the position comes from the step
    mngr = ckpt.CheckpointManager(tmp_path)
    it = iter(_ds())
    mngr.restore({"step": 0}, data_iterator=it, data_from_step=lambda s: 3 * s)
    np.testing.assert_array_equal(next(it)["x"], _batches(iter(_ds()), 7)[6])
    with pytest.raises(ValueError, match="has no data-iterator state.*data_from_step=True"):
        mngr.restore({"step": 0}, data_iterator=iter(_ds()))
    with pytest.raises(ValueError, match="data_from_step positions data_iterator; pass"):
        mngr.restore({"step": 0}, data_from_step=True)
    with pytest.raises(TypeError, match="data_from_step must be True .* got 'yes'"):
        mngr.restore({"step": 0}, data_iterator=iter(_ds()), data_from_step="yes")
    with pytest.raises(ValueError, match=r"data_from_step\(step=2\) must return .* got -1"):
        mngr.restore({"step": 0}, data_iterator=iter(_ds()), data_from_step=lambda s: -1)

    class Position:  # checkpointable, but cannot skip to an index
        def get_state(self):
            return {"i": 0}

        def set_state(self, state):
            pass

    with pytest.raises(TypeError, match="data_from_step cannot position a Position at batch 2"):
        mngr.restore({"step": 0}, data_iterator=Position(), data_from_step=True)
