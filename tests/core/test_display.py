"""Display: the plain-text table and module tree against golden strings; Treescope."""

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import blox as bx


def _model():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    mlp = bx.MLP(g / "mlp", (4, 2), rng)
    fc = bx.Linear(g / "fc", 4, rng, kernel_metadata={"sharding": (None, "model")})
    p = rng.seed(bx.Params(), seed=0)
    _, p = mlp(p, jnp.ones((1, 3)))
    _, p = fc(p, jnp.ones((1, 2)))
    return g, p.locked()


GOLDEN_TABLE = """\
Params (locked, 8 arrays)
path                     shape   dtype    trainable  sharding       bytes
net/fc/bias              (4,)    float32  yes        -                 16
net/fc/kernel            (2, 4)  float32  yes        (None, model)     32
net/mlp/linear_0/bias    (4,)    float32  yes        -                 16
net/mlp/linear_0/kernel  (3, 4)  float32  yes        -                 48
net/mlp/linear_1/bias    (2,)    float32  yes        -                  8
net/mlp/linear_1/kernel  (4, 2)  float32  yes        -                 32
net/rng/counter          ()      uint32   no         -                  4
net/rng/seed             (2,)    uint32   no         -                  8
total: 41 values (38 trainable, 3 other), 164 bytes (164 B)"""

GOLDEN_TREE = """\
net
  rng: Rng()
  mlp: MLP(output_sizes=(4, 2), rng=<Rng 'net/rng'>)
    linear_0: Linear(output_size=4, rng=<Rng 'net/rng'>)
    linear_1: Linear(output_size=2, rng=<Rng 'net/rng'>)
  fc: Linear(output_size=4, rng=<Rng 'net/rng'>, kernel_metadata={'sharding': (None, 'model')})"""


def test_params_repr_is_the_golden_table():
    _, params = _model()
    assert repr(params) == GOLDEN_TABLE
    assert repr(bx.Params()) == "Params (unlocked, 0 arrays)"


def test_abstract_params_display_shapes():
    g = bx.Graph("n")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 2, rng)
    abstract = jax.eval_shape(lambda: fc(rng.seed(bx.Params(), seed=0), jnp.ones((1, 3)))[1])
    assert "n/fc/kernel    (3, 2)  float32" in repr(abstract)


def test_display_prints_tree_then_table(capsys):
    g, params = _model()
    bx.display(g, params)
    out = capsys.readouterr().out
    assert out == GOLDEN_TREE + "\n\n" + GOLDEN_TABLE + "\n"
    with pytest.raises(TypeError, match="display expects a Graph, Module, Params"):
        bx.display(42)


def test_treescope_rendering():
    treescope = pytest.importorskip("treescope")
    g, params = _model()
    text = treescope.render_to_text(params)
    assert "'net/fc/kernel'" in text and text.startswith("Params(")
    mod = g.children["fc"].module
    assert "path='net/fc'" in treescope.render_to_text(mod)


# -- the sharding arrays actually have ------------------------------------------------


def _placed_model():
    g = bx.Graph("net")
    rng = bx.Rng(g / "rng")
    fc = bx.Linear(g / "fc", 4, rng, kernel_metadata={"sharding": (None, "model")})
    head = bx.Linear(g / "head", 2, rng, kernel_metadata={"sharding": ("model", None)})
    wide = bx.Linear(g / "wide", 8, rng, use_bias=False)
    p = rng.seed(bx.Params(), seed=0)
    _, p = wide(p, jnp.ones((1, 8)))
    h, p = fc(p, jnp.ones((1, 8)))
    _, p = head(p, h)
    return p.locked()


# Where each array is put by jax.device_put (default: replicated). 'net/head/kernel' is
# declared ('model', None) in its metadata but placed on ('data', None).
PLACED_SPECS = {
    "net/fc/kernel": P(None, "model"),
    "net/fc/bias": P("model"),
    "net/head/kernel": P("data"),
    "net/wide/kernel": P(("data", "model"), None),
}

GOLDEN_METADATA_TABLE = """\
Params (locked, 7 arrays)
path             shape   dtype    trainable  sharding       bytes
net/fc/bias      (4,)    float32  yes        -                 16
net/fc/kernel    (8, 4)  float32  yes        (None, model)    128
net/head/bias    (2,)    float32  yes        -                  8
net/head/kernel  (4, 2)  float32  yes        (model, None)     32
net/rng/counter  ()      uint32   no         -                  4
net/rng/seed     (2,)    uint32   no         -                  8
net/wide/kernel  (8, 8)  float32  yes        -                256
total: 113 values (110 trainable, 3 other), 452 bytes (452 B)"""

GOLDEN_PLACED_TABLE = """\
Params (locked, 7 arrays)
path             shape   dtype    trainable  sharding                                bytes
net/fc/bias      (4,)    float32  yes        (model)                                    16
net/fc/kernel    (8, 4)  float32  yes        (None, model)                             128
net/head/bias    (2,)    float32  yes        replicated                                  8
net/head/kernel  (4, 2)  float32  yes        (data, None) != metadata (model, None)     32
net/rng/counter  ()      uint32   no         replicated                                  4
net/rng/seed     (2,)    uint32   no         replicated                                  8
net/wide/kernel  (8, 8)  float32  yes        ((data, model), None)                     256
total: 113 values (110 trainable, 3 other), 452 bytes (452 B)"""


def _place(params, mesh, specs):
    shardings = jax.tree_util.tree_map_with_path(
        lambda kp, _: NamedSharding(mesh, specs.get(kp[0].key, P())), params
    )
    return jax.device_put(params, shardings)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto])
def test_table_shows_the_sharding_arrays_actually_have(axis_type):
    params = _placed_model()
    # Single-device arrays: the metadata.
    assert repr(params) == GOLDEN_METADATA_TABLE
    mesh = jax.make_mesh((2, 4), ("data", "model"), axis_types=(axis_type, axis_type))
    placed = _place(params, mesh, PLACED_SPECS)
    assert repr(placed) == GOLDEN_PLACED_TABLE
    assert bx.params_table(placed) == GOLDEN_PLACED_TABLE


def test_table_marks_a_declared_sharding_placed_replicated():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = _place(_placed_model(), mesh, {})
    table = repr(placed)
    assert "net/fc/kernel    (8, 4)  float32  yes        replicated != metadata (None, model)" in (
        table
    )
    # Declared and placed alike: no mark.
    agree = _place(_placed_model(), mesh, {"net/head/kernel": P("model", None)})
    assert "net/head/kernel  (4, 2)  float32  yes        (model, None)  " in repr(agree)


def test_tracers_and_abstract_values_show_the_metadata():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    placed = _place(_placed_model(), mesh, PLACED_SPECS)
    seen = []
    jax.jit(lambda p: seen.append(repr(p)))(placed)
    assert seen == [GOLDEN_METADATA_TABLE]
    abstract = jax.eval_shape(lambda p: p, placed)
    assert repr(abstract) == GOLDEN_METADATA_TABLE
