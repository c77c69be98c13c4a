"""Pipelines with Grain: shuffle by seed, batching, repeat, workers, resume."""

import json

import grain
import numpy as np
import pytest

from blox.data import ArraySource, WindowedSource, pipeline
from tests.data.helpers import recordings, reference_windows

SIGNALS = {"u": ["u0", "u2"], "y": "y"}
SIGNALS_LISTS = {"u": ["u0", "u2"], "y": ["y"]}


@pytest.fixture
def files(tmp_path):
    # one memory-mapped and one chunked + compressed file among three
    p1, a1 = recordings(tmp_path, [30, 17], tag="c")
    p2, a2 = recordings(tmp_path, [25], chunked=True, tag="k", seed=1)
    return p1 + p2, a1 + a2


def _ref_batches(ref, order, batch_size, drop_remainder):
    """Batches from the reference windows in `order`, by NumPy stacking."""
    stop = len(order) - len(order) % batch_size if drop_remainder else len(order)
    out = []
    for a in range(0, stop, batch_size):
        ids = order[a : a + batch_size]
        out.append({k: np.stack([ref[i][k] for i in ids]) for k in ref[0]})
    return out


def _epoch_seed(seed, epoch):
    """The documented per-epoch seed: `seed`, then SeedSequence([seed, epoch])."""
    if epoch == 0:
        return seed
    return int(np.random.SeedSequence([seed, epoch]).generate_state(1)[0])


def _grain_order(n, seed, epochs):
    """The item order Grain's own index shuffle gives each epoch with its epoch seed."""
    orders = []
    for e in range(epochs):
        shuffled = grain.MapDataset.range(n).shuffle(seed=_epoch_seed(seed, e))
        orders.append([int(shuffled[i]) for i in range(n)])
    return orders


def _take(ds, k):
    it = iter(ds)
    try:
        return [next(it) for _ in range(k)]
    finally:
        it.close()


def _assert_batches_equal(got, expected):
    assert len(got) == len(expected)
    for b, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert set(g) == set(e), b
        for key in e:
            np.testing.assert_array_equal(g[key], e[key], err_msg=f"batch {b} {key}")


def test_in_order_batches_equal_numpy(files):
    paths, arrays = files
    src = WindowedSource(paths, SIGNALS, window=6, stride=4)
    ref = reference_windows(arrays, SIGNALS_LISTS, 6, 4)
    order = list(range(len(ref)))
    for drop in (False, True):
        got = list(pipeline(src, batch_size=4, drop_remainder=drop))
        _assert_batches_equal(got, _ref_batches(ref, order, 4, drop))
    assert len(ref) % 4  # the partial last batch is exercised


def test_shuffled_epochs_are_permutations_by_seed(files):
    paths, arrays = files
    src = WindowedSource(paths, SIGNALS, window=5, stride=3)
    ref = reference_windows(arrays, SIGNALS_LISTS, 5, 3)
    n = len(ref)
    orders = _grain_order(n, seed=7, epochs=3)
    assert sorted(orders[0]) == list(range(n)) and orders[0] != list(range(n))
    assert orders[0] != orders[1]  # each epoch reshuffled
    expected = [b for o in orders for b in _ref_batches(ref, o, 3, True)]
    got = _take(
        pipeline(src, batch_size=3, shuffle=True, seed=7, num_epochs=None, drop_remainder=True),
        len(expected),
    )
    _assert_batches_equal(got, expected)
    # a finite number of epochs stops; another seed gives another order
    two = list(pipeline(src, batch_size=3, shuffle=True, seed=7, num_epochs=2, drop_remainder=True))
    _assert_batches_equal(two, expected[: 2 * (n // 3)])
    other = next(iter(pipeline(src, batch_size=3, shuffle=True, seed=8)))
    assert not np.array_equal(other["y"], expected[0]["y"])


def test_epochs_of_neighbouring_seeds_do_not_overlap():
    # Grain's own repeat shuffles epoch e with seed + e: seed 0's epoch 1 was seed 1's epoch 0
    n = 20
    src = ArraySource({"id": np.arange(n)})

    def epochs(seed):
        kw = dict(batch_size=n, shuffle=True, seed=seed, num_epochs=None)
        return [b["id"].tolist() for b in _take(pipeline(src, **kw), 3)]

    s0, s1 = epochs(0), epochs(1)
    assert all(sorted(e) == list(range(n)) for e in s0 + s1)
    assert s0[1] != s1[0] and s0[2] != s1[1]
    assert s0 == _grain_order(n, 0, 3) and s1 == _grain_order(n, 1, 3)


def test_threads_and_prefetch_do_not_change_batches(files):
    paths, _ = files
    src = WindowedSource(paths, SIGNALS, window=5, stride=2)
    kw = dict(batch_size=4, shuffle=True, seed=3, num_epochs=2)
    base = list(pipeline(src, read_threads=0, prefetch=0, **kw))
    _assert_batches_equal(list(pipeline(src, read_threads=3, prefetch=5, **kw)), base)


@pytest.mark.slow
def test_two_worker_processes_yield_the_in_process_batches(files):
    paths, _ = files
    src = WindowedSource(paths, SIGNALS, window=6, stride=5)
    kw = dict(batch_size=2, shuffle=True, seed=11, num_epochs=None, drop_remainder=True)
    expected = _take(pipeline(src, **kw), 7)
    got = _take(pipeline(src, num_workers=2, **kw), 7)
    _assert_batches_equal(got, expected)
    # Repositioned by batch index (what blox.ckpt's data_from_step does on resume): Grain
    # does it with one worker; with several it refuses, and the message says what to do.
    for workers in (1, 2):
        it = iter(pipeline(src, num_workers=workers, **kw))
        try:
            next(it)
            if workers == 2:
                with pytest.raises(ValueError, match=r"num_workers=2 .* num_workers=0 or 1"):
                    grain.experimental.set_next_index(it, 2)
                continue
            grain.experimental.set_next_index(it, 4)
            assert grain.experimental.get_next_index(it) == 4
            _assert_batches_equal([next(it) for _ in range(2)], expected[4:6])
        finally:
            it.close()


@pytest.mark.parametrize("k", [1, 5, 9])
def test_resume_from_saved_state_equals_uninterrupted(files, k):
    paths, _ = files
    kw = dict(batch_size=3, shuffle=True, seed=5, num_epochs=None, drop_remainder=True)
    src = WindowedSource(paths, SIGNALS, window=5, stride=3)
    n_per_epoch = len(src) // 3
    assert 5 < n_per_epoch < 9  # k = 9 resumes in the second epoch
    uninterrupted = _take(pipeline(src, **kw), k + 6)
    it = iter(pipeline(src, **kw))
    for _ in range(k):
        next(it)
    state = json.loads(json.dumps(it.get_state()))  # what a checkpoint stores
    # rebuild everything (a new process would), restore, continue
    rebuilt = iter(pipeline(WindowedSource(paths, SIGNALS, window=5, stride=3), **kw))
    rebuilt.set_state(state)
    _assert_batches_equal([next(rebuilt) for _ in range(6)], uninterrupted[k:])


@pytest.mark.slow
def test_resume_with_worker_processes_in_tbptt_order(files):
    # workers, TBPTT order and resume together; the in-process run is the reference
    paths, _ = files
    src = WindowedSource(paths, SIGNALS, window=6, stride=3)
    kw = dict(
        batch_size=2, shuffle=True, seed=2, num_epochs=None, tbptt_chunk=3, drop_remainder=True
    )
    uninterrupted = _take(pipeline(src, **kw), 7)
    kw["num_workers"] = 2
    it = iter(pipeline(src, **kw))
    try:
        for _ in range(4):
            next(it)
        state = json.loads(json.dumps(it.get_state()))
    finally:
        it.close()
    rebuilt = iter(pipeline(src, **kw))
    try:
        rebuilt.set_state(state)
        got = [next(rebuilt) for _ in range(3)]
    finally:
        rebuilt.close()
    _assert_batches_equal(got, uninterrupted[4:])


def test_grain_dataloader_accepts_the_source(files):
    paths, arrays = files
    src = WindowedSource(paths, SIGNALS, window=6, stride=4)
    ref = reference_windows(arrays, SIGNALS_LISTS, 6, 4)
    sampler = grain.samplers.IndexSampler(
        len(src), grain.sharding.NoSharding(), shuffle=False, num_epochs=1
    )
    loader = grain.DataLoader(
        data_source=src,
        sampler=sampler,
        operations=[grain.transforms.Batch(5)],
        worker_count=0,
    )
    got = list(loader)
    _assert_batches_equal(got, _ref_batches(ref, list(range(len(ref))), 5, False))


def test_array_source_pipeline_images():
    rng = np.random.default_rng(0)
    x = rng.integers(0, 255, size=(10, 4, 4, 1)).astype(np.uint8)
    y = np.arange(10) % 3
    src = ArraySource({"x": x, "y": y})
    order = _grain_order(10, seed=4, epochs=2)
    got = _take(
        pipeline(src, batch_size=4, shuffle=True, seed=4, num_epochs=None, drop_remainder=True), 4
    )
    expected = [{"x": x[o[a : a + 4]], "y": y[o[a : a + 4]]} for o in order for a in (0, 4)]
    _assert_batches_equal(got, expected)
    assert got[0]["x"].dtype == np.uint8


# -- errors ---------------------------------------------------------------------------


def test_pipeline_errors(files):
    paths, _ = files
    src = WindowedSource(paths, SIGNALS, window=5)
    with pytest.raises(ValueError, match=r"shuffle=True needs a seed.*seed=0"):
        pipeline(src, batch_size=2, shuffle=True)
    with pytest.raises(ValueError, match=r"seed must be an int in \[0, 2\*\*32\), got -1"):
        pipeline(src, batch_size=2, shuffle=True, seed=-1)
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        pipeline(src, batch_size=0)
    with pytest.raises(ValueError, match=r"batch_size=6 .* not divisible by shard_count=4.*8"):
        pipeline(src, batch_size=6, shard_count=4)
    with pytest.raises(ValueError, match=r"shard_index=2 must be < shard_count=2"):
        pipeline(src, batch_size=4, shard_index=2, shard_count=2)
    with pytest.raises(ValueError, match=r"prefetch=1 is smaller than read_threads=2"):
        pipeline(src, batch_size=2, prefetch=1)
    with pytest.raises(ValueError, match=r"num_epochs must be an int >= 1, got 0"):
        pipeline(src, batch_size=2, num_epochs=0)
    with pytest.raises(ValueError, match=r"make no full batch of 1000 and drop_remainder"):
        pipeline(src, batch_size=1000, drop_remainder=True)
    with pytest.raises(TypeError, match=r"support len\(\) and \[\].*ArraySource"):
        pipeline(object(), batch_size=2)


def test_array_source_errors():
    with pytest.raises(ValueError, match=r"disagree on their leading.*'y': \(3,\)"):
        ArraySource({"x": np.zeros((4, 2)), "y": np.zeros(3)})
    with pytest.raises(TypeError, match=r"non-empty dict of arrays, got list"):
        ArraySource([np.zeros(3)])
    with pytest.raises(ValueError, match=r"array 'x' is a scalar"):
        ArraySource({"x": np.float32(1.0)})
