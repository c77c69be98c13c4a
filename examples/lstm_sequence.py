"""Train an LSTM to predict a noisy oscillator one step ahead, with truncated BPTT.

    python examples/lstm_sequence.py               # a few minutes on 2 CPUs
    python examples/lstm_sequence.py --size tiny   # a few seconds (smoke test)

The data is generated here (no downloads): every stream is a sum of two sines with random
frequencies and phases; the model sees the noisy signal and predicts the next clean value.
Streams are long, so training cuts them into chunks and carries the LSTM's final state
from one chunk to the next (truncated backpropagation through time): gradients stop at
the chunk boundary (``jax.lax.stop_gradient``), the state does not. At evaluation the
whole held-out stream runs in one ``apply``; its error is compared with the naive
"repeat the last observation" predictor.
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx

SIZES = {
    # name: (streams, stream length, chunk length, epochs, hidden size)
    "tiny": (16, 120, 40, 4, 16),
    "default": (64, 1000, 50, 30, 64),
}
NOISE = 0.1


def make_streams(n: int, length: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Inputs ``[n, length, 1]`` (noisy signal) and targets ``[n, length, 1]`` (the next
    clean value)."""
    rs = np.random.default_rng(seed)
    t = np.arange(length + 1)[None, :]
    freqs = rs.uniform(0.01, 0.08, size=(n, 2, 1))
    phases = rs.uniform(0.0, 2 * np.pi, size=(n, 2, 1))
    amps = rs.uniform(0.3, 0.7, size=(n, 2, 1))
    clean = np.sum(amps * np.sin(2 * np.pi * freqs * t[:, None] + phases), axis=1)
    noisy = clean + NOISE * rs.standard_normal(clean.shape)
    x = noisy[:, :-1, None].astype(np.float32)
    y = clean[:, 1:, None].astype(np.float32)
    return x, y


class Predictor(bx.Module):
    """An LSTM and a linear head on every step: ``[B, T, 1] -> [B, T, 1]``."""

    def __init__(self, graph: bx.Graph, hidden: int, rng: bx.Rng):
        super().__init__(graph)
        self.lstm = bx.LSTM(graph / "lstm", hidden, rng)
        self.head = bx.Linear(graph / "head", 1, rng)

    def initial_state(self, params: bx.Params, x_t: jax.Array):
        return self.lstm.initial_state(params, x_t)

    def __call__(self, params: bx.Params, x: jax.Array, prev_state=None):
        (h, state), params = self.lstm.apply(params, x, prev_state)
        y, params = self.head(params, h)
        return (y, state), params


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    n, length, chunk, epochs, hidden = SIZES[args.size]

    x_train, y_train = make_streams(n, length, seed=args.seed)
    x_test, y_test = make_streams(max(8, n // 4), length, seed=args.seed + 1)

    graph = bx.Graph("net")
    rng = bx.Rng(graph / "rng")
    model = Predictor(graph / "model", hidden, rng)
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = model(params, x_train[:, :chunk])
    params = params.locked()

    chunks_per_epoch = length // chunk
    tx = optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adam(optax.cosine_decay_schedule(1e-2, epochs * chunks_per_epoch, alpha=0.05)),
    )
    opt_state = tx.init(params.split()[0])

    def loss_fn(trainable, non_trainable, state, x, y):
        (pred, state), _ = model(trainable.merge(non_trainable), x, state)
        return jnp.mean((pred - y) ** 2), jax.lax.stop_gradient(state)

    @jax.jit
    def train_step(params, opt_state, state, x, y):
        trainable, non_trainable = params.split()
        (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(
            trainable, non_trainable, state, x, y
        )
        updates, opt_state = tx.update(grads, opt_state, trainable)
        trainable = optax.apply_updates(trainable, updates)
        return trainable.merge(non_trainable), opt_state, state, loss

    @jax.jit
    def evaluate(params, x, y):
        (pred, _), _ = model(params, x)  # the whole stream in one pass
        return jnp.mean((pred - y) ** 2)

    naive = float(np.mean((x_test - y_test) ** 2))
    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(
        f"{n} streams of {length} steps, chunks of {chunk} (truncated BPTT, state carried), "
        f"LSTM hidden {hidden}, {epochs} epochs"
    )
    print(f"naive 'repeat the last observation' test mse {naive:.4f}")
    t0 = time.perf_counter()
    for epoch in range(1, epochs + 1):
        state, _ = model.initial_state(params, x_train[:, 0])  # streams start afresh
        losses = []
        for k in range(chunks_per_epoch):
            sl = slice(k * chunk, (k + 1) * chunk)
            params, opt_state, state, loss = train_step(
                params, opt_state, state, x_train[:, sl], y_train[:, sl]
            )
            losses.append(loss)
        train_loss = float(jnp.mean(jnp.stack(losses)))
        test = float(evaluate(params, x_test, y_test))
        print(f"epoch {epoch:3d}  loss {train_loss:.4f}  test mse {test:.4f}")
    elapsed = time.perf_counter() - t0
    print(f"{epochs} epochs in {elapsed:.1f} s")
    final = float(evaluate(params, x_test, y_test))
    print(f"final test mse {final:.4f} (naive {naive:.4f}, noise variance {NOISE**2:.4f})")
    return final


if __name__ == "__main__":
    main()
