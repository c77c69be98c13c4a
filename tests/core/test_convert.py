"""`from_dict` on what Orbax really returns, and its error messages.

Each round trip saves with Orbax into ``tmp_path`` and restores *without a target*, as a
user inspecting or porting a checkpoint does; the reference is the original params
(exact equality of every array, the flags of `like`, and the keys the original `Rng`
draws).
"""

from __future__ import annotations

import builtins
import re

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest

import blox as bx

# Restoring without a target reads shardings from the checkpoint; Orbax warns about it.
pytestmark = pytest.mark.filterwarnings("ignore:Sharding info not provided:UserWarning")


def _model():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (4, 2), rng)
    drop = bx.Dropout(g / "drop", 0.5, rng)

    def init():
        params = rng.seed(bx.Params(), seed=3)
        y, params = mlp(params, jnp.ones((1, 3)))
        _, params = drop(params, y)
        return params.locked()

    return rng, init()


def _save_restore(tmp_path, tree, checkpointer):
    path = tmp_path / "ckpt"
    checkpointer.save(path, tree)
    if hasattr(checkpointer, "wait_until_finished"):
        checkpointer.wait_until_finished()
    return checkpointer.restore(path)


def _assert_same(params: bx.Params, original: bx.Params) -> None:
    assert list(params.keys()) == list(original.keys())
    for path in original.keys():
        got, want = params[path], original[path]
        assert np.asarray(got.value).dtype == np.asarray(want.value).dtype, path
        np.testing.assert_array_equal(np.asarray(got.value), np.asarray(want.value), str(path))
        assert got.trainable == want.trainable and got.metadata == want.metadata, path


@pytest.mark.parametrize(
    "checkpointer, what",
    [
        (ocp.StandardCheckpointer, "params"),
        (ocp.PyTreeCheckpointer, "params"),
        (ocp.StandardCheckpointer, "to_dict"),
        (ocp.PyTreeCheckpointer, "to_dict"),
    ],
)
def test_orbax_restore_without_target_feeds_from_dict(tmp_path, checkpointer, what):
    rng, original = _model()
    tree = original if what == "params" else bx.to_dict(original)
    restored = _save_restore(tmp_path, tree, checkpointer())
    assert isinstance(restored, dict)
    if what == "params":  # the flat form: one key per parameter, the path joined with '/'
        assert set(restored) == {"/".join(k) for k in original.keys()}

    params = bx.from_dict(restored, like=original)
    assert params.is_locked
    _assert_same(params, original)
    # The restored RNG state draws the keys the original draws.
    reference = original
    for _ in range(2):
        k_new, params = rng(params)
        k_old, reference = rng(reference)
        np.testing.assert_array_equal(jax.random.key_data(k_new), jax.random.key_data(k_old))

    # Without `like`: the same paths and arrays; flags from `trainable`, unlocked.
    plain = bx.from_dict(restored, trainable=False)
    assert list(plain.keys()) == list(original.keys()) and not plain.is_locked
    for path in original.keys():
        np.testing.assert_array_equal(plain[path].value, original[path].value)
        assert plain[path].trainable is False


def test_flat_keys_resolve_through_like_even_with_slashes_in_names():
    """Names may contain '/': with `like`, a flat key is matched against the printed
    paths of `like`, so ('a/b', 'c') comes back as itself, not as ('a', 'b', 'c')."""
    like = bx.Params()
    like[("net", "a/b", "w")] = bx.Param(jnp.zeros(2))
    like[("net", "c", "w")] = bx.Param(jnp.zeros((), jnp.int32), trainable=False)
    flat = {"net/a/b/w": jnp.arange(2.0), "net/c/w": jnp.asarray(7, jnp.int32)}
    p = bx.from_dict(flat, like=like)
    assert list(p.keys()) == [("net", "a/b", "w"), ("net", "c", "w")]
    np.testing.assert_array_equal(p[("net", "a/b", "w")].value, [0.0, 1.0])
    assert p[("net", "c", "w")].trainable is False
    # A nested tree whose keys hold part of the path is matched the same way.
    mixed = {"net": {"a/b/w": jnp.arange(2.0), "c": {"w": jnp.asarray(7, jnp.int32)}}}
    assert list(bx.from_dict(mixed, like=like).keys()) == list(p.keys())
    # Without `like`, flat keys are split at '/', unless sep=None.
    assert list(bx.from_dict({"x/y": jnp.ones(1)}).keys()) == [("x", "y")]
    assert list(bx.from_dict({"x/y": jnp.ones(1)}, sep=None).keys()) == [("x/y",)]
    assert list(bx.from_dict({"x.y": jnp.ones(1)}, sep=".").keys()) == [("x", "y")]


def _called_names(message: str) -> list[str]:
    return re.findall(r"([A-Za-z_][\w.]*)\(", message)


def _resolves(dotted: str, like: bx.Params) -> bool:
    head, *rest = dotted.split(".")
    roots = {"bx": bx, "like": like, "params": like}
    obj = roots.get(head, getattr(builtins, head, getattr(bx, head, None)))
    for name in rest:
        obj = getattr(obj, name, None)
    return callable(obj)


def test_from_dict_mismatch_lists_each_name_once_and_hints_only_real_functions():
    _, like = _model()
    flat = {"/".join(k): like[k].value for k in like.keys()}
    flat["net/mlp/linear_0/weight"] = flat.pop("net/mlp/linear_0/kernel")
    del flat["net/mlp/linear_1/bias"]
    with pytest.raises(ValueError) as info:
        bx.from_dict(flat, like=like)
    message = str(info.value)
    missing = re.search(r"Missing: \[(.*?)\]\.", message).group(1)
    unexpected = re.search(r"Unexpected: \[(.*?)\]\. ", message).group(1)
    assert re.findall(r"'([^']+)'", missing) == [
        "net/mlp/linear_0/kernel",
        "net/mlp/linear_1/bias",
    ]
    assert unexpected == "'net/mlp/linear_0/weight' (did you mean 'net/mlp/linear_0/kernel'?)"
    # The flat keys that do match are listed nowhere (today's bug listed every name on
    # both sides), and no name is on both sides.
    assert "net/mlp/linear_0/bias" not in message
    assert "to_dict(like)" not in message
    names = _called_names(message)
    assert names and all(_resolves(n, like) for n in names), names


def test_from_dict_other_errors():
    like = bx.Params()
    like[("a/b", "c")] = bx.Param(jnp.zeros(1))
    like[("a", "b/c")] = bx.Param(jnp.zeros(1))
    with pytest.raises(ValueError, match=r"the key 'a/b/c' could be any of the paths"):
        bx.from_dict({"a/b/c": jnp.zeros(1)}, like=like)
    one = bx.Params()
    one[("a", "b")] = bx.Param(jnp.zeros(1))
    with pytest.raises(ValueError, match=r"'a/b' is given twice, under the keys \['a/b'\]"):
        bx.from_dict({"a/b": jnp.zeros(1), "a": {"b": jnp.ones(1)}}, like=one)
    with pytest.raises(ValueError, match=r"'a/b' has shape \(2,\), the model expects \(1,\)"):
        bx.from_dict({"a/b": jnp.zeros(2)}, like=one)
    with pytest.raises(TypeError, match="like must be Params"):
        bx.from_dict({"a/b": jnp.zeros(1)}, like={"a": 1})
