"""Checksums of every dtype and verified casts.

References: the checksum as documented (32-bit little-endian words of the raw bytes, each
mixed with its flat word index, summed modulo 2**32), computed here with Python integers
from ``ndarray.tobytes()``; the saved arrays themselves (bit equality); NumPy's
``astype`` for a cast; data files damaged on purpose.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from blox import ckpt
from blox.ckpt import _checksum
from tests.ckpt._common import flip_bytes, tree_equal

_K1, _K2, _K3 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_M = 2**32


def _reference(a: np.ndarray) -> str:
    """The documented checksum with Python integers: the element bits as 32-bit words
    (64-bit types: two, low first; complex: real then imaginary; narrower types and bool:
    one, zero-extended, sub-byte types their low bits), mixed with the word index."""
    raw = np.ascontiguousarray(a).tobytes()
    size = a.dtype.itemsize
    bits = jax.dtypes.itemsize_bits(a.dtype)
    if size >= 4:
        words = [int.from_bytes(raw[k : k + 4], "little") for k in range(0, len(raw), 4)]
    else:
        words = [int.from_bytes(raw[k : k + size], "little") for k in range(0, len(raw), size)]
        if bits < 8:
            words = [w & ((1 << bits) - 1) for w in words]
    h1 = h2 = 0
    for i, w in enumerate(words):
        h1 = (h1 + w * (2 * i + 1)) % _M
        h2 = (h2 + ((w ^ (i * _K1 % _M)) * _K2 + i * _K3)) % _M
    return f"{h1:08x}-{h2:08x}"


DTYPES = [
    "float64", "int64", "uint64", "complex128", "complex64", "bool", "bfloat16", "float16",
    "float32", "int32", "uint16", "int8", "uint8", "float8_e4m3fn", "int4",
]  # fmt: skip


def _values(dtype: str, shape=(3, 5)) -> np.ndarray:
    rs = np.random.default_rng(abs(hash(dtype)) % 1000)
    x = rs.standard_normal(shape) * 50
    if dtype.startswith("complex"):
        x = x + 1j * rs.standard_normal(shape) * 1e30
    if dtype == "bool":
        return x > 0
    if dtype.startswith("uint"):
        x = np.abs(x)
    if dtype == "uint64":
        return np.asarray(x, np.uint64) + np.uint64(2**63)  # the high word in use
    if dtype == "int64":
        return np.asarray(x * 2**40, np.int64)
    return (
        np.asarray(jnp.asarray(x, dtype))
        if dtype in ("bfloat16", "int4")
        else x.astype(jnp.dtype(dtype))
    )


def test_every_dtype_is_summed_on_the_host_and_on_the_device_as_documented():
    with jax.enable_x64(True):
        arrays = [_values(d) for d in DTYPES]
        device = _checksum._device_sums([jnp.asarray(a) for a in arrays])
        for dtype, a, d in zip(DTYPES, arrays, device, strict=True):
            assert a.dtype == jnp.dtype(dtype), dtype
            want = _reference(a)
            assert _checksum.host_checksum(a) == want, dtype
            h1, h2 = (int(v) for v in np.asarray(d))
            assert f"{h1:08x}-{h2:08x}" == want, dtype
    # Python numbers are summed as the NumPy scalars Orbax stores them as.
    assert _checksum.host_checksum(7) == _reference(np.asarray(7, np.int64))
    assert _checksum.host_checksum(0.1) == _reference(np.asarray(0.1, np.float64))
    assert _checksum.host_checksum(True) == _reference(np.asarray(True))
    # One flipped bit of a 64-bit element's high word changes the sum.
    a = np.arange(4, dtype=np.float64)
    b = a.copy()
    b.view(np.uint32)[3] ^= 1 << 20  # element 1, high word
    assert _checksum.host_checksum(a) != _checksum.host_checksum(b)


def _x64_state(big: str):
    """A state of 64-bit (and other) leaves; the leaf `big` is a 32 x 32 random array of
    its dtype: incompressible, the largest data chunk on disk."""
    rs = np.random.default_rng(0)

    def values(dtype, n):
        if dtype == "float64":
            return rs.standard_normal(n)
        if dtype == "int64":
            return rs.integers(-(2**62), 2**62, n)
        if dtype == "uint64":
            return rs.integers(0, 2**63, n, dtype=np.uint64) * np.uint64(2)
        return rs.standard_normal(n) + 1j * rs.standard_normal(n)  # complex128

    state = {
        d: jnp.asarray(values(d, (32, 32) if d == big else 3), d)
        for d in ("float64", "int64", "uint64", "complex128")
    }
    state.update(
        mask=jnp.asarray(rs.standard_normal(5) > 0),
        half=jnp.asarray(rs.standard_normal(5), jnp.bfloat16),
        host=rs.standard_normal(4),  # a NumPy float64 leaf
        step=3,
        lr=0.125,
    )
    return state


@pytest.mark.parametrize("big", ["float64", "int64", "uint64", "complex128"])
def test_x64_state_round_trips_and_a_corrupted_64_bit_leaf_is_caught(tmp_path, big):
    with jax.enable_x64(True):
        state = _x64_state(big)
        with ckpt.CheckpointManager(tmp_path) as mngr:
            mngr.save(3, state)
        mngr = ckpt.CheckpointManager(tmp_path)
        leaves = mngr.description()["leaves"]
        assert all("checksum" in e for e in leaves.values()), leaves  # every leaf summed
        tree_equal(mngr.restore(_x64_state(big)), state)
        flip_bytes(tmp_path, 3)
        with pytest.raises(ckpt.CheckpointError, match=rf"step 3 is corrupted.*: {big}\.") as e:
            mngr.restore(_x64_state(big))
        assert e.value.leaves == [big]


def _f32_state(seed=0):
    rs = np.random.default_rng(seed)
    return {"w": jnp.asarray(rs.standard_normal((32, 32)), jnp.float32), "step": 1}


def test_cast_restore_verifies_the_saved_dtype_then_casts(tmp_path):
    state = _f32_state()
    with ckpt.CheckpointManager(tmp_path) as mngr:
        mngr.save(1, state)
    mngr = ckpt.CheckpointManager(tmp_path)
    mesh = jax.make_mesh((8,), ("data",))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    target = {
        "w": jax.ShapeDtypeStruct((32, 32), jnp.bfloat16, sharding=sharding),
        "step": jax.ShapeDtypeStruct((), jnp.int32),  # a Python int saved: an array here
    }
    out = mngr.restore(target, allow_dtype_cast=True)
    assert out["w"].dtype == jnp.bfloat16 and out["w"].sharding == sharding
    want = np.asarray(state["w"]).astype(jnp.bfloat16)
    assert np.asarray(out["w"]).tobytes() == want.tobytes()
    assert out["step"].dtype == jnp.int32 and int(out["step"]) == 1
    # Into NumPy and Python-number targets too.
    out = mngr.restore({"w": np.zeros((32, 32), np.float16), "step": 0.0}, allow_dtype_cast=True)
    assert out["w"].dtype == np.float16 and type(out["step"]) is float and out["step"] == 1.0
    np.testing.assert_array_equal(out["w"], np.asarray(state["w"]).astype(np.float16))
    # A corrupted leaf restored with a cast raises, in every target dtype.
    flip_bytes(tmp_path, 1)
    for dtype in (jnp.bfloat16, jnp.float16, jnp.float32):
        with pytest.raises(ckpt.CheckpointError, match=r"step 1 is corrupted.*: w\."):
            mngr.restore({"w": jnp.zeros((32, 32), dtype), "step": 0}, allow_dtype_cast=True)
