"""A character-level transformer language model trained on Python's own standard library.

    python examples/char_lm.py                         # a few minutes on 2 CPUs
    python examples/char_lm.py --size tiny --steps 40  # seconds (smoke test)

The text is the source code of a few standard-library modules, read from the Python
installation (``inspect.getsource``): no downloads. What it shows: `bx.TransformerLM`
(pre-norm blocks, rotary positions, tied embeddings), the split/grad/merge train step with
Optax and dropout driven by the `bx.Rng` in params, then sampling a continuation with the
KV cache: the cache lives in params as non-trainable state, so one decoding step is just
``logits, params = lm(params, token, decode=True)``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import blox as bx

MODULES = ["textwrap", "string", "bisect", "heapq", "fractions", "difflib", "shlex", "pprint"]
# Printable ASCII plus newline; anything else becomes a space.
CHARS = "\n" + "".join(chr(c) for c in range(32, 127))
SIZES = {
    # name: (width, layers, heads, context, batch, steps, learning rate)
    "tiny": (32, 1, 2, 32, 8, 40, 3e-3),
    "default": (128, 2, 4, 96, 32, 500, 3e-3),
}


def load_text() -> str:
    """The source of a few stdlib modules (shipped with every Python install)."""
    return "\n\n".join(inspect.getsource(importlib.import_module(m)) for m in MODULES)


def encode(text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(CHARS)}
    return np.array([index.get(c, 1) for c in text], dtype=np.int32)  # 1 is ' '


def decode(ids) -> str:
    return "".join(CHARS[int(i)] for i in ids)


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--steps", type=int, default=None, help="override the step count")
    parser.add_argument("--sample", type=int, default=200, help="characters to generate")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    width, layers, heads, context, batch, steps, lr = SIZES[args.size]
    steps = args.steps or steps

    data = encode(load_text())
    split = int(0.9 * len(data))
    train_data, val_data = data[:split], data[split:]
    print(f"blox {bx.__version__} | jax {jax.__version__} | {jax.devices()[0].platform}")
    print(f"text: {len(data)} characters from {len(MODULES)} stdlib modules, vocab {len(CHARS)}")

    graph = bx.Graph("charlm")
    rng = bx.Rng(graph / "rng")
    lm = bx.TransformerLM(
        graph / "lm",
        vocab_size=len(CHARS),
        model_size=width,
        num_layers=layers,
        num_heads=heads,
        rng=rng,
        dropout_rate=0.1,
    )
    params = rng.seed(bx.Params(), seed=args.seed)
    _, params = lm(params, jnp.zeros((1, context), jnp.int32), is_training=False)
    params = params.locked()
    n_weights = sum(p.value.size for p in params.split()[0].values())
    print(f"model: {layers} blocks, width {width}, {heads} heads, {n_weights} weights")

    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(lr, weight_decay=0.01))
    opt_state = tx.init(params.split()[0])

    def loss_fn(trainable, rest, x, y, is_training):
        logits, params = lm(trainable.merge(rest), x, is_training=is_training)
        ll = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.mean(jnp.take_along_axis(ll, y[..., None], axis=-1))
        return nll, params.split()[1]  # the advanced Rng counter

    @jax.jit(donate_argnums=(0, 1))
    def train_step(params, opt_state, x, y):
        trainable, rest = params.split()
        (loss, rest), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable, rest, x, y, True)
        updates, opt_state = tx.update(grads, opt_state, trainable)
        return optax.apply_updates(trainable, updates).merge(rest), opt_state, loss

    @jax.jit
    def eval_loss(params, x, y):
        trainable, rest = params.split()
        return loss_fn(trainable, rest, x, y, False)[0]

    data_rng = np.random.default_rng(args.seed)

    def batch_from(source):
        starts = data_rng.integers(0, len(source) - context - 1, size=batch)
        chunk = np.stack([source[s : s + context + 1] for s in starts])
        return jnp.asarray(chunk[:, :-1]), jnp.asarray(chunk[:, 1:])

    losses = []
    report = max(1, steps // 10)
    t0 = time.perf_counter()
    running = []
    for step in range(1, steps + 1):
        x, y = batch_from(train_data)
        params, opt_state, loss = train_step(params, opt_state, x, y)
        print(f"step={step} loss={float(loss)!r}")  # the examples' contract (SPEC section 7)
        running.append(loss)
        if step % report == 0 or step == steps:
            mean = float(jnp.mean(jnp.stack(running)))
            running = []
            losses.append(mean)
            print(f"step {step:5d}  loss {mean:.4f}  ({time.perf_counter() - t0:.1f} s)")
    val = float(np.mean([eval_loss(params, *batch_from(val_data)) for _ in range(4)]))
    print(f"validation loss {val:.4f} (uniform guess: {np.log(len(CHARS)):.4f})")

    # Sampling with the KV cache: prefill the prompt, then one token per jitted call.
    prompt = "def "
    total = len(prompt) + args.sample
    params = lm.init_cache(params, batch_size=1, max_length=total)

    @jax.jit
    def next_token(params, tokens, key):
        logits, params = lm(params, tokens, decode=True, is_training=False)
        return jax.random.categorical(key, logits[:, -1] / 0.8), params

    key = jax.random.key(args.seed + 1)
    token, params = next_token(params, jnp.asarray(encode(prompt))[None], key)
    out = [int(token[0])]
    for _ in range(args.sample - 1):
        key, sub = jax.random.split(key)
        token, params = next_token(params, token[:, None], sub)
        out.append(int(token[0]))
    print(f"cache holds {int(lm.cache_index(params))} of {total} positions")
    print("sample:\n" + prompt + decode(out))
    return losses


if __name__ == "__main__":
    main()
