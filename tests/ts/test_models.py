"""blox.ts models: shapes, n_skip, TCN causality, teacher forcing vs free run, raw-in/raw-out,
a NumPy reference of the GRU model, low precision, and the errors."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import blox as bx
from blox.ts import CRNN, TCN, ARModel, EncoderModel, RNNModel, make_sysid_step, sysid_loss
from tests.tolerances import tol

U_STATS = ([0.5], [2.0])
Y_STATS = ([1.0, -1.0], [3.0, 0.5])
B, T = 3, 24


def _build(kind, graph, rng, u_stats=U_STATS, y_stats=Y_STATS, **kw):
    if kind == "gru":
        return RNNModel(graph, u_stats, y_stats, rng, hidden_size=8, num_layers=2, **kw)
    if kind == "lstm":
        return RNNModel(graph, u_stats, y_stats, rng, hidden_size=8, cell="lstm", **kw)
    if kind == "rnn_skip":
        return RNNModel(graph, u_stats, y_stats, rng, hidden_size=8, cell="rnn",
                        linear_skip=True, **kw)  # fmt: skip
    if kind == "tcn":
        return TCN(graph, u_stats, y_stats, rng, channels=8, dilations=(1, 2), **kw)
    if kind == "crnn":
        return CRNN(graph, u_stats, y_stats, rng, channels=8, dilations=(1, 2),
                    hidden_size=8, **kw)  # fmt: skip
    if kind == "ar":
        return ARModel(graph, u_stats, y_stats, rng, hidden_size=8, **kw)
    return EncoderModel(graph, u_stats, y_stats, rng, n_init=4, hidden_size=8, **kw)


KINDS = ["gru", "lstm", "rnn_skip", "tcn", "crnn", "ar", "encoder"]


def _data(seed=0, b=B, t=T):
    gen = np.random.default_rng(seed)
    u = (gen.normal(size=(b, t, 1)) * 2 + 0.5).astype(np.float32)
    y = (gen.normal(size=(b, t, 2)) * [3.0, 0.5] + [1.0, -1.0]).astype(np.float32)
    return u, y


def _init(model, rng, u, y, seed=0):
    params = rng.seed(bx.Params(), seed=seed)
    _, params = model.forward(params, u, y)
    return params.locked()


@pytest.mark.parametrize("kind", KINDS)
def test_shapes_simulate_and_statistics_are_not_trained(kind):
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = _build(kind, g / kind, rng, n_skip=5)
    u, y = _data()
    params = _init(model, rng, u, y)
    (y_hat, state), p2 = model.forward(params, u, y)
    assert y_hat.shape == (B, T, 2) and y_hat.dtype == jnp.float32
    assert jax.tree.structure(p2) == jax.tree.structure(params)
    sim, _ = jax.jit(model.simulate)(params, u, y)
    assert sim.shape == (B, T, 2)
    assert params[("m", kind, "y_norm", "std")].trainable is False
    np.testing.assert_allclose(model.y_norm.std(params), [3.0, 0.5])
    if kind in ("gru", "lstm", "rnn_skip", "crnn"):  # stateless models have no state
        assert len(state) == len(model.rnn.layers)
    if kind == "tcn":
        assert state is None and model.receptive_field == 1 + 2 * 2 * 3


@pytest.mark.parametrize("kind", ["gru", "tcn", "ar"])
def test_n_skip_steps_are_excluded_from_the_loss(kind):
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = _build(kind, g / kind, rng, n_skip=6)
    u, y = _data()
    params = _init(model, rng, u, y)
    (loss, _), _ = sysid_loss(model, params, {"u": u, "y": y})
    # The warm-up targets do not count (the AR model reads y[t-1] as input, so change
    # only targets it never reads: the last warm-up step's input is y[4]).
    y2 = y.copy()
    y2[:, :5] += 100.0 if kind != "ar" else 0.0
    (loss2, _), _ = sysid_loss(model, params, {"u": u, "y": y2})
    # Reference: bx.normalized_mse on the model's own outputs, n_skip sliced there.
    (y_hat, _), _ = model.forward(params, u, y)
    ref = bx.normalized_mse(y_hat, y, jnp.array([3.0, 0.5]), n_skip=6)
    np.testing.assert_allclose(loss, ref, **tol(jnp.float32))
    np.testing.assert_allclose(loss2, loss, **tol(jnp.float32))


def test_tcn_is_causal_with_the_reported_receptive_field():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = TCN(g / "tcn", U_STATS, Y_STATS, rng, channels=6, kernel_size=3, dilations=(1, 2, 4))
    r = model.receptive_field
    assert r == 1 + 2 * 2 * 7
    u, y = _data(t=60)
    params = _init(model, rng, u, y)
    (base, _), _ = model(params, u)
    t = 40
    later = u.copy()
    later[:, t + 1 :] += 5.0
    (out, _), _ = model(params, later)
    np.testing.assert_array_equal(out[:, : t + 1], base[:, : t + 1])  # future cannot leak
    assert np.all(np.abs(out[:, t + 1 :] - base[:, t + 1 :]).max(axis=(0, 2)) > 0)
    edge = u.copy()
    edge[:, t - r + 1] += 5.0  # the oldest input output t sees
    assert np.abs(model(params, edge)[0][0][:, t] - base[:, t]).max() > 0
    beyond = u.copy()
    beyond[:, : t - r + 1] += 5.0  # older than the receptive field
    np.testing.assert_array_equal(model(params, beyond)[0][0][:, t:], base[:, t:])


@pytest.mark.parametrize("cell", ["gru", "lstm"])
def test_free_run_equals_teacher_forcing_on_its_own_outputs(cell):
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = ARModel(g / "ar", U_STATS, Y_STATS, rng, hidden_size=8, num_layers=2, cell=cell)
    u, y = _data()
    params = _init(model, rng, u, y)
    free, _ = jax.jit(model.simulate)(params, u)  # n_warmup = n_skip = 0
    (forced, state), _ = model(params, u, free)
    np.testing.assert_allclose(forced, free, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(model.y_norm(params, free[:, -1])[0], state.y_last, atol=1e-5)
    # With a warm-up the first steps follow the measured y: equal to teacher forcing there.
    warm, _ = model.simulate(params, u, y, n_warmup=10)
    (tf, _), _ = model(params, u, y)
    np.testing.assert_allclose(warm[:, :11], tf[:, :11], rtol=1e-4, atol=1e-5)
    assert np.abs(warm[:, 12:] - tf[:, 12:]).max() > 1e-3


def _numpy_gru_model(params, u, path):
    def p(*k):
        return np.asarray(params[(*path, *k)].value, np.float64)

    z = (u - p("u_norm", "mean")) / p("u_norm", "std")
    for layer in ("layer_0", "layer_1"):
        w, uu = p("rnn", layer, "kernel"), p("rnn", layer, "recurrent_kernel")
        b, bu = p("rnn", layer, "bias"), p("rnn", layer, "recurrent_bias")
        h = np.zeros((z.shape[0], uu.shape[0]))
        out = []
        for t in range(z.shape[1]):
            gi, gh = z[:, t] @ w + b, h @ uu + bu
            hs = uu.shape[0]
            r = 1 / (1 + np.exp(-(gi[:, :hs] + gh[:, :hs])))
            zz = 1 / (1 + np.exp(-(gi[:, hs : 2 * hs] + gh[:, hs : 2 * hs])))
            n = np.tanh(gi[:, 2 * hs :] + r * gh[:, 2 * hs :])
            h = (1 - zz) * n + zz * h
            out.append(h)
        z = np.stack(out, 1)
    o = z @ p("head", "kernel") + p("head", "bias")
    return o * p("y_norm", "std") + p("y_norm", "mean")


def test_gru_model_matches_a_numpy_reference():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = _build("gru", g / "gru", rng)
    u, y = _data()
    params = _init(model, rng, u, y)
    (y_hat, _), _ = model(params, u)
    ref = _numpy_gru_model(params, u.astype(np.float64), ("m", "gru"))
    np.testing.assert_allclose(y_hat, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["gru", "tcn"])
def test_raw_in_raw_out_scaling_by_1000(kind):
    """Trained on data scaled by 1000 (statistics from the scaled data), the model gives
    outputs scaled by 1000: the normalization makes the training identical."""
    u, y = _data(t=16)
    outs = []
    for scale in (1.0, 1000.0):
        us, ys = u * scale, y * scale
        stats_u = (us.reshape(-1, 1).mean(0), us.reshape(-1, 1).std(0))
        stats_y = (ys.reshape(-1, 2).mean(0), ys.reshape(-1, 2).std(0))
        g = bx.Graph("m")
        rng = bx.Rng(g / "rng")
        model = _build(kind, g / kind, rng, u_stats=stats_u, y_stats=stats_y, n_skip=2)
        params = _init(model, rng, us, ys)
        tx = optax.adam(1e-2)
        opt = tx.init(params.split()[0])
        step = jax.jit(make_sysid_step(model, tx))
        for _ in range(5):
            params, opt, _, metrics = step(params, opt, None, {"u": us, "y": ys})
        outs.append(np.asarray(model(params, us)[0][0], np.float64))
    np.testing.assert_allclose(outs[1], 1000.0 * outs[0], rtol=2e-3, atol=2e-3 * 1000 * 1e-2)


def test_bfloat16_compute_is_close_to_float32():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    f32 = RNNModel(g / "gru", U_STATS, Y_STATS, rng, hidden_size=8)
    g16 = bx.Graph("m")  # the same paths: the bf16 model reads the float32 params
    bf = RNNModel(g16 / "gru", U_STATS, Y_STATS, None, hidden_size=8, dtype=jnp.bfloat16)
    u, y = _data(t=8)
    params = _init(f32, rng, u, y)
    (ref, _), _ = f32(params, u)
    (out, _), _ = bf(params, u.astype(jnp.bfloat16))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_allclose(
        np.asarray(out, np.float32) / 3.0, np.asarray(ref) / 3.0, **tol(jnp.bfloat16)
    )


def test_encoder_state_comes_from_the_window_and_is_trained():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = _build("encoder", g / "enc", rng)
    u, y = _data()
    params = _init(model, rng, u, y)
    sim = jax.jit(lambda p, u, y: model(p, u, y)[0][0])
    y_hat = sim(params, u, y)
    np.testing.assert_array_equal(y_hat[:, :4], y[:, :4])  # the window, measured
    y2 = y.copy()
    y2[:, :4] += 1.0  # another window gives another initial state ...
    assert np.abs(sim(params, u, y2)[:, 4:] - y_hat[:, 4:]).max() > 1e-4
    y3 = y.copy()
    y3[:, 4:] += 1.0  # ... while y after the window is never read
    np.testing.assert_array_equal(sim(params, u, y3)[:, 4:], y_hat[:, 4:])
    (loss, _), grads, _ = jax.jit(
        bx.value_and_grad(lambda p: sysid_loss(model, p, {"u": u, "y": y}), has_aux=True)
    )(params)
    assert float(jnp.abs(grads[("m", "enc", "encoder", "linear_0", "kernel")].value).max()) > 0
    assert np.isfinite(float(loss))


def test_model_errors():
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    gru = RNNModel(g / "gru", U_STATS, Y_STATS, rng, hidden_size=4)
    params = rng.seed(bx.Params(), seed=0)
    with pytest.raises(ValueError, match=r"u must be \[B, T, 1\].*got shape \(5, 1\)"):
        gru(params, jnp.zeros((5, 1)))
    with pytest.raises(TypeError, match="u_stats must be a ChannelStats"):
        RNNModel(g / "bad", 3.0, Y_STATS, rng)
    with pytest.raises(ValueError, match="cell must be one of"):
        RNNModel(g / "bad2", U_STATS, Y_STATS, rng, cell="transformer")
    with pytest.raises(ValueError, match="n_skip must be a non-negative int"):
        RNNModel(g / "bad3", U_STATS, Y_STATS, rng, n_skip=-1)
    tcn = TCN(g / "tcn", U_STATS, Y_STATS, rng, channels=4)
    with pytest.raises(TypeError, match="a TCN keeps no state"):
        tcn(params, jnp.zeros((1, 5, 1)), prev_state=(1,))
    with pytest.raises(ValueError, match="dilations\\[1\\] must be a positive int"):
        TCN(g / "tcn2", U_STATS, Y_STATS, rng, dilations=(1, 0))
    with pytest.raises(ValueError, match="n_skip=2 is below n_init=4"):
        EncoderModel(g / "enc", U_STATS, Y_STATS, rng, n_init=4, n_skip=2)
    ar = ARModel(g / "ar", U_STATS, Y_STATS, rng, hidden_size=4)
    u, y = _data()
    with pytest.raises(TypeError, match="prev_state must be the ARState"):
        ar(params, u, y, prev_state=(None,))
    with pytest.raises(ValueError, match=r"simulate\(n_warmup=3\) feeds the measured y"):
        ar.simulate(params, u, n_warmup=3)
    with pytest.raises(ValueError, match="must share"):
        ar(params, u, y[:, :5])


# -- initialization (PyTorch's default, the sys-id recipe's) ----------------------------


@pytest.mark.parametrize("cell", ["gru", "lstm", "rnn"])
def test_torch_init_draws_pytorchs_uniform_bounds(cell):
    # Closed form: U(-k, k) has max |w| <= k and std k / sqrt(3); the sum of two draws
    # (the LSTM's one bias, torch's bias_ih + bias_hh) std k * sqrt(2/3).
    hidden, cu = 64, 3
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "net", ([0.0] * cu, [1.0] * cu), Y_STATS, rng, hidden_size=hidden,
                     num_layers=2, cell=cell, linear_skip=True, init="torch")  # fmt: skip
    assert model.init == "torch"
    _, params = model(rng.seed(bx.Params(), seed=0), jnp.ones((1, 4, cu)))
    k_cell, k_head, k_skip = 1 / np.sqrt(hidden), 1 / np.sqrt(hidden), 1 / np.sqrt(cu)
    seen = 0
    for path, p in params.split()[0].items():
        w = np.asarray(p.value)
        if "rnn" in path:
            k = k_cell * (2 if cell == "lstm" and path[-1] == "bias" else 1)
            std = k_cell * (np.sqrt(2 / 3) if cell == "lstm" and path[-1] == "bias" else 1 / 3**0.5)
        else:
            k = k_head if path[-2] == "head" else k_skip
            std = k / np.sqrt(3)
        assert np.abs(w).max() <= k + 1e-7, path
        if w.size >= 1000:  # enough draws for the std within 10 %
            np.testing.assert_allclose(w.std(), std, rtol=0.1, err_msg=str(path))
            seen += 1
    assert seen >= 2  # both layers' kernels


def test_lecun_init_keeps_blox_nn_defaults_and_a_bad_init_is_named():
    # 'lecun' (the default): blox.nn's GRU input kernel is LeCun normal over the joint
    # fan-in F + H (over F alone one input channel started at std 1); the
    # recurrent kernel orthogonal per gate (each (H, H) block: W^T W = I).
    hidden = 256
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "net", ([0.0], [1.0]), ([0.0], [1.0]), rng, hidden_size=hidden)
    assert model.init == "lecun"
    _, params = model(rng.seed(bx.Params(), seed=0), jnp.ones((1, 4, 1)))
    kernel = np.asarray(params.value(("m", "net", "rnn", "layer_0", "kernel")), np.float64)
    rec = np.asarray(params.value(("m", "net", "rnn", "layer_0", "recurrent_kernel")))
    assert kernel.shape == (1, 3 * hidden)
    np.testing.assert_allclose(np.sqrt(np.mean(kernel**2)), 1 / np.sqrt(1 + hidden), rtol=0.15)
    for gate in range(3):
        block = rec[:, gate * hidden : (gate + 1) * hidden]
        np.testing.assert_allclose(block.T @ block, np.eye(hidden), atol=1e-4)
    with pytest.raises(ValueError, match=r"RNNModel 'm/bad': init must be one of \('torch', "
                       r"'lecun'\).*got 'xavier'"):  # fmt: skip
        RNNModel(g / "bad", ([0.0], [1.0]), ([0.0], [1.0]), rng, init="xavier")


@pytest.mark.parametrize("init", ["lecun", "torch"])
@pytest.mark.parametrize("scale", [1.0, 5.0])
def test_head_scale_draws_the_head_at_that_multiple(init, scale):
    # Closed form: LeCun normal over H has std 1 / sqrt(H) (jax's truncated normal is
    # rescaled to it); PyTorch's nn.Linear U(+-1/sqrt(H)) std 1 / sqrt(3 H); head_scale
    # multiplies the bound / std. The recurrent layers do not change.
    hidden = 1024
    g = bx.Graph("m")
    rng = bx.Rng(g / "rng")
    model = RNNModel(g / "net", ([0.0], [1.0]), Y_STATS, rng, hidden_size=hidden,
                     linear_skip=True, init=init, head_scale=scale)  # fmt: skip
    assert model.head_scale == scale
    _, params = model(rng.seed(bx.Params(), seed=0), jnp.ones((1, 3, 1)))
    kernel = np.asarray(params.value(("m", "net", "head", "kernel")), np.float64)
    assert kernel.shape == (hidden, 2)
    std = scale / np.sqrt(hidden) / (np.sqrt(3) if init == "torch" else 1)
    np.testing.assert_allclose(kernel.std(), std, rtol=0.08)
    if init == "torch":  # the bias is nn.Linear's too, at the same bound
        assert np.abs(kernel).max() <= scale / np.sqrt(hidden) + 1e-7
        bias = np.asarray(params.value(("m", "net", "head", "bias")))
        assert np.abs(bias).max() <= scale / np.sqrt(hidden) + 1e-7
    rec = np.asarray(params.value(("m", "net", "rnn", "layer_0", "recurrent_kernel")))
    rec_std = 1 / np.sqrt(hidden) / (np.sqrt(3) if init == "torch" else 1)  # orthogonal: 1/sqrt(H)
    np.testing.assert_allclose(np.sqrt(np.mean(rec**2)), rec_std, rtol=0.1)


@pytest.mark.parametrize("bad", [0.0, -1.0, True, "5", float("nan")])
def test_a_bad_head_scale_is_named(bad):
    g = bx.Graph("m")
    with pytest.raises(ValueError, match=r"RNNModel 'm/bad': head_scale must be a positive"):
        RNNModel(g / "bad", ([0.0], [1.0]), ([0.0], [1.0]), None, head_scale=bad)
