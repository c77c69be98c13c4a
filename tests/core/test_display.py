"""Display: the plain-text table and module tree against golden strings; Treescope."""

import jax
import jax.numpy as jnp
import pytest

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
