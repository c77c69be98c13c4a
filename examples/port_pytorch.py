"""Port a small PyTorch model's weights into blox and check that the outputs match.

    pip install torch          # PyTorch is only needed for this example (and the tests)
    python examples/port_pytorch.py --size tiny

The model (a tiny CRNN) uses the layers weights are most often ported for: a ``Conv2d``,
a ``BatchNorm2d`` (running statistics become non-trainable blox params), an ``LSTM`` and a
``LayerNorm`` + ``Linear`` head. The port is three steps:

1. build the same model in blox and initialize it (``jax.eval_shape`` would do too) to get
   the target params and their paths;
2. rearrange the PyTorch ``state_dict`` into nested dicts keyed by those paths, changing
   layouts where the frameworks differ (``Linear``: ``(out, in)`` -> ``(in, out)``;
   ``Conv2d``: ``(O, I, kh, kw)`` -> ``(kh, kw, I, O)`` and NCHW inputs -> NHWC; ``LSTM``:
   gates ``i, f, g, o`` -> ``i, g, f, o``, one ``[x, h]`` kernel and one summed bias);
3. ``bx.ckpt.import_params(tree, like=params)`` checks every path, shape and dtype and
   returns params with the model's trainable flags and metadata.

It then runs both models in evaluation mode on the same input and prints the largest
difference (float32: about 1e-6).
"""

from __future__ import annotations

import argparse
import sys

import jax
import jax.numpy as jnp
import numpy as np

import blox as bx
from blox import ckpt

SIZES = {"tiny": (2, 8, 6, 8, 16), "default": (8, 16, 24, 32, 64)}  # B, H, W(=T), C, hidden
CLASSES = 5


def _torch():
    try:
        import torch
    except ImportError:
        print(
            "This example needs PyTorch (a test-only dependency of blox). Install the CPU "
            "build with:\n    pip install torch --index-url https://download.pytorch.org/whl/cpu",
            file=sys.stderr,
        )
        raise SystemExit(2) from None
    return torch


def torch_model(torch, channels: int, hidden: int):
    """The PyTorch model: conv -> batch norm -> ReLU -> mean over height -> LSTM over width
    -> layer norm -> linear, on NCHW images."""
    nn = torch.nn

    class CRNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = nn.Conv2d(3, channels, 3, padding=1)
            self.bn = nn.BatchNorm2d(channels)
            self.lstm = nn.LSTM(channels, hidden, batch_first=True)
            self.norm = nn.LayerNorm(hidden)
            self.head = nn.Linear(hidden, CLASSES)

        def forward(self, x):  # x: (B, 3, H, W)
            h = torch.relu(self.bn(self.conv(x)))
            seq = h.mean(dim=2).permute(0, 2, 1)  # (B, W, C): the width is the time axis
            out, _ = self.lstm(seq)
            return self.head(self.norm(out[:, -1]))

    return CRNN()


def blox_model(channels: int, hidden: int):
    """The same model in blox (channels-last)."""
    g = bx.Graph("crnn")
    rng = bx.Rng(g / "rng")  # only for initialization (replaced by the ported weights)
    conv = bx.Conv(g / "conv", (3, 3), channels, rng, padding="SAME")
    bn = bx.BatchNorm(g / "bn")
    lstm = bx.LSTM(g / "lstm", hidden, rng)
    norm = bx.LayerNorm(g / "norm")
    head = bx.Linear(g / "head", CLASSES, rng)

    def apply(params, x, is_training=False):  # x: (B, H, W, 3)
        h, params = conv(params, x)
        h, params = bn(params, h, is_training=is_training)
        seq = jnp.mean(jax.nn.relu(h), axis=1)  # (B, W, C)
        (out, _), params = lstm.apply(params, seq)
        y, params = norm(params, out[:, -1])
        return head(params, y)

    return apply, rng


def _lstm_kernel(w_ih: np.ndarray, w_hh: np.ndarray) -> np.ndarray:
    """PyTorch ``(4H, F)``, ``(4H, H)`` in gate order i, f, g, o -> blox ``(F + H, 4H)``
    in gate order i, g, f, o."""
    order = (0, 2, 1, 3)
    ih, hh = np.split(w_ih, 4), np.split(w_hh, 4)
    return np.concatenate(
        [
            np.concatenate([ih[j].T for j in order], axis=1),
            np.concatenate([hh[j].T for j in order], axis=1),
        ],
        axis=0,
    )


def _lstm_bias(b: np.ndarray) -> np.ndarray:
    parts = np.split(b, 4)
    return np.concatenate([parts[j] for j in (0, 2, 1, 3)])


def convert(state_dict: dict[str, np.ndarray]) -> dict:
    """The PyTorch ``state_dict`` (as NumPy) -> nested dicts keyed by the blox paths."""
    sd = state_dict
    return {
        "crnn": {
            "conv": {"kernel": sd["conv.weight"].transpose(2, 3, 1, 0), "bias": sd["conv.bias"]},
            "bn": {
                "scale": sd["bn.weight"],
                "bias": sd["bn.bias"],
                "running_mean": sd["bn.running_mean"],
                "running_var": sd["bn.running_var"],
            },
            "lstm": {
                "gates": {
                    "kernel": _lstm_kernel(sd["lstm.weight_ih_l0"], sd["lstm.weight_hh_l0"]),
                    "bias": _lstm_bias(sd["lstm.bias_ih_l0"] + sd["lstm.bias_hh_l0"]),
                }
            },
            "norm": {"scale": sd["norm.weight"], "bias": sd["norm.bias"]},
            "head": {"kernel": sd["head.weight"].T, "bias": sd["head.bias"]},
        }
    }


def main(argv: list[str] | None = None) -> float:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="default")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    torch = _torch()
    b, h, w, c, hidden = SIZES[args.size]

    torch.manual_seed(args.seed)
    ref = torch_model(torch, c, hidden)
    with torch.no_grad():  # non-trivial running statistics, as after training
        ref.bn.running_mean.uniform_(-0.5, 0.5)
        ref.bn.running_var.uniform_(0.5, 2.0)
    ref.eval()
    x = np.random.default_rng(args.seed).standard_normal((b, 3, h, w)).astype(np.float32)
    with torch.no_grad():
        y_ref = ref(torch.from_numpy(x)).numpy()

    apply, rng = blox_model(c, hidden)
    x_nhwc = x.transpose(0, 2, 3, 1)
    # The target: paths, shapes, dtypes, flags (eval_shape: nothing is computed).
    like = jax.eval_shape(lambda: apply(rng.seed(bx.Params(), seed=0), x_nhwc)[1]).locked()
    weights = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    tree = convert(weights)
    tree["crnn"]["rng"] = {"seed": np.zeros(2, np.uint32), "counter": np.zeros((), np.uint32)}
    params = ckpt.import_params(tree, like=like)
    y, _ = jax.jit(apply)(params, x_nhwc)

    err = float(np.max(np.abs(np.asarray(y) - y_ref)))
    print(f"ported {len(params)} arrays from PyTorch {torch.__version__}:")
    print(bx.params_table(params))
    print(f"outputs {y.shape}: max |blox - torch| = {err:.2e}")
    return err


if __name__ == "__main__":
    main()
