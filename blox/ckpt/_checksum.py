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

A save never waits for the sums (`Checksummer`). On CPU devices every save keeps a NumPy
view of each leaf (no copy, no program in the caller) and the commit thread sums the views,
shard by shard, with a small compiled program per block shape. On accelerators the first
save of a state layout copies each leaf asynchronously to host memory (summed the same way
in the commit thread) while a program summing every leaf compiles in a background thread;
later saves dispatch that program, one for all leaves, and the commit thread reads the
results.
"""

from __future__ import annotations

import functools
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__: list[str] = []

# On restore, leaves up to this size are summed on the host: copying them costs less than
# compiling the device program.
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


def _mix(b: np.ndarray, i: np.ndarray) -> tuple[int, int]:
    """The two sums (modulo 2**32) of the words `b` at the flat word indices `i`."""
    with np.errstate(over="ignore"):
        h1 = b * (i * np.uint32(2) + np.uint32(1))
        h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
        return int(h1.sum(dtype=np.uint32)), int(h2.sum(dtype=np.uint32))


def _host_sums(x: Any) -> tuple[int, int]:
    b = _host_words(np.asarray(x))
    return _mix(b, np.arange(b.size, dtype=np.uint64).astype(np.uint32))


def _word_view(x: np.ndarray) -> tuple[np.ndarray, int]:
    """The element bits of `x` as unsigned integers, without a copy when `x` is
    contiguous: shape ``x.shape + (k,)``, the ``k`` words of an element in the order of
    `_device_words` (uint8/uint16 ones widen to 32 bits in `_block_sums`); and the bits of
    a type narrower than its byte (0: every bit counts)."""
    x = np.ascontiguousarray(x)
    if x.dtype == np.bool_:
        return x.view(np.uint8)[..., None], 0
    y = x[..., None]
    if x.dtype.kind == "c":  # the real part, then the imaginary part
        y = y.view(np.float32 if x.dtype.itemsize == 8 else np.float64)
    bits = _bits_of(y.dtype)
    if bits == 64:
        return y.view(np.uint32), 0  # two words, the low one first
    return y.view(_NP_UNSIGNED[y.dtype.itemsize]), (bits if bits < 8 else 0)


@functools.partial(jax.jit, static_argnames=("shape", "bits"))
def _block_sums(words: jax.Array, starts: jax.Array, shape: tuple, bits: int) -> jax.Array:
    """`_sums` of the block of an array of `shape` whose first element sits at `starts`
    (uint32, one per dimension), from its `_word_view`: its words at their flat word
    indices in the whole array (the sums of the blocks of a tiling add up, modulo 2**32,
    to the array's). Only unsigned integers of up to 32 bits come in, so the program is
    the same whatever the caller's x64 setting."""
    b = words.astype(jnp.uint32)
    if bits:
        b = b & np.uint32((1 << bits) - 1)
    index = jnp.zeros(b.shape, jnp.uint32)  # the element's flat index in the whole array
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        at = jax.lax.broadcasted_iota(jnp.uint32, b.shape, dim) + starts[dim]
        index = index + at * np.uint32(stride % 2**32)
        stride *= shape[dim]
    k = b.shape[-1]
    i = index * np.uint32(k) + jax.lax.broadcasted_iota(jnp.uint32, b.shape, b.ndim - 1)
    h1 = b * (i * np.uint32(2) + np.uint32(1))
    h2 = (b ^ (i * np.uint32(_K1))) * np.uint32(_K2) + (i * np.uint32(_K3))
    return jnp.stack([jnp.sum(h1, dtype=jnp.uint32), jnp.sum(h2, dtype=jnp.uint32)])


def _part_sums(
    part: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """The sums of the block `part` (host memory) of an array of `shape` whose first
    element sits at `starts`: its words at their flat word indices in the whole array
    (the sums of the blocks of a tiling add up, modulo 2**32, to the array's). Blocks up
    to `HOST_BYTES` with NumPy, larger ones on a CPU device (`_block_sums`: one fused
    pass, compiled once per block shape)."""
    if part.size == 0:
        return 0, 0
    if part.nbytes <= HOST_BYTES:
        return _numpy_part_sums(part, starts, shape)
    words, bits = _word_view(np.asarray(part))
    cpu = jax.local_devices(backend="cpu")[0]
    at = np.asarray(starts, np.uint32).reshape(len(shape))
    a, b = _block_sums(jax.device_put(words, cpu), jax.device_put(at, cpu), tuple(shape), bits)
    return int(a), int(b)


def _numpy_part_sums(
    part: np.ndarray, starts: tuple[int, ...], shape: tuple[int, ...]
) -> tuple[int, int]:
    """`_part_sums` with NumPy (its temporaries are several times the block's size)."""
    b = _host_words(part)
    words = b.size // part.size  # per element
    index = np.zeros(part.shape, np.uint64)  # the element's flat index in the whole array
    stride = 1
    for dim in range(len(shape) - 1, -1, -1):
        at = np.arange(part.shape[dim], dtype=np.uint64) + np.uint64(starts[dim])
        view = [1] * len(shape)
        view[dim] = -1
        index += at.reshape(view) * np.uint64(stride % 2**64)
        stride *= shape[dim]
    i = index.reshape(-1, 1) * np.uint64(words) + np.arange(words, dtype=np.uint64)
    return _mix(b, i.reshape(-1).astype(np.uint32))  # wraps modulo 2**32, as on the device


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


class _Snapshot:
    """A leaf's values in host memory, one block per distinct shard, that outlive the
    leaf being donated: on CPU a NumPy view of the buffer (JAX does not donate a buffer
    while a view of it lives, so nothing is copied), elsewhere a copy into host memory,
    started asynchronously."""

    def __init__(self, x: jax.Array):
        self.shape, self.dtype = tuple(x.shape), np.dtype(x.dtype)
        if len(x.sharding.device_set) == 1:
            blocks = [((0,) * x.ndim, x)]
        elif x.is_fully_replicated:  # one copy of the whole array
            blocks = [((0,) * x.ndim, x.addressable_data(0))]
        else:
            blocks = [
                (tuple(sl.indices(n)[0] for sl, n in zip(s.index, x.shape, strict=True)), s.data)
                for s in x.addressable_shards
                if s.replica_id == 0
            ]
        self.parts: list[tuple[tuple[int, ...], Any]] = []
        for starts, data in blocks:
            device = next(iter(data.devices()))
            if device.platform == "cpu":
                self.parts.append((starts, np.asarray(data)))
                continue
            host = jax.sharding.SingleDeviceSharding(device, memory_kind=_host_memory(device))
            self.parts.append((starts, jax.device_put(data, host, may_alias=False)))

    def checksum(self) -> str:
        a = b = 0
        for starts, part in self.parts:
            pa, pb = _part_sums(np.asarray(part), starts, self.shape)
            a, b = (a + pa) % 2**32, (b + pb) % 2**32
        return f"{a:08x}-{b:08x}"


def _host_memory(device: Any) -> str | None:
    """The host memory kind a device can copy into asynchronously (None: none; CPU
    devices need none)."""
    if device.platform == "cpu":
        return "device"
    kinds = {m.kind for m in device.addressable_memories()}
    return next((k for k in ("pinned_host", "unpinned_host") if k in kinds), None)


class PendingChecksums:
    """Checksums being computed: the host ones are done, the device ones dispatched, the
    snapshots' copies to host memory under way."""

    def __init__(
        self,
        done: dict[str, str],
        names: list[str] = (),  # type: ignore[assignment]
        sums: list[jax.Array] = (),  # type: ignore[assignment]
        snapshots: dict[str, _Snapshot] | None = None,
        then: Callable[[], None] | None = None,
    ):
        self.done, self.names, self.sums = done, list(names), list(sums)
        self.snapshots = snapshots or {}
        self.then = then  # run by `result` once done (in the thread that asks)

    def result(self) -> dict[str, str]:
        """``{name: 'xxxxxxxx-xxxxxxxx'}`` (blocks until the device sums are computed and
        sums the snapshots)."""
        out = dict(self.done)
        for name, s in zip(self.names, self.sums, strict=True):
            a, b = (int(v) for v in _replicated_value(s))
            out[name] = f"{a:08x}-{b:08x}"
        for name, snapshot in self.snapshots.items():
            out[name] = snapshot.checksum()
        self.snapshots = {}  # frees the host copies
        if self.then is not None:
            self.then, then = None, self.then
            then()
        return out


class Checksummer:
    """Starts the checksums of the states a `CheckpointManager` saves, without making the
    caller wait for a copy or a compilation.

    On CPU devices every save takes a NumPy view of each leaf (one replica of each shard;
    see `_Snapshot`) and the commit thread sums the views (`_part_sums`): the caller
    neither copies nor dispatches. On accelerators, per state layout (the leaves' shapes,
    dtypes and shardings) one program sums every array leaf (one per set of devices, when
    leaves are committed to different ones). It is compiled in a background thread
    started by the first save of that layout. A save whose program is compiled
    dispatches it (asynchronous; the commit thread reads the results); until then (the
    first save) each leaf is copied asynchronously to host memory and the commit thread
    sums the copies. Both are safe against the arrays being donated right after `save`.
    When the leaves
    span several processes (each holds part of them) the program is compiled and
    dispatched by the caller, so that every process runs it in the same order; such a
    run's first save waits for the compilation.
    """

    def __init__(self) -> None:
        self._compiled: dict[Any, Future] = {}  # layout -> done once the program is compiled
        self._lock = threading.Lock()

    def start(self, named_leaves: dict[str, Any]) -> PendingChecksums:
        """Starts the checksums of every leaf: arrays of any dtype and Python numbers."""
        done: dict[str, str] = {}
        arrays: dict[str, jax.Array] = {}
        for name, leaf in named_leaves.items():
            if isinstance(leaf, jax.Array) and _on_device(np.dtype(leaf.dtype)):
                arrays[name] = leaf
            elif isinstance(leaf, jax.Array):  # no such JAX dtype today
                done[name] = host_checksum(np.asarray(_replicated_value(leaf)))
            elif isinstance(leaf, (bool, int, float, np.ndarray, np.generic)):
                done[name] = host_checksum(leaf)
        groups = _by_devices(arrays)
        keys = [tuple((jax.typeof(x), x.sharding if x.committed else None) for x in g.values())
                for g in groups]  # fmt: skip
        if not all(x.is_fully_addressable for x in arrays.values()) or not all(
            _host_memory(d) for x in arrays.values() for d in x.devices()
        ):
            return _dispatch(done, groups)  # compiles here, in the same order everywhere
        snapshots = {name: _Snapshot(x) for name, x in arrays.items()}
        if _views_only(arrays):  # nothing to copy: no program either (see `_Snapshot`)
            return PendingChecksums(done, snapshots=snapshots)
        compiled = [self._compiled.get(k) for k in keys]
        if all(c is not None and c.done() and c.exception() is None for c in compiled):
            return _dispatch(done, groups)
        todo = [k for k, c in zip(keys, compiled, strict=True) if c is None]
        # The compilation starts once the sums are done, from the thread that waited for
        # them (Orbax's commit thread), so that the caller does not start a thread.
        config = _config()
        then = (lambda: self._compile(todo, config)) if todo else None
        return PendingChecksums(done, snapshots=snapshots, then=then)

    def _compile(self, keys: list[Any], config: tuple[bool, str]) -> None:
        with self._lock:
            for key in keys:
                if key not in self._compiled:
                    self._compiled[key] = _compile_in_background(key, config)

    def wait(self) -> None:
        """Waits for the programs being compiled (a failed compilation is not an error:
        saves of that layout keep summing snapshots)."""
        with self._lock:
            compiling = list(self._compiled.values())
        for compiled in compiling:
            compiled.exception()


def _views_only(arrays: dict[str, jax.Array]) -> bool:
    """Whether every leaf lives on CPU devices, where a snapshot is a view of the buffer
    (no copy), so that every save takes snapshots and dispatches nothing: a dispatch on
    CPU costs the caller more than a view."""
    return all(d.platform == "cpu" for x in arrays.values() for d in x.devices())


def _by_devices(arrays: dict[str, jax.Array]) -> list[dict[str, jax.Array]]:
    """The leaves grouped by the devices they are committed to; uncommitted ones (which a
    program may move) join the first group."""
    groups: dict[Any, dict[str, jax.Array]] = {}
    loose: dict[str, jax.Array] = {}
    for name, x in arrays.items():
        if x.committed:
            groups.setdefault(frozenset(x.sharding.device_set), {})[name] = x
        else:
            loose[name] = x
    out = list(groups.values())
    if loose:
        out = [{**out[0], **loose}, *out[1:]] if out else [loose]
    return out


def _dispatch(done: dict[str, str], groups: list[dict[str, jax.Array]]) -> PendingChecksums:
    names, sums = [], []
    for group in groups:
        names += list(group)
        sums += list(_device_sums(list(group.values())))
    return PendingChecksums(done, names, sums)


def _config() -> tuple[bool, str]:
    """The thread-local settings that change the program: the caller's, not those of the
    thread that compiles it."""
    return bool(jax.config.jax_enable_x64), str(jax.config.jax_numpy_dtype_promotion)


def _compile_in_background(key: Any, config: tuple[bool, str]) -> Future:
    """Compiles `_device_sums` for the leaves `key` (avals, shardings) in a thread; the
    returned future is done when a call with such leaves finds it compiled."""
    shapes = [
        jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s, weak_type=a.weak_type) for a, s in key
    ]
    x64, promotion = config
    future: Future = Future()

    def run() -> None:
        try:
            with jax.enable_x64(x64), jax.numpy_dtype_promotion(promotion):
                future.set_result(_device_sums.lower(shapes).compile())
        except BaseException as e:  # later saves then keep summing snapshots
            future.set_exception(e)

    threading.Thread(target=run, name="blox.ckpt checksum compile").start()
    return future


def start_checksums(named_leaves: dict[str, Any]) -> PendingChecksums:
    """Starts the checksums of every leaf (restore's way: it compiles in the caller).

    Large jax arrays are summed on their devices (one jitted call for all of them per set
    of devices they are committed to, the result replicated), asynchronously: the call
    returns once the program is dispatched (compiled on the first call for a state
    layout). Small ones (up to `HOST_BYTES`, when
    one process holds all of their values), NumPy arrays and Python numbers (as
    `PY_DTYPES`) are summed on the host now, with the same arithmetic.
    """
    done: dict[str, str] = {}
    on_device: dict[str, jax.Array] = {}
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
                on_device[name] = leaf
        elif isinstance(leaf, (np.ndarray, np.generic)):
            done[name] = host_checksum(np.asarray(leaf))
    # one program per set of devices (leaves committed to different ones, e.g. an actor's
    # and a learner's, cannot meet in one)
    return _dispatch(done, _by_devices(on_device))


def checksums(named_leaves: dict[str, Any]) -> dict[str, str]:
    """``{name: 'xxxxxxxx-xxxxxxxx'}`` for every array leaf and Python number (see
    `start_checksums`), computed now."""
    return start_checksums(named_leaves).result()
