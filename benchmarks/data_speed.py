"""Data loading speed: HDF5 windows through memory maps vs h5py vs a list of slices.

Run (``make bench``)::

    .venv/bin/python benchmarks/data_speed.py --out docs/benchmarks.md

Workload: a generated HDF5 recording of ~200 MB (float32 ``u [T, 4]`` and ``y [T, 2]``),
written twice into a temporary folder: contiguous (read by `blox.data.WindowedSource`
through ``np.memmap``) and chunked (``chunks=(16384, C)``, no compression: the same
source reads it through h5py). Third: h5py slicing the contiguous file through one open
handle (the reading mechanism alone). Fourth, the older TSFast way: every window
precomputed as a ``(path, start, stop)`` tuple, each read opening the file with h5py and
slicing both datasets. Each call reads one window at a random index (the same indices for
every contender) as ``{'u': [L, 4], 'y': [L, 2]}``, window length 500 and 5,000, stride
10. Before timing, all contenders are asserted to return equal windows.
Timing is same-round, interleaved (see ``_timing.py``); target: memory map >= 3x the
h5py path on L = 500 windows.

Small compressed recordings (``cache_bytes``): 16 recordings of 40,000 steps (about 1 MB
each), written contiguous and chunked + gzip (``chunks=(4096, C)``), read by
``blox.data.pipeline`` (batch 32, L = 500, shuffled, read on demand: ``read_threads=0``)
three ways: memory maps, h5py (every window decompresses its chunks), and h5py with
``cache_bytes=64 MB`` (each recording decompressed once per process, windows sliced from
memory). Batches per second, same-round interleaved like the windows; the first batches
(which fill the cache) are untimed and reported as the fill time. Before timing, the
three pipelines are asserted to give equal batches.

Loader: ``blox.data.pipeline`` (batch 32, L = 500, shuffled, repeated, defaults
``read_threads=2, prefetch=4``) with 0, 1 and 2 worker processes, batches per second
after start-up; against the steps per second of a jitted GRU train step (``bx.GRU``
hidden 64 + ``bx.Linear`` head, ``normalized_mse``, Adam) on those batches. The loop
does not wait on data when the ratio loader / step is above 1.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import _timing
import h5py
import jax
import jax.numpy as jnp
import numpy as np
import optax
from _timing import Contender, CountArgs, Pair, log

import blox as bx
from blox.data import WindowedSource, pipeline

TARGET = 1 / 3  # memmap time / h5py time on short windows
CACHE_TARGET = 1 / 5  # cached time / h5py time per batch on small gzip recordings
COUNTS = CountArgs(steps=200, warmup=20, quick_steps=5, quick_warmup=1, rounds=5)
SIGNALS = {"u": "u", "y": "y"}
STRIDE = 10


def write_files(folder: str, steps: int) -> tuple[str, str]:
    """The recording, contiguous and chunked: ``u [T, 4]``, ``y [T, 2]`` float32."""
    rng = np.random.default_rng(0)
    contiguous, chunked = os.path.join(folder, "rec.h5"), os.path.join(folder, "rec_chunked.h5")
    with h5py.File(contiguous, "w") as fc, h5py.File(chunked, "w") as fk:
        for name, ch in (("u", 4), ("y", 2)):
            dc = fc.create_dataset(name, shape=(steps, ch), dtype="f4")
            dk = fk.create_dataset(name, shape=(steps, ch), dtype="f4", chunks=(16384, ch))
            for a in range(0, steps, 1 << 20):
                block = rng.normal(size=(min(1 << 20, steps - a), ch)).astype(np.float32)
                dc[a : a + len(block)] = block
                dk[a : a + len(block)] = block
    return contiguous, chunked


class SliceList:
    """The older TSFast way: a precomputed ``(path, start, stop)`` per window, h5py reads."""

    def __init__(self, path: str, length: int, window: int, stride: int):
        self.items = [(path, s, s + window) for s in range(0, length - window + 1, stride)]

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        path, start, stop = self.items[i]
        with h5py.File(path, "r") as f:
            return {k: f[k][start:stop] for k in SIGNALS}


class OpenH5:
    """h5py on the contiguous file: one open handle, a slice of each dataset per window."""

    def __init__(self, path: str, source: WindowedSource):
        self.file, self.source = h5py.File(path, "r"), source

    def __getitem__(self, i: int) -> dict[str, np.ndarray]:
        _, start, stop = self.source.location(i)
        return {k: self.file[k][start:stop] for k in SIGNALS}


def reader(name: str, source, ids: np.ndarray) -> Contender:
    pos = [0]

    def call():
        i = ids[pos[0] % len(ids)]
        pos[0] += 1
        return source[int(i)]["u"][0, 0]

    return Contender(name, call)


def window_contenders(files, window: int, n_ids: int):
    contiguous, chunked = files
    mm = WindowedSource([contiguous], SIGNALS, window=window, stride=STRIDE, mmap_only=True)
    hp = WindowedSource([chunked], SIGNALS, window=window, stride=STRIDE)
    hc = OpenH5(contiguous, mm)
    assert mm.index.info(0, "u").memmap and not hp.index.info(0, "u").memmap
    t0 = time.perf_counter()
    sl = SliceList(contiguous, mm.lengths[0], window, STRIDE)
    build_s = time.perf_counter() - t0
    assert len(sl.items) == len(mm) == len(hp)
    ids = np.random.default_rng(window).integers(0, len(mm), size=n_ids)
    for i in ids[:5]:  # same windows from all three
        a = mm[int(i)]
        for other in (hp, hc, sl):
            for k in SIGNALS:
                np.testing.assert_array_equal(a[k], other[int(i)][k])
    tag = f"L={window}"
    contenders = [
        reader(f"memmap {tag}", mm, ids),
        reader(f"h5py {tag}", hp, ids),
        reader(f"h5py-contiguous {tag}", hc, ids),
        reader(f"slices {tag}", sl, ids),
    ]
    mem = {
        "windows": len(mm),
        "slices_bytes": sys.getsizeof(sl.items) + sum(sys.getsizeof(t) for t in sl.items),
        "slices_build_s": build_s,
        "source_bytes": sys.getsizeof(mm._ends) + 8 * len(mm._ends),
    }
    return contenders, mem


def write_small_files(folder: str, n_files: int, steps: int) -> tuple[list[str], list[str]]:
    """Small recordings, contiguous and chunked + gzip: ``u [T, 4]``, ``y [T, 2]``."""
    rng = np.random.default_rng(1)
    contiguous, gzipped = [], []
    for i in range(n_files):
        pc, pz = os.path.join(folder, f"small{i}.h5"), os.path.join(folder, f"small{i}_gz.h5")
        with h5py.File(pc, "w") as fc, h5py.File(pz, "w") as fz:
            for name, ch in (("u", 4), ("y", 2)):
                data = rng.normal(size=(steps, ch)).astype(np.float32)
                fc.create_dataset(name, data=data)
                fz.create_dataset(
                    name, data=data, chunks=(min(4096, steps), ch), compression="gzip"
                )
        contiguous.append(pc)
        gzipped.append(pz)
    return contiguous, gzipped


def cache_contenders(files, batch_size: int, window: int, cache_bytes: int, warm: int):
    """Pipelines over the small recordings: memory map, h5py + gzip, h5py + gzip + cache."""
    contiguous, gzipped = files
    sources = {
        "memmap": WindowedSource(contiguous, SIGNALS, window=window, stride=STRIDE),
        "h5py gzip": WindowedSource(gzipped, SIGNALS, window=window, stride=STRIDE),
        "h5py gzip + cache": WindowedSource(
            gzipped, SIGNALS, window=window, stride=STRIDE, cache_bytes=cache_bytes
        ),
    }
    kw = dict(batch_size=batch_size, shuffle=True, seed=0, num_epochs=None,
              drop_remainder=True, read_threads=0, prefetch=0)  # fmt: skip
    contenders, fill_s, firsts = [], {}, {}
    for name, src in sources.items():
        it = iter(pipeline(src, **kw))
        t0 = time.perf_counter()
        firsts[name] = [next(it) for _ in range(warm)]  # fills the cache
        fill_s[name] = time.perf_counter() - t0

        def call(it=it):
            return next(it)["u"][0, 0, 0]

        contenders.append(Contender(f"batch {name}", call))
    for name, batches in firsts.items():  # same batches from all three
        for got, want in zip(batches, firsts["memmap"], strict=True):
            for k in SIGNALS:
                np.testing.assert_array_equal(got[k], want[k], err_msg=name)
    return contenders, fill_s


def gru_step(batch_size: int, window: int):
    """A jitted GRU train step and its state: ``step(params, opt, u, y)``."""
    g = bx.Graph("model")
    rng = bx.Rng(g / "rng")
    gru = bx.GRU(g / "gru", 64, rng)
    head = bx.Linear(g / "head", 2, rng)

    def model(params, u):
        (h, _), params = gru.apply(params, u)
        return head(params, h)

    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, jnp.zeros((batch_size, 2, 4)))
    params = params.locked()
    std = jnp.ones((2,))

    def loss_fn(params, u, y):
        pred, params = model(params, u)
        return bx.normalized_mse(pred, y, std), params

    tx = optax.adam(1e-3)
    step = jax.jit(bx.make_train_step(loss_fn, tx))
    return step, params, tx.init(params.split()[0])


def loader_rates(path: str, worker_counts, n_batches: int, batch_size: int, window: int):
    src = WindowedSource([path], SIGNALS, window=window, stride=STRIDE)
    rates = {}
    for w in worker_counts:
        ds = pipeline(src, batch_size=batch_size, shuffle=True, seed=0, num_epochs=None,
                      drop_remainder=True, num_workers=w)  # fmt: skip
        it = iter(ds)
        try:
            t0 = time.perf_counter()
            for _ in range(max(4, 2 * w)):  # start-up, first batches
                next(it)
            startup = time.perf_counter() - t0
            t0 = time.perf_counter()
            for _ in range(n_batches):
                next(it)
            rates[w] = (n_batches / (time.perf_counter() - t0), startup)
        finally:
            it.close()
        log(f"loader, {w} workers: {rates[w][0]:.0f} batches/s (start-up {rates[w][1]:.1f}s)")
    first = next(iter(pipeline(src, batch_size=batch_size, shuffle=True, seed=0)))
    return rates, first


def step_rate(batch, n_steps: int) -> float:
    b, window = batch["u"].shape[:2]
    step, params, opt = gru_step(b, window)
    u, y = jnp.asarray(batch["u"]), jnp.asarray(batch["y"])
    for _ in range(3):
        params, opt, m = step(params, opt, u, y)
    jax.block_until_ready(m)
    t0 = time.perf_counter()
    for _ in range(n_steps):
        params, opt, m = step(params, opt, u, y)
    jax.block_until_ready(m)
    return n_steps / (time.perf_counter() - t0)


def render(env, command, started, counts, quick, size_mb, pairs, mems, rates, steps_s,
           batch_size, cache) -> str:  # fmt: skip
    lines = [
        "## Data loading: HDF5 windows and the Grain loader",
        "",
        *_timing.run_header(env, started, command),
        f"- Data: one generated recording of {size_mb:.0f} MB (float32 `u [T, 4]`, "
        "`y [T, 2]`), contiguous (memory map) and chunked (16384 rows, no compression: "
        "blox's h5py fallback); also h5py slicing the contiguous file through one open "
        "handle, and the TSFast way (a precomputed list of `(path, start, stop)`, the file "
        f"opened per read); stride {STRIDE}; h5py {h5py.__version__}, grain "
        f"{_timing._version('grain')}.",
        _timing.counts_bullet(counts.rounds, counts.steps, counts.warmup,
                              "interleaved; one random window per call",
                              "tiny file and counts, numbers meaningless" if quick else None),
        "",
        "### Windows per second, random indices",
        "",
    ]  # fmt: skip
    rows = []
    for p in pairs:
        mm_us = p.num_us
        rows.append(
            [
                p.name,
                f"{1e6 / mm_us:,.0f}",
                f"{1e6 / p.den_us:,.0f}",
                f"**{1 / p.median_ratio:.2f}x**",
                "-" if p.target is None else (f">= {1 / p.target:.0f}x " + p.verdict),
            ]
        )
    lines.append(
        _timing.format_table(
            ["memmap vs", "memmap windows/s", "other windows/s", "memmap speed-up", "target"],
            rows,
        )
    )
    lines += [
        "",
        "Speed-up: the median over rounds of the same-round ratio of median per-call times. "
        "Memory for the index: the source keeps one cumulative count per file "
        + ", ".join(
            f"(L={w}: {m['source_bytes']} B for {m['windows']:,} windows; the list of slices "
            f"{m['slices_bytes'] / 1e6:.0f} MB, built in {m['slices_build_s']:.2f}s)"
            for w, m in mems.items()
        )
        + ".",
        "",
        "### Loader vs a GRU train step",
        "",
    ]
    lrows = [
        [f"{w}", f"{r:,.1f}", f"{s:.1f}", f"{r / steps_s:.1f}x"] for w, (r, s) in rates.items()
    ]
    lines.append(
        _timing.format_table(["workers", "batches/s", "start-up s", "loader / GRU steps"], lrows)
    )
    cache_pairs, fill_s, small = cache
    lines += [
        "",
        "### Small compressed recordings: the in-memory cache (`cache_bytes`)",
        "",
        f"{small['files']} recordings of {small['steps']:,} steps (`u [T, 4]`, `y [T, 2]` "
        f"float32, {small['mb']:.1f} MB each uncompressed), chunked (4096 rows) + gzip, "
        f"batch {batch_size} of L = 500 windows, shuffled, read on demand "
        "(`read_threads=0`); the same pipelines on contiguous copies (memory maps) for "
        "reference. All three gave equal batches (asserted before timing).",
        "",
    ]
    crows = [
        [
            p.name,
            f"{1e6 / p.num_us:,.1f}",
            f"{1e6 / p.den_us:,.1f}",
            f"**{1 / p.median_ratio:.2f}x**",
            "-" if p.target is None else (f">= {1 / p.target:.0f}x " + p.verdict),
        ]
        for p in cache_pairs
    ]
    lines.append(
        _timing.format_table(
            ["cached vs", "cached batches/s", "other batches/s", "cache speed-up", "target"],
            crows,
        )
    )
    lines += [
        "",
        "Untimed first batches (the cache fills as recordings are first touched): "
        + ", ".join(f"{k} {v:.2f}s" for k, v in fill_s.items())
        + ". Use `cache_bytes` when compressed or chunked recordings fit in memory (per "
        "process: each worker keeps its own cache); for large data, store it contiguous "
        "(`h5repack -l CONTI`) and let the memory map and the OS page cache do the work.",
    ]
    lines += [
        "",
        f"GRU train step (hidden 64, batch {batch_size}, L = 500, Adam, jitted): "
        f"{steps_s:.1f} steps/s. Above 1x the loader (prefetching in its threads or "
        "workers) produces batches faster than the step consumes them, so the loop does "
        "not wait on data.",
    ]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    COUNTS.add_to(ap, quick_help="tiny file and counts (smoke test)")
    ap.add_argument("--size-mb", type=float, default=None, help="file size (default 200)")
    args = ap.parse_args(argv)
    counts = COUNTS.resolve(ap, args)
    size_mb = args.size_mb or (4.0 if args.quick else 200.0)
    started, env, command = _timing.start_run("blox data speed")
    steps = int(size_mb * 1e6 / 24)
    windows = (500, 5000)
    batch_size = 32
    with tempfile.TemporaryDirectory() as folder:
        t0 = time.perf_counter()
        files = write_files(folder, steps)
        mb = os.path.getsize(files[0]) / 1e6
        log(f"wrote 2 x {mb:.0f} MB in {time.perf_counter() - t0:.1f}s")
        contenders, pairs, mems = [], [], {}
        for w in windows:
            cs, mems[w] = window_contenders(files, w, counts.steps + counts.warmup)
            contenders += cs
            target = TARGET if w == 500 else None
            pairs.append(Pair(f"L={w} vs h5py, chunked file", cs[0].name, cs[1].name, target))
            pairs.append(Pair(f"L={w} vs h5py, same file", cs[0].name, cs[2].name, target))
            pairs.append(Pair(f"L={w} vs list of slices", cs[0].name, cs[3].name, None))
        results = _timing.run_rounds(contenders, counts.rounds, counts.steps, counts.warmup)
        for p in _timing.compare(results, pairs):
            log(f"{p.name}: {p.num_us:.1f} vs {p.den_us:.1f} us/window, speed-up "
                f"{1 / p.median_ratio:.2f}x {p.verdict}")  # fmt: skip
        n_small, small_steps = (3, 3000) if args.quick else (16, 40_000)
        small_files = write_small_files(folder, n_small, small_steps)
        ccs, fill_s = cache_contenders(small_files, batch_size, 500, 64 << 20, 4)
        for name, s in fill_s.items():
            log(f"{name}: first 4 batches {s:.2f}s")
        cache_steps = counts.steps // 4 if not args.quick else counts.steps
        cache_results = _timing.run_rounds(ccs, counts.rounds, max(cache_steps, 1), 2)
        cache_pairs = _timing.compare(
            cache_results,
            [
                Pair("cache vs h5py gzip", ccs[2].name, ccs[1].name, CACHE_TARGET),
                Pair("cache vs memmap", ccs[2].name, ccs[0].name, None),
            ],
        )
        for p in cache_pairs:
            log(f"{p.name}: {1e6 / p.num_us:.1f} vs {1e6 / p.den_us:.1f} batches/s, "
                f"speed-up {1 / p.median_ratio:.2f}x {p.verdict}")  # fmt: skip
        small = {"files": n_small, "steps": small_steps, "mb": small_steps * 24 / 1e6}
        workers = (0,) if args.quick else (0, 1, 2)
        n_batches = 5 if args.quick else 100
        rates, batch = loader_rates(files[0], workers, n_batches, batch_size, 500)
        steps_s = step_rate(batch, 3 if args.quick else 20)
        log(f"GRU train step: {steps_s:.1f} steps/s")
    report = render(env, command, started, counts, args.quick, size_mb, pairs, mems, rates,
                    steps_s, batch_size, (cache_pairs, fill_s, small))  # fmt: skip
    _timing.publish(report, args.out, "data_speed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
