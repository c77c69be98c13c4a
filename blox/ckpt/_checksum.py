"""Per-leaf checksums of a train state, computed on the devices where the arrays live.

Orbax (TensorStore OCDBT) checks its b-tree nodes with CRC-32C but not the array chunks:
flipped bytes in a data file restore as wrong values without an error. So `save` stores a
checksum of every array leaf in the description, and `restore` recomputes it on the
restored arrays and compares.

The checksum is a function of the logical values only (never of the layout), so a state
saved on one mesh and restored onto another gives the same numbers: the bits of each
element (viewed as unsigned integers) are mixed with the element's flat index by two
different bijections and summed modulo 2**32. Integer addition is exact and associative,
so any sharding (and any reduction order) gives the same sums. One changed element always
changes both sums; several changes would have to cancel in both at once.
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
_UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32}


def _supported(dtype: Any) -> bool:
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return True
    return dtype.kind in "iuf" and dtype.itemsize in _UINT or _is_low_float(dtype)


def _is_low_float(dtype: np.dtype) -> bool:
    return jax.dtypes.issubdtype(dtype, jnp.floating) and dtype.itemsize in _UINT


def _bits(x: jax.Array) -> jax.Array:
    """The element bits as uint32 (bool -> 0/1, 8/16-bit types zero-extended)."""
    if x.dtype == jnp.bool_:
        return x.astype(jnp.uint32)
    u = jax.lax.bitcast_convert_type(x, _UINT[x.dtype.itemsize])
    return u.astype(jnp.uint32)


def _flat_index(shape: tuple[int, ...]) -> jax.Array:
    """The row-major flat index of every element (uint32, wrapping), without a reshape."""
    index = jnp.zeros(shape, jnp.uint32)
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        index = index + jax.lax.broadcasted_iota(jnp.uint32, shape, dim) * np.uint32(stride % 2**32)
        stride *= shape[dim]
    return index


def _sums(x: jax.Array) -> jax.Array:
    b = _bits(x)
    i = _flat_index(x.shape)
    h1 = b * (i * np.uint32(2) + np.uint32(1))  # odd multiplier: a bijection of b
    h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
    return jnp.stack([jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)])


@jax.jit
def _device_sums(leaves: list[jax.Array]) -> list[jax.Array]:
    return [_sums(x) for x in leaves]


def _host_sums(x: np.ndarray) -> tuple[int, int]:
    x = np.asarray(x)
    if x.dtype == np.bool_:
        b = x.astype(np.uint32)
    else:
        b = x.view(_UINT[x.dtype.itemsize]).astype(np.uint32)
    i = np.arange(x.size, dtype=np.uint64).astype(np.uint32).reshape(x.shape)
    with np.errstate(over="ignore"):
        h1 = b * (i * np.uint32(2) + np.uint32(1))
        h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
        return int(h1.sum(dtype=np.uint32)), int(h2.sum(dtype=np.uint32))


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
    """Starts the checksums of every array leaf whose dtype is supported.

    Large jax arrays are summed on their devices (one jitted call for all of them, the
    result replicated), asynchronously: the call returns once the program is dispatched
    (compiled on the first call for a state layout). Small ones (up to `HOST_BYTES`, when
    one process holds all of their values) and NumPy arrays are summed on the host now,
    with the same arithmetic. Python numbers and other dtypes are skipped.
    """
    done: dict[str, str] = {}
    device_names, device_leaves = [], []
    for name, leaf in named_leaves.items():
        dtype = getattr(leaf, "dtype", None)
        if dtype is None or getattr(leaf, "shape", None) is None or not _supported(dtype):
            continue
        if isinstance(leaf, jax.Array):
            if leaf.nbytes <= HOST_BYTES and (
                leaf.is_fully_addressable or leaf.is_fully_replicated
            ):
                # Small: copied and summed on the host, no program to compile.
                host = leaf if leaf.is_fully_addressable else leaf.addressable_data(0)
                a, b = _host_sums(np.asarray(host))
                done[name] = f"{a:08x}-{b:08x}"
            else:
                device_names.append(name)
                device_leaves.append(leaf)
        elif isinstance(leaf, (np.ndarray, np.generic)):
            a, b = _host_sums(np.asarray(leaf))
            done[name] = f"{a:08x}-{b:08x}"
    sums = list(_device_sums(device_leaves)) if device_leaves else []
    return PendingChecksums(done, device_names, sums)


def checksums(named_leaves: dict[str, Any]) -> dict[str, str]:
    """``{name: 'xxxxxxxx-xxxxxxxx'}`` for every supported array leaf (see
    `start_checksums`), computed now."""
    return start_checksums(named_leaves).result()
