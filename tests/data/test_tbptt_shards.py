"""TBPTT order (test 4) and per-process shards (test 5)."""

import logging

import grain
import jax
import numpy as np
import pytest

from blox.data import ArraySource, WindowedSource, pipeline
from tests.data.helpers import recordings, reference_windows

SIGNALS = {"u": ["u0", "u2"], "y": "y"}
SIGNALS_LISTS = {"u": ["u0", "u2"], "y": ["y"]}


def _take(ds, k):
    it = iter(ds)
    return [next(it) for _ in range(k)]


@pytest.mark.parametrize("shard_count", [1, 2])
def test_tbptt_rows_continue_and_flags_mark_sequence_starts(tmp_path, shard_count):
    paths, arrays = recordings(tmp_path, [40, 26, 33])
    window, chunk, batch = 12, 4, 4
    src = WindowedSource(paths, SIGNALS, window=window, stride=5)
    ref = reference_windows(arrays, SIGNALS_LISTS, window, 5)
    n, k = len(ref), window // chunk
    groups_per_epoch = n // batch
    epochs = 2
    # the sequence order Grain's index shuffle gives (the reference for which item is where)
    order = []
    for e in range(epochs):  # epoch e: Grain's shuffle with seed 9, then SeedSequence([9, e])
        s = 9 if e == 0 else int(np.random.SeedSequence([9, e]).generate_state(1)[0])
        shuffled = grain.MapDataset.range(n).shuffle(seed=s)
        order += [int(shuffled[i]) for i in range(groups_per_epoch * batch)]
    local = batch // shard_count
    for shard in range(shard_count):
        ds = pipeline(
            src,
            batch_size=batch,
            shuffle=True,
            seed=9,
            num_epochs=epochs,
            drop_remainder=True,
            tbptt_chunk=chunk,
            shard_index=shard,
            shard_count=shard_count,
        )
        batches = list(ds)
        assert len(batches) == epochs * groups_per_epoch * k
        rows = [[] for _ in range(local)]  # per row: list of (is_first, chunk dict)
        for b in batches:
            assert b["u"].shape == (local, chunk, 3) and b["y"].shape == (local, chunk, 3)
            assert b["is_first"].shape == (local,) and b["is_first"].dtype == bool
            for i in range(local):
                rows[i].append((bool(b["is_first"][i]), {"u": b["u"][i], "y": b["y"][i]}))
        for i, row in enumerate(rows):
            flags = [f for f, _ in row]
            assert flags == [j % k == 0 for j in range(len(row))]  # exactly at starts
            for g in range(len(row) // k):
                seq = row[g * k : (g + 1) * k]
                expected = ref[order[g * batch + shard * local + i]]
                for key in ("u", "y"):
                    got = np.concatenate([c[key] for _, c in seq])
                    np.testing.assert_array_equal(got, expected[key], err_msg=f"{g} {i} {key}")


def test_tbptt_over_in_memory_sequences_in_order():
    seqs = np.arange(5 * 6 * 2, dtype=np.float32).reshape(5, 6, 2)  # [N, T, C]
    src = ArraySource({"x": seqs, "label": np.arange(5)[:, None] * np.ones((1, 6))})
    batches = list(pipeline(src, batch_size=2, tbptt_chunk=3))
    # groups [0, 1], [2, 3], [4]: two chunks each, in order
    assert [b["x"].shape[0] for b in batches] == [2, 2, 2, 2, 1, 1]
    assert [b["is_first"].tolist() for b in batches] == [
        [True, True],
        [False, False],
        [True, True],
        [False, False],
        [True],
        [False],
    ]
    np.testing.assert_array_equal(
        np.concatenate([batches[2]["x"], batches[3]["x"]], axis=1), seqs[2:4]
    )
    np.testing.assert_array_equal(batches[5]["x"][0], seqs[4, 3:])


def test_tbptt_errors(tmp_path):
    paths, _ = recordings(tmp_path, [20, 30])
    src = WindowedSource(paths, SIGNALS, window=10)
    with pytest.raises(
        ValueError,
        match=r"tbptt_chunk=4 does not divide the item length 10.*"
        r"window=8\) or a chunk that divides 10",
    ):
        pipeline(src, batch_size=2, tbptt_chunk=4)
    with pytest.raises(ValueError, match=r"tbptt_chunk must be an int >= 1, got 0"):
        pipeline(src, batch_size=2, tbptt_chunk=0)
    whole = WindowedSource(paths, SIGNALS, window=None)
    with pytest.raises(ValueError, match=r"needs items of one fixed length.*window=None"):
        pipeline(whole, batch_size=2, tbptt_chunk=5)
    named = WindowedSource(paths, {"is_first": "u0"}, window=10)
    with pytest.raises(ValueError, match=r"array or signal named 'is_first'.*rename it"):
        pipeline(named, batch_size=2, tbptt_chunk=5)
    arrays = ArraySource({"x": np.zeros((4, 10, 1)), "is_first": np.zeros((4, 10))})
    with pytest.raises(ValueError, match=r"array or signal named 'is_first'.*tbptt_chunk=5"):
        pipeline(arrays, batch_size=2, tbptt_chunk=5)


@pytest.mark.parametrize("shard_count", [2, 4])
@pytest.mark.parametrize("n", [22, 24])  # 22: a partial last batch of 6, 24 = 3 full batches
def test_shards_are_disjoint_and_cover_the_index(shard_count, n):
    batch = 8
    src = ArraySource({"id": np.arange(n), "x": np.arange(n * 3.0).reshape(n, 3)})
    # A partial batch of 6 splits evenly over 2 shards (3 rows each),
    # not over 4 (refused below): only the uneven case needs drop_remainder.
    drop = (n % batch) % shard_count != 0
    kw = dict(batch_size=batch, shuffle=True, seed=1, drop_remainder=drop)
    single = list(pipeline(src, **kw))
    shards = [
        list(pipeline(src, shard_index=s, shard_count=shard_count, **kw))
        for s in range(shard_count)
    ]
    assert all(len(s) == len(single) for s in shards)
    seen = []
    for b, whole in enumerate(single):
        parts = [s[b] for s in shards]
        ids = [p["id"].tolist() for p in parts]
        flat = [i for part in ids for i in part]
        assert len(set(flat)) == len(flat)  # disjoint within the batch
        assert flat == whole["id"].tolist()  # together: the single-process batch, in order
        np.testing.assert_array_equal(np.concatenate([p["x"] for p in parts]), whole["x"])
        assert all(len(i) == len(whole["id"]) // shard_count for i in ids)  # equal parts
        seen += flat
    assert len(seen) == len(set(seen))  # no window read twice in an epoch
    assert sorted(seen) == sorted(np.concatenate([b["id"] for b in single]).tolist())
    assert len(seen) == (n - n % batch if drop else n)
    if not drop:
        assert sorted(seen) == list(range(n))  # every window


@pytest.mark.parametrize("num_epochs", [2, None])
def test_partial_batch_allowed_unless_shards_would_get_unequal_parts(num_epochs, caplog):
    # An endless pipeline keeps its partial batch (jax.jit compiles that shape once, not
    # once per epoch); the refusal of partial batches stays where it is needed:
    # a partial batch of 6 over 4 shards would be unequal parts ([2, 2, 2, 0] or so).
    n, batch = 22, 8
    src = ArraySource({"id": np.arange(n)})
    kw = dict(batch_size=batch, shuffle=True, seed=1, num_epochs=num_epochs)
    with pytest.raises(ValueError, match=r"partial batch of 6 .* shard_count=4 shards .*"
                       r"unequal parts.*drop_remainder=True"):  # fmt: skip
        pipeline(src, shard_index=1, shard_count=4, **kw)
    with caplog.at_level(logging.INFO, logger="blox.data"):
        ds = pipeline(src, **kw)
    notes = [r.getMessage() for r in caplog.records if r.name == "blox.data"]
    assert len(notes) == 1 and "partial batch of 6 at the end of every epoch" in notes[0]
    assert caplog.records[0].levelno == logging.INFO  # a log line, not a warning
    got = _take(ds, 6)
    assert [len(b["id"]) for b in got] == [8, 8, 6, 8, 8, 6]
    # each epoch is the permutation Grain's index shuffle gives with its epoch seed
    for e in range(2):
        s = 1 if e == 0 else int(np.random.SeedSequence([1, e]).generate_state(1)[0])
        shuffled = grain.MapDataset.range(n).shuffle(seed=s)
        ids = np.concatenate([b["id"] for b in got[3 * e : 3 * e + 3]])
        assert ids.tolist() == [int(shuffled[i]) for i in range(n)]
    # jax.jit caches the partial shape: two compiles over two epochs, not one per epoch
    traces = []
    step = jax.jit(lambda x: (traces.append(x.shape), x.sum())[1])
    for b in got:
        step(b["id"])
    assert traces == [(8,), (6,)]
    # over 2 shards the 6 rows split 3 + 3: together the single-process batches, in order
    parts = [_take(pipeline(src, shard_index=s, shard_count=2, **kw), 6) for s in (0, 1)]
    for b, whole in enumerate(got):
        assert [len(p[b]["id"]) for p in parts] == [len(whole["id"]) // 2] * 2
        assert np.concatenate([p[b]["id"] for p in parts]).tolist() == whole["id"].tolist()
    fixed = _take(pipeline(src, shard_index=1, shard_count=4, drop_remainder=True, **kw), 3)
    assert [len(b["id"]) for b in fixed] == [2, 2, 2]  # the fix the message names


def test_hdf5_shards_read_only_their_rows(tmp_path):
    paths, arrays = recordings(tmp_path, [30, 21])
    src = WindowedSource(paths, SIGNALS, window=5, stride=2)
    ref = reference_windows(arrays, SIGNALS_LISTS, 5, 2)
    n = len(ref)
    kw = dict(batch_size=6, shuffle=True, seed=4, num_epochs=None, drop_remainder=True)
    single = _take(pipeline(src, **kw), 5)
    parts = [_take(pipeline(src, shard_index=s, shard_count=3, **kw), 5) for s in range(3)]
    shuffled = grain.MapDataset.range(n).shuffle(seed=4)
    for b in range(5):
        got = np.concatenate([p[b]["y"] for p in parts])
        np.testing.assert_array_equal(got, single[b]["y"])
        ids = [int(shuffled[b * 6 + i]) if b * 6 + i < n else None for i in range(6)]
        if None not in ids and b * 6 + 6 <= n:
            np.testing.assert_array_equal(got, np.stack([ref[i]["y"] for i in ids]))
