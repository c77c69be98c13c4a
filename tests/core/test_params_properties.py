"""Property tests (Hypothesis) for `bx.Params`.

Params are generated from a plain Python model: a dict ``{path: (array, trainable,
metadata)}`` with paths of 1-3 names drawn from a small alphabet that includes ``/``,
`` `` and ``.``. Every property is checked against that model (or against a snapshot taken
before the operation), never against other output of `Params`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import blox as bx

SETTINGS = settings(max_examples=50, deadline=None)

# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------

names = st.text(alphabet="ab/ .", min_size=1, max_size=3)
paths = st.lists(names, min_size=1, max_size=3).map(tuple)

arrays = st.one_of(
    hnp.arrays(
        np.float32,
        hnp.array_shapes(min_dims=0, max_dims=2, max_side=3),
        elements=st.floats(-100, 100, width=32, allow_subnormal=False),
    ),
    hnp.arrays(
        np.int32,
        hnp.array_shapes(min_dims=0, max_dims=2, max_side=3),
        elements=st.integers(-100, 100),
    ),
)

# Metadata values are plain, hashable-after-freezing data. (No bools/floats mixed with
# ints: 1 == True == 1.0 in Python, see test_equal_but_different_metadata_is_not_unified.)
_scalars = st.one_of(st.none(), st.integers(-3, 3), st.text(alphabet="xyz", max_size=3))
_meta_values = st.recursive(
    _scalars,
    lambda inner: st.one_of(
        st.tuples(inner, inner),
        st.dictionaries(st.sampled_from(["u", "v"]), inner, max_size=2),
    ),
    max_leaves=4,
)
metadatas = st.dictionaries(
    st.sampled_from(["sharding", "tag", "note", "n"]), _meta_values, max_size=3
)

entries = st.tuples(arrays, st.booleans(), metadatas)
models = st.dictionaries(paths, entries, max_size=6)


def build(model: dict, locked: bool = False) -> bx.Params:
    """Params from the model via item assignment (the documented loading path)."""
    p = bx.Params()
    for path, (value, trainable, meta) in model.items():
        p[path] = bx.Param(jnp.asarray(value), trainable=trainable, metadata=dict(meta))
    return p.locked() if locked else p


def snapshot(p: bx.Params) -> tuple:
    """Everything observable about `p`, as plain data (keys in p's order)."""
    rows = []
    for path in list(p.keys()):
        param = p[path]
        v = np.asarray(param.value)
        rows.append((path, v.dtype.str, v.shape, v.tobytes(), param.trainable, param.metadata))
    return bool(p.is_locked), rows


def model_snapshot(model: dict, locked: bool) -> tuple:
    """What `snapshot(build(model, locked))` must be: rows sorted by path tuple."""
    rows = []
    for path in sorted(model):
        value, trainable, meta = model[path]
        v = np.asarray(jnp.asarray(value))
        rows.append((path, v.dtype.str, v.shape, v.tobytes(), trainable, dict(meta)))
    return locked, rows


def prefix_free(model: dict) -> bool:
    """No path is a strict prefix of another (a nested dict can hold the model)."""
    keys = list(model)
    return not any(a != b and b[: len(a)] == a for a in keys for b in keys)


# ---------------------------------------------------------------------------
# Construction and read access
# ---------------------------------------------------------------------------


@SETTINGS
@given(models, st.booleans())
def test_build_matches_model(model, locked):
    """keys() are sorted path tuples; params[path] gives value, flag and metadata back."""
    p = build(model, locked)
    assert snapshot(p) == model_snapshot(model, locked)
    assert len(p) == len(model)
    assert list(p.keys()) == sorted(model)
    for path in model:
        assert path in p


# ---------------------------------------------------------------------------
# split / merge
# ---------------------------------------------------------------------------


@SETTINGS
@given(models, st.booleans(), st.data())
def test_split_merge_round_trip_any_predicate(model, locked, data):
    """split(pred) partitions the paths by pred; merging the halves (either order)
    gives back the same keys, values, flags, metadata and lock flag."""
    p = build(model, locked)
    chosen = data.draw(st.sets(st.sampled_from(sorted(model))) if model else st.just(set()))
    seen = []

    def pred(path, param):
        assert isinstance(param, bx.Param)
        seen.append(path)
        return path in chosen

    match, rest = p.split(pred)
    assert sorted(seen) == sorted(model)
    assert set(match.keys()) == chosen
    assert set(rest.keys()) == set(model) - chosen
    assert match.is_locked == rest.is_locked == locked
    assert snapshot(match) == model_snapshot({k: model[k] for k in chosen}, locked)
    expected = model_snapshot(model, locked)
    assert snapshot(match.merge(rest)) == expected
    assert snapshot(rest.merge(match)) == expected


@SETTINGS
@given(models, st.booleans())
def test_split_default_is_trainable(model, locked):
    """split() with no predicate: (trainable, non-trainable)."""
    p = build(model, locked)
    train, rest = p.split()
    assert set(train.keys()) == {k for k, (_, t, _) in model.items() if t}
    assert set(rest.keys()) == {k for k, (_, t, _) in model.items() if not t}
    assert snapshot(train.merge(rest)) == model_snapshot(model, locked)


@SETTINGS
@given(models, models, st.booleans())
def test_merge_other_wins(a, b, locked):
    """merge(other): the union of paths; on shared paths value, flag and metadata all
    come from `other`."""
    merged = build(a, locked).merge(build(b, locked))
    assert snapshot(merged) == model_snapshot({**a, **b}, locked)


@SETTINGS
@given(models, models)
def test_merge_with_overlap_other_wins(a, b):
    """Same, with `other` forced to share every path of `self` (new values and infos)."""
    b = {**b, **{k: (v + 1, not t, {"tag": "other"}) for k, (v, t, _) in a.items()}}
    merged = build(a).merge(build(b))
    assert snapshot(merged) == model_snapshot({**a, **b}, False)
    for k in a:
        assert merged[k].metadata == {"tag": "other"}


@SETTINGS
@given(models, models)
def test_merge_lock_mismatch_raises(a, b):
    with pytest.raises(ValueError, match="Cannot merge Params: self is locked"):
        build(a, True).merge(build(b, False))
    with pytest.raises(ValueError, match="Cannot merge Params: other is locked"):
        build(a, False).merge(build(b, True))


# ---------------------------------------------------------------------------
# Pytree behaviour
# ---------------------------------------------------------------------------


@SETTINGS
@given(models, st.booleans())
def test_tree_flatten_unflatten_round_trip(model, locked):
    """Leaves come in sorted path order; unflatten rebuilds equal params, and new leaves
    land at the same paths."""
    p = build(model, locked)
    leaves, treedef = jax.tree_util.tree_flatten(p)
    assert len(leaves) == len(model)
    for leaf, path in zip(leaves, sorted(model), strict=True):
        np.testing.assert_array_equal(np.asarray(leaf), model[path][0])
    q = jax.tree_util.tree_unflatten(treedef, leaves)
    assert type(q) is bx.Params
    assert snapshot(q) == model_snapshot(model, locked)

    doubled = jax.tree_util.tree_unflatten(treedef, [x * 2 for x in leaves])
    expected = {k: (v * 2, t, m) for k, (v, t, m) in model.items()}
    assert snapshot(doubled) == model_snapshot(expected, locked)
    # Same paths, flags, metadata and lock flag -> same treedef.
    assert jax.tree_util.tree_structure(build(model, locked)) == treedef


@SETTINGS
@given(models, st.booleans())
def test_tree_map_keeps_structure(model, locked):
    """jax.tree.map keeps the type, the lock flag, the trainable flags and the metadata."""
    p = build(model, locked)
    q = jax.tree.map(lambda x: x * 2, p)
    assert type(q) is bx.Params
    expected = {k: (v * 2, t, m) for k, (v, t, m) in model.items()}
    assert snapshot(q) == model_snapshot(expected, locked)
    # Mapping over two params with the same structure.
    r = jax.tree.map(lambda x, y: x - y, q, p)
    assert type(r) is bx.Params
    expected = {k: (v * 2 - v, t, m) for k, (v, t, m) in model.items()}
    assert snapshot(r) == model_snapshot(expected, locked)


@SETTINGS
@given(models, st.booleans())
def test_tree_flatten_with_path_names_leaves(model, locked):
    """Each leaf's key path is one DictKey holding the '/'-joined path, in sorted path
    (tuple) order."""
    p = build(model, locked)
    with_path, _ = jax.tree_util.tree_flatten_with_path(p)
    ordered = sorted(model)
    assert len(with_path) == len(ordered)
    for (key_path, leaf), path in zip(with_path, ordered, strict=True):
        assert key_path == (jax.tree_util.DictKey("/".join(path)),)
        np.testing.assert_array_equal(np.asarray(leaf), model[path][0])


@settings(max_examples=15, deadline=None)
@given(models, st.booleans())
def test_jit_identity_keeps_everything(model, locked):
    """Through jax.jit (flatten + unflatten on the way in and out) nothing changes."""
    p = build(model, locked)
    q = jax.jit(lambda p: p)(p)
    assert type(q) is bx.Params
    assert snapshot(q) == model_snapshot(model, locked)


@pytest.mark.parametrize(
    "va, vb",
    [(1, True), (1, 1.0), (0, False), ({"k": 1}, (("k", 1),)), ((1, 2), [1, 2.0])],
)
def test_equal_but_different_metadata_is_not_unified(va, vb):
    """Metadata is static data: values Python calls equal across types (True == 1 == 1.0,
    a dict and its item tuple) give different tree structures, comparing them changes
    neither side, and jax.jit traces each one separately."""
    a = bx.Params()
    a[("w",)] = bx.Param(jnp.ones(2), metadata={"n": va})
    b = bx.Params()
    b[("w",)] = bx.Param(jnp.ones(2), metadata={"n": vb})
    ta, tb = jax.tree.structure(a), jax.tree.structure(b)
    assert ta != tb and tb != ta
    with pytest.raises(ValueError):
        jax.tree.map(lambda x, y: x, a, b)
    assert b[("w",)].metadata["n"] == (tuple(vb) if isinstance(vb, list) else vb)
    assert type(b[("w",)].metadata["n"]) is (tuple if isinstance(vb, list) else type(vb))
    traces = []
    f = jax.jit(lambda p: (traces.append(1), p)[1])
    assert f(a)[("w",)].metadata["n"] == va and f(b)[("w",)].metadata == b[("w",)].metadata
    assert len(traces) == 2


# ---------------------------------------------------------------------------
# to_dict / from_dict
# ---------------------------------------------------------------------------


def _lookup(tree: dict, path: tuple):
    node = tree
    for name in path:
        node = node[name]
    return node


@SETTINGS
@given(models.filter(prefix_free), st.booleans(), st.booleans())
def test_to_dict_from_dict_round_trip(model, locked, trainable):
    """to_dict nests by path; from_dict rebuilds the keys and values, with every flag set
    to `trainable`, empty metadata and unlocked params."""
    p = build(model, locked)
    tree = bx.to_dict(p)
    for path, (value, _, _) in model.items():
        np.testing.assert_array_equal(np.asarray(_lookup(tree, path)), value)
    assert set(tree) == {path[0] for path in model}
    # sep=None: names here may contain '/', and a tree with no nested dicts would
    # otherwise be read as the flat {'a/b': x} form and split.
    q = bx.from_dict(tree, trainable=trainable, sep=None)
    expected = {k: (v, trainable, {}) for k, (v, _, _) in model.items()}
    assert snapshot(q) == model_snapshot(expected, False)


def _printed_unique(model: dict) -> bool:
    printed = ["/".join(p) for p in model]
    return len(set(printed)) == len(printed)


@SETTINGS
@given(models.filter(_printed_unique), st.booleans())
def test_flat_dict_with_like_rebuilds_the_params(model, locked):
    """The flat form ``{'a/b/c': array}`` (Orbax without a target) with `like` gives back
    the model exactly, names containing '/' included, whenever the printed paths are
    unique."""
    p = build(model, locked)
    flat = {"/".join(path): jnp.asarray(value) for path, (value, _, _) in model.items()}
    assert snapshot(bx.from_dict(flat, like=p)) == model_snapshot(model, locked)


@SETTINGS
@given(
    st.dictionaries(
        st.lists(st.text("ab. ", min_size=1, max_size=3), min_size=1, max_size=3).map(tuple),
        arrays,
        min_size=1,
        max_size=5,
    )
)
def test_flat_dict_without_like_splits_at_slashes(model):
    """Without `like`, flat keys are split at '/' (names here contain none)."""
    flat = {"/".join(path): jnp.asarray(value) for path, value in model.items()}
    q = bx.from_dict(flat, trainable=False)
    expected = {k: (v, False, {}) for k, v in model.items()}
    assert snapshot(q) == model_snapshot(expected, False)


@SETTINGS
@given(models.filter(prefix_free), st.booleans())
def test_to_dict_with_info_round_trip(model, locked):
    """with_info=True keeps the trainable flags and metadata (lock flag: unlocked)."""
    p = build(model, locked)
    tree = bx.to_dict(p, with_info=True)
    for path, (_, trainable, meta) in model.items():
        leaf = _lookup(tree, path)
        assert isinstance(leaf, bx.Param)
        assert leaf.trainable == trainable
        assert leaf.metadata == meta
    assert snapshot(bx.from_dict(tree)) == model_snapshot(model, False)


@SETTINGS
@given(models.filter(prefix_free), st.booleans())
def test_from_dict_like_takes_infos_from_like(model, locked):
    """from_dict(tree, like=p): values from the tree; flags, metadata and lock flag from
    `like`."""
    p = build(model, locked)
    tree = jax.tree.map(lambda x: x + 1, bx.to_dict(p))
    q = bx.from_dict(tree, like=p, trainable=False)
    expected = {k: (v + 1, t, m) for k, (v, t, m) in model.items()}
    assert snapshot(q) == model_snapshot(expected, locked)


def _delete(tree: dict, path: tuple) -> None:
    """Deletes the leaf at `path` and any dict left empty above it."""
    if len(path) > 1:
        _delete(tree[path[0]], path[1:])
        if not tree[path[0]]:
            del tree[path[0]]
    else:
        del tree[path[0]]


@SETTINGS
@given(models.filter(lambda m: len(m) > 0 and prefix_free(m)), st.data())
def test_from_dict_like_missing_or_extra_path_raises(model, data):
    """With `like`, a missing path and an unexpected path are both named in the error."""
    p = build(model)
    path = data.draw(st.sampled_from(sorted(model)))
    tree = bx.to_dict(p)
    _delete(tree, path)
    with pytest.raises(ValueError, match="does not match `like`") as err:
        bx.from_dict(tree, like=p)
    assert "Missing: " + repr(["/".join(path)]) in str(err.value)

    tree = bx.to_dict(p)
    extra = ("extra" + path[0],)
    tree[extra[0]] = jnp.zeros(())
    with pytest.raises(ValueError, match="does not match `like`") as err:
        bx.from_dict(tree, like=p)
    assert "Unexpected: " + repr(["/".join(extra)]) in str(err.value)


@SETTINGS
@given(paths, st.lists(names, min_size=1, max_size=2).map(tuple), arrays)
def test_to_dict_prefix_conflict_raises(prefix, suffix, value):
    """A path that is a prefix of another cannot be nested."""
    p = build({prefix: (value, True, {}), prefix + suffix: (value, True, {})})
    with pytest.raises(ValueError, match="Cannot nest"):
        bx.to_dict(p)


# ---------------------------------------------------------------------------
# Immutability and item assignment
# ---------------------------------------------------------------------------


class _Holder(bx.Module):
    """A bare module, used only to reach set_param at a chosen path."""


def _module_at(path: tuple) -> bx.Module:
    """A module whose parameter `path[-1]` lives at `path` (len(path) >= 3)."""
    node = bx.Graph(path[0])
    for name in path[1:-1]:
        node = node.child(name)
    return _Holder(node)


@SETTINGS
@given(
    models,
    st.booleans(),
    st.data(),
    st.lists(names, min_size=3, max_size=3).map(tuple),
    entries,
    entries,
)
def test_functional_methods_never_modify_the_original(model, locked, data, mpath, e1, e2):
    """split, merge, locked, unlocked and set_param return new Params and leave the
    original exactly as it was."""
    model = {**model, mpath: e1}
    p = build(model, locked)
    before = snapshot(p)
    other = build({mpath: e2, ("zz",): e2}, locked)

    chosen = data.draw(st.sets(st.sampled_from(sorted(model))))
    p.split(lambda path, _: path in chosen)
    p.split()
    p.merge(other)
    other.merge(p)
    p.locked()
    p.unlocked()
    jax.tree.map(lambda x: x + 1, p)

    module = _module_at(mpath)
    new_value, new_trainable, new_meta = e2
    q = module.set_param(
        p,
        mpath[-1],
        jnp.asarray(new_value),
        trainable=new_trainable,
        metadata=dict(new_meta),
    )
    assert snapshot(p) == before
    # set_param's result: the value and flag replaced, the metadata merged.
    expected = dict(model)
    expected[mpath] = (new_value, new_trainable, {**e1[2], **new_meta})
    assert snapshot(q) == model_snapshot(expected, locked)


@SETTINGS
@given(models, paths, entries)
def test_item_assignment_on_unlocked_mutates_in_place(model, path, entry):
    """params[path] = Param(...) on unlocked params changes that object (add or replace),
    and copies taken before (locked(), split) do not see the change."""
    p = build(model)
    ident = id(p)
    copy_locked = p.locked()
    copy_unlocked = p.unlocked()
    half, _ = p.split(lambda *_: True)
    value, trainable, meta = entry
    p[path] = bx.Param(jnp.asarray(value), trainable=trainable, metadata=dict(meta))
    assert id(p) == ident
    assert snapshot(p) == model_snapshot({**model, path: entry}, False)
    assert snapshot(copy_locked) == model_snapshot(model, True)
    assert snapshot(copy_unlocked) == model_snapshot(model, False)
    assert snapshot(half) == model_snapshot(model, False)


@SETTINGS
@given(models, paths, entries)
def test_item_assignment_on_locked_raises(model, path, entry):
    """Locked params refuse item assignment (new or existing path) and stay unchanged."""
    p = build(model, locked=True)
    before = snapshot(p)
    value, trainable, meta = entry
    with pytest.raises(RuntimeError, match="these Params are locked"):
        p[path] = bx.Param(jnp.asarray(value), trainable=trainable, metadata=dict(meta))
    if model:
        existing = sorted(model)[0]
        with pytest.raises(RuntimeError, match="these Params are locked"):
            p[existing] = bx.Param(jnp.asarray(value))
    assert snapshot(p) == before
