"""System identification of a Wiener-Hammerstein-like system (linear filter, static
saturation, linear filter) driven by band-limited Gaussian noise: GRU, LSTM, TCN and CRNN
against a least-squares ARX baseline, evaluated by free-run simulation.

    python examples/sysid_wiener_hammerstein.py              # default size
    python examples/sysid_wiener_hammerstein.py --size tiny  # seconds (the smoke test)

Same recipe and flags as examples/sysid_silverbox.py (which holds the shared code):
the data is simulated and written to contiguous HDF5 under ``--data`` (default
``runs/sysid_wiener_hammerstein_<size>``), one ``step=<n> loss=<loss>`` line per GRU
training step, then the free-run test table and PNG plots.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sysid_silverbox import run  # noqa: E402  (the shared recipe, next to this file)

SIZES = {
    "tiny": dict(
        window=128,
        chunk=64,
        stride=32,
        batch=8,
        hidden=16,
        channels=8,
        steps=12,
        n_skip=16,
        na=4,
        nb=4,
        models=("gru",),
    ),  # fmt: skip
    "default": dict(
        window=500,
        chunk=250,
        stride=25,
        batch=32,
        hidden=64,
        channels=32,
        steps=2000,
        n_skip=50,
        na=10,
        nb=10,
        models=("gru", "lstm", "tcn", "crnn"),
    ),  # fmt: skip
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    return run("wiener_hammerstein", argv, SIZES)


if __name__ == "__main__":
    main()
