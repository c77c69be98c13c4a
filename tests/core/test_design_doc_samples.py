"""The code samples of the design document (seed 003), run as written.

Each test pastes the sample's lines unchanged and supplies only the surrounding
definitions the document leaves to the reader (a model, inputs, a mesh). The
assertions check the behaviour the document promises, against independent facts
(distinct masks, equal outputs, shardings, a hand-written SGD update).
"""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

import blox as bx


def _dropout_setup():
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    dropout = bx.Dropout(graph.child("dropout"), rate=0.5, rng=rng)
    params = rng.seed(bx.Params(), seed=42).locked()
    x = jnp.ones((4, 64))
    return rng, dropout, params, x


def test_vmap_explicit_index_pattern_gives_distinct_masks_per_lane():
    rng, dropout, params, x = _dropout_setup()

    # --- verbatim from seed 003 ---
    def apply_with_explicit_index(params, x, batch_idx):
        original_seed = rng.get_seed(params)
        folded_seed = jax.random.fold_in(original_seed, batch_idx)
        params = rng.seed(params, seed=folded_seed)
        out, params = dropout(params, x, is_training=True)
        params = rng.seed(params, seed=original_seed)  # Restore for replicated params
        return out, params

    # Pass jnp.arange(batch_size) as the batch indices
    out, new_params = jax.vmap(apply_with_explicit_index, in_axes=(None, 0, 0))(
        params, x, jnp.arange(4)
    )
    # --- end ---
    masks = np.asarray(out != 0)
    assert len({m.tobytes() for m in masks}) == 4, "every lane must draw its own mask"
    # Restoring the seed makes params identical across lanes: out_axes=None is allowed.
    out2, replicated = jax.vmap(
        apply_with_explicit_index, in_axes=(None, 0, 0), out_axes=(0, None)
    )(params, x, jnp.arange(4))
    np.testing.assert_array_equal(out2, out)
    assert int(rng.get_counter(replicated)) == 1
    assert jax.random.key_data(rng.get_seed(replicated)).tolist() == (
        jax.random.key_data(jax.random.key(42)).tolist()
    )
    # Without folding, all lanes share one mask (the documented sharp edge).
    same, _ = jax.vmap(lambda p, x: dropout(p, x, is_training=True), in_axes=(None, 0))(params, x)
    assert len({m.tobytes() for m in np.asarray(same != 0)}) == 1
    assert new_params[("net", "rng", "counter")].value.shape == (4,)


def test_vmap_axis_index_pattern_gives_distinct_masks_per_lane():
    rng, dropout, params, x = _dropout_setup()

    # --- verbatim from seed 003 ---
    def apply_with_axis_index(params, x):
        original_seed = rng.get_seed(params)
        folded_seed = jax.random.fold_in(original_seed, jax.lax.axis_index("batch"))
        params = rng.seed(params, seed=folded_seed)
        out, params = dropout(params, x, is_training=True)
        params = rng.seed(params, seed=original_seed)
        return out, params

    jax.vmap(apply_with_axis_index, in_axes=(None, 0), axis_name="batch")(params, x)
    # --- end ---
    out, replicated = jax.vmap(
        apply_with_axis_index, in_axes=(None, 0), out_axes=(0, None), axis_name="batch"
    )(params, x)
    assert len({m.tobytes() for m in np.asarray(out != 0)}) == 4
    # Kept elements are scaled by 1 / (1 - rate) = 2.
    np.testing.assert_array_equal(np.unique(np.asarray(out)), [0.0, 2.0])
    assert int(rng.get_counter(replicated)) == 1


def test_sharded_init_with_jit_out_shardings():
    assert len(jax.devices()) >= 4
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    model = bx.Linear(
        graph.child("fc"),
        8,
        rng,
        kernel_metadata={"sharding": (None, "model")},
        bias_metadata={"sharding": ("model",)},
    )
    dummy_input = jnp.ones((2, 16))

    def init_fn():
        params = rng.seed(bx.Params(), seed=42)
        _, params = model(params, dummy_input)
        return params.locked()

    # --- verbatim from seed 003 (params_sharding built from param metadata) ---
    mesh = jax.make_mesh((4,), ("model",))
    params_sharding = bx.named_shardings(jax.eval_shape(init_fn), mesh)

    @jax.jit(out_shardings=params_sharding)
    def init():
        params = rng.seed(bx.Params(), seed=42)
        _, params = model(params, dummy_input)
        return params.locked()

    params = init()  # JIT handles sharding automatically
    # --- end ---
    kernel = params[("net", "fc", "kernel")].value
    assert kernel.sharding == NamedSharding(mesh, PartitionSpec(None, "model"))
    assert {s.data.shape for s in kernel.addressable_shards} == {(16, 2)}
    seed = params[("net", "rng", "seed")].value
    assert seed.sharding.is_fully_replicated
    # Same values as an unsharded init.
    np.testing.assert_array_equal(kernel, init_fn()[("net", "fc", "kernel")].value)


def test_training_pattern_split_grad_merge():
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    model = bx.Sequential(
        graph.child("seq"),
        [bx.Linear(graph.child("fc"), 1, rng), bx.Dropout(graph.child("drop"), 0.1, rng)],
    )
    inputs = jax.random.normal(jax.random.key(0), (8, 3))
    targets = jnp.sum(inputs, axis=1, keepdims=True)
    params = rng.seed(bx.Params(), seed=0)
    _, params = model(params, inputs)
    params = params.locked()

    # --- verbatim from seed 003 ---
    @jax.jit(donate_argnames="params")
    def train_step(params, inputs, targets):
        # Split into trainable (weights) and non-trainable (RNG, etc).
        trainable, non_trainable = params.split()

        def loss_fn(t, nt):
            # Merge to run the forward pass.
            preds, new_params = model(t.merge(nt), inputs)
            loss = jnp.mean((preds - targets) ** 2)
            # Extract non-trainable parameters updated during the forward pass.
            _, new_nt = new_params.split()
            return loss, new_nt

        # Gradients for trainable, updated state for non-trainable.
        grads, new_non_trainable = jax.grad(loss_fn, has_aux=True)(trainable, non_trainable)

        # Update the trainable parameters using SGD.
        new_trainable = jax.tree.map(lambda w, g: w - 0.01 * g, trainable, grads)

        # Merge updated trainable and updated non-trainable parameters.
        return new_trainable.merge(new_non_trainable)

    # --- end ---
    w0 = np.asarray(params[("net", "fc", "kernel")].value)
    b0 = np.asarray(params[("net", "fc", "bias")].value)
    counter0 = int(rng.get_counter(params))
    key = jax.random.fold_in(rng.get_seed(params), rng.get_counter(params))
    new = train_step(params, inputs, targets)
    # Hand-written reference of the same step (NumPy, same dropout mask).
    keep = np.asarray(jax.random.bernoulli(key, 0.9, (8, 1)))
    x, y = np.asarray(inputs), np.asarray(targets)
    pre = x @ w0 + b0
    pred = np.where(keep, pre / 0.9, 0.0)
    dpred = 2 * (pred - y) / pred.size
    dpre = np.where(keep, dpred / 0.9, 0.0)
    np.testing.assert_allclose(
        new[("net", "fc", "kernel")].value, w0 - 0.01 * x.T @ dpre, rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        new[("net", "fc", "bias")].value, b0 - 0.01 * dpre.sum(0), rtol=1e-5, atol=1e-6
    )
    assert int(new[("net", "rng", "counter")].value) == counter0 + 1
    assert new.is_locked


class MLP(bx.Module):
    """The document's example model (its constructor signature), built from blox layers."""

    def __init__(self, graph, hidden_size, output_size, rng):
        super().__init__(graph)
        self.hidden = bx.Linear(graph.child("hidden"), hidden_size, rng)
        self.out = bx.Linear(graph.child("out"), output_size, rng)

    def __call__(self, params, x):
        h, params = self.hidden(params, x)
        return self.out(params, jax.nn.relu(h))


def test_lazy_initialization_and_eval_shape():
    dummy_input = jnp.ones((2, 20))

    # --- verbatim from seed 003 ---
    # Define structure.
    graph = bx.Graph("net")
    rng = bx.Rng(graph.child("rng"))
    model = MLP(graph.child("mlp"), hidden_size=128, output_size=10, rng=rng)

    # Initialize.
    params = bx.Params()
    params = rng.seed(params, seed=42)
    _, params = model(params, dummy_input)
    params = params.locked()
    # --- end ---
    assert params.is_locked
    assert params[("net", "mlp", "hidden", "kernel")].value.shape == (20, 128)
    assert params[("net", "mlp", "out", "kernel")].value.shape == (128, 10)

    def init():
        p = rng.seed(bx.Params(), seed=42)
        _, p = model(p, dummy_input)
        return p.locked()

    abstract = jax.eval_shape(init)
    assert isinstance(abstract, bx.Params) and abstract.is_locked
    leaf = abstract[("net", "mlp", "hidden", "kernel")].value
    assert isinstance(leaf, jax.ShapeDtypeStruct) and leaf.shape == (20, 128)
    assert list(abstract.keys()) == list(params.keys())


def test_multiple_models_share_the_same_params():
    # --- verbatim from seed 003 ---
    # Create two LSTM variants with the same parameter structure
    def create_lstm(is_static: bool):
        graph = bx.Graph("model")
        rng = bx.Rng(graph.child("rng"))
        lstm = bx.LSTM(graph.child("lstm"), hidden_size=64, rng=rng, is_static=is_static)
        return lstm

    lstm_static = create_lstm(is_static=True)  # Python loop (debuggable)
    lstm_dynamic = create_lstm(is_static=False)  # lax.scan (fast)
    # --- end ---
    inputs = jax.random.normal(jax.random.key(1), (3, 7, 5))
    init_rng = bx.Rng(bx.Graph("model").child("rng"))
    params = init_rng.seed(bx.Params(), seed=0)
    state, params = lstm_dynamic.initial_state(params, inputs)
    _, params = lstm_dynamic.apply(params, inputs)
    params = params.locked()

    # --- verbatim from seed 003 ---
    # Both models work with the same params!
    out_static, _ = lstm_static.apply(params, inputs, prev_state=state)
    out_dynamic, _ = lstm_dynamic.apply(params, inputs, prev_state=state)
    # --- end ---
    (h_s, st_s), (h_d, st_d) = out_static, out_dynamic
    np.testing.assert_allclose(h_s, h_d, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(st_s.cell, st_d.cell, rtol=1e-6, atol=1e-6)
    assert h_s.shape == (3, 7, 64)
