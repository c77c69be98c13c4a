"""Per-leaf checksums of a train state, computed on the devices where the arrays live.

Orbax (TensorStore OCDBT) checks its b-tree nodes with CRC-32C but not the array chunks:
flipped bytes in a data file restore as wrong values without an error. So `save` stores a
checksum of every leaf (arrays of every dtype, and Python numbers) next to the
description, inside the step Orbax commits, and `restore` recomputes it on the restored
values and compares.

The checksum is a function of the logical values only (never of the layout), so a state
saved on one mesh and restored onto another gives the same numbers: the bits of each
element, as 32-bit words (one per element up to 32 bits, zero-extended; two for 64-bit
types, low word first; complex: the real part's words, then the imaginary part's; bool:
0 or 1), are mixed with the word's flat index by two different bijections and summed
modulo 2**32. Integer addition is exact and associative, so any sharding (and any
reduction order) gives the same sums. One changed word always changes both sums; several
changes would have to cancel in both at once. Up to 32 bits a word is an element, so the
sums of those dtypes are the ones earlier versions wrote.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__: list[str] = []

# Leaves up to this size are summed on the host: copying them costs less than compiling
# the device program (which happens once per state layout, during the first save).
HOST_BYTES = 2**20

_K1, _K2, _K3 = 0x9E3779B1, 0x85EBCA6B, 0xC2B2AE35
_UNSIGNED = {2: jnp.uint2, 4: jnp.uint4, 8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}
_NP_UNSIGNED = {1: np.uint8, 2: np.uint16, 4: np.uint32}
# Python numbers are summed as these NumPy scalars (what Orbax stores them as).
PY_DTYPES = {"bool": np.bool_, "int": np.int64, "float": np.float64}


def _bits_of(dtype: Any) -> int:
    return int(jax.dtypes.itemsize_bits(np.dtype(dtype)))


def _on_device(dtype: np.dtype) -> bool:
    """Whether the device program handles `dtype` (every JAX dtype: bool, integers and
    floats of 2 to 64 bits, complex); anything else is summed on the host by its bytes."""
    if dtype == np.bool_:
        return True
    if jax.dtypes.issubdtype(dtype, jnp.complexfloating):
        return dtype.itemsize in (8, 16)
    if jax.dtypes.issubdtype(dtype, jnp.integer) or jax.dtypes.issubdtype(dtype, jnp.floating):
        return _bits_of(dtype) in (*_UNSIGNED, 64)
    return False


def _device_words(x: jax.Array) -> jax.Array:
    """The element bits as uint32 words: one per element for up to 32 bits (bool -> 0/1,
    narrower types zero-extended), two for 64 bits (low word first, as in memory), the
    real part's words then the imaginary part's for complex: shape ``x.shape`` or
    ``x.shape + (k,)``."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    if jnp.issubdtype(x.dtype, jnp.complexfloating):
        re, im = _device_words(jnp.real(x)), _device_words(jnp.imag(x))
        if re.ndim == x.ndim:  # complex64: one word per part
            re, im = re[..., None], im[..., None]
        return jnp.concatenate([re, im], axis=-1)
    bits = _bits_of(x.dtype)
    if bits == 64:
        return jax.lax.bitcast_convert_type(x, jnp.uint32)  # (..., 2): low, high
    return jax.lax.bitcast_convert_type(x, _UNSIGNED[bits]).astype(jnp.uint32)


def _host_words(x: np.ndarray) -> np.ndarray:
    """`_device_words` in NumPy, flattened (row-major, the words of an element in a row);
    any other dtype: its bytes, one word each."""
    x = np.ascontiguousarray(x)
    dtype = x.dtype
    if dtype == np.bool_:
        return x.reshape(-1).astype(np.uint32)
    if not _on_device(dtype):
        return x.reshape(-1).view(np.uint8).astype(np.uint32)
    if dtype.kind == "c":
        x = x.reshape(-1).view(np.float32 if dtype.itemsize == 8 else np.float64)
        dtype = x.dtype
    bits = _bits_of(dtype)
    if bits == 64:
        return x.reshape(-1).view(np.uint32)
    words = x.reshape(-1).view(_NP_UNSIGNED[dtype.itemsize]).astype(np.uint32)
    if bits < 8:  # sub-byte types: the value's bits (a byte holds one element)
        words &= np.uint32((1 << bits) - 1)
    return words


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """The row-major flat index of every element (uint32, wrapping), without a reshape."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _sums(x: jax.Array) -> jax.Array:
    b = _device_words(x)
    i = _flat_index(b.shape)  # the index of each word
    h1 = b * (i * np.uint32(2) + np.uint32(1))  # odd multiplier: a bijection of b
    h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
    return jnp.stack([jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)])


@jax.jit
def _device_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_sums(x) for x in leaves]


def _host_sums(x: Any) -> tuple[int, int]:
    b = _host_words(np.asarray(x))
    i = np.arange(b.size, dtype=np.uint64).astype(np.uint32)
    with np.errstate(over="ignore"):
        h1 = b * (i * np.uint32(2) + np.uint32(1))
        h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
        return int(h1.sum(dtype=np.uint32)), int(h2.sum(dtype=np.uint32))


def host_checksum(x: Any) -> str:
    """The checksum of a NumPy array (or a Python number, as `PY_DTYPES`), on the host."""
    if isinstance(x, (bool, int, float)):
        x = np.asarray(x, PY_DTYPES[type(x).__name__])
    a, b = _host_sums(np.asarray(x))
    return f"{a:08x}-{b:08x}"


def _replicated_value(x: jax.Array) -> np.ndarray:
    """A (replicated) result as NumPy, also when it spans several processes."""
    if x.is_fully_addressable:
        return np.asarray(x)
    return np.asarray(x.addressable_data(0))


class PendingChecksums:
    """Checksums being computed: the host ones are done, the device ones dispatched."""

    def __init__(self, done: dict[str, str], names: list[str], sums: list[jax.Array]):
        self.done, self.names, self.sums = done, names, sums

    def ready(self) -> bool:
        """Whether every device result is computed (never blocks)."""
        return all(s.is_ready() for s in self.sums)

    def result(self) -> dict[str, str]:
        """``{name: 'xxxxxxxx-xxxxxxxx'}`` (blocks until the device sums are computed)."""
        out = dict(self.done)
        for name, s in zip(self.names, self.sums, strict=True):
            a, b = (int(v) for v in _replicated_value(s))
            out[name] = f"{a:08x}-{b:08x}"
        return out


def start_checksums(named_leaves: dict[str, Any]) -> PendingChecksums:
    """Starts the checksums of every leaf: arrays of any dtype and Python numbers.

    Large jax arrays are summed on their devices (one jitted call for all of them, the
    result replicated), asynchronously: the call returns once the program is dispatched
    (compiled on the first call for a state layout). Small ones (up to `HOST_BYTES`, when
    one process holds all of their values), NumPy arrays and Python numbers (as
    `PY_DTYPES`) are summed on the host now, with the same arithmetic.
    """
    done: dict[str, str] = {}
    device_names, device_leaves = [], []
    for name, leaf in named_leaves.items():
        if isinstance(leaf, (bool, int, float)):
            done[name] = host_checksum(leaf)
        elif isinstance(leaf, jax.Array):
            one_host = leaf.is_fully_addressable or leaf.is_fully_replicated
            if (leaf.nbytes <= HOST_BYTES and one_host) or not _on_device(np.dtype(leaf.dtype)):
                # Small: copied and summed on the host, no program to compile.
                host = leaf if leaf.is_fully_addressable else leaf.addressable_data(0)
                done[name] = host_checksum(np.asarray(host))
            else:
                device_names.append(name)
                device_leaves.append(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            done[name] = host_checksum(np.asarray(leaf))
    sums = list(_device_sums(device_leaves)) if device_leaves else []
    return PendingChecksums(done, device_names, sums)


def checksums(named_leaves: dict[str, Any]) -> dict[str, str]:
    """``{name: 'xxxxxxxx-xxxxxxxx'}`` for every array leaf and Python number (see
    `start_checksums`), computed now."""
    return start_checksums(named_leaves).result()
