"""A tiny model and train state shared by the checkpoint tests."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx


def build(hidden: int = 8, *, sharded: bool = False):
    """An MLP with dropout: (graph, rng, model); optional TP-style sharding metadata."""
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    meta = {"sharding": (None, "model")} if sharded else None
    model = bx.Sequential(
        graph.child("body"),
        [
            bx.Linear(graph.child("fc1"), hidden, rng, kernel_metadata=meta),
            jax.nn.gelu,
            bx.Dropout(graph.child("drop"), 0.25, rng),
            bx.Linear(graph.child("head"), 2, rng),
        ],
    )
    return graph, rng, model


def init(seed: int = 0, hidden: int = 8, *, sharded: bool = False):
    """Locked params and the model."""
    _, rng, model = build(hidden, sharded=sharded)
    params = rng.seed(bx.Params(), seed=seed)
    _, params = model(params, jnp.zeros((2, 4)), is_training=False)
    return params.locked(), model


def batch(i: int, n: int = 8) -> tuple[np.ndarray, np.ndarray]:
    rs = np.random.default_rng(1000 + i)
    x = rs.standard_normal((n, 4)).astype(np.float32)
    return x, np.stack([np.sin(x[:, 0]), x[:, 1] * x[:, 2]], axis=1).astype(np.float32)


def make_step(model, tx):
    def loss_fn(params, x, y):
        pred, params = model(params, x, is_training=True)
        return bx.mse(pred, y), params

    return jax.jit(bx.make_train_step(loss_fn, tx))


def tree_equal(a, b) -> None:
    """Same structure (paths, trainable flags, metadata, lock), same dtypes, same bits."""
    sa, sb = jax.tree.structure(a), jax.tree.structure(b)
    assert sa == sb, (sa, sb)
    for (path, x), y in zip(
        jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b), strict=True
    ):
        name = jax.tree_util.keystr(path)
        assert type(x) is type(y) or (isinstance(x, jax.Array) and isinstance(y, jax.Array)), (
            name,
            type(x),
            type(y),
        )
        xa, ya = np.asarray(x), np.asarray(y)
        assert xa.dtype == ya.dtype, (name, xa.dtype, ya.dtype)
        assert xa.shape == ya.shape, (name, xa.shape, ya.shape)
        assert xa.tobytes() == ya.tobytes(), name


def data_files(directory, step: int) -> list:
    """The OCDBT data files of a step, largest first (an incompressible array of a few KB
    that is larger than the rest of the state gets the largest one)."""
    from pathlib import Path

    files = list(Path(directory, str(step), "state").glob("ocdbt.process_*/d/*"))
    return sorted(files, key=lambda f: f.stat().st_size, reverse=True)


def flip_bytes(directory, step: int, count: int = 64) -> None:
    """Flips `count` bytes in the middle of the step's largest data file (a disk error)."""
    biggest = data_files(directory, step)[0]
    data = bytearray(biggest.read_bytes())
    middle = len(data) // 2
    for i in range(middle, middle + count):
        data[i] ^= 0xFF
    biggest.write_bytes(bytes(data))


__all__ = [
    "build",
    "init",
    "batch",
    "make_step",
    "tree_equal",
    "data_files",
    "flip_bytes",
    "jnp",
    "optax",
]
