"""System identification of a Wiener-Hammerstein-like system (linear filter, static
saturation, linear filter) driven by band-limited Gaussian noise: GRU, LSTM, TCN and CRNN
against a least-squares ARX baseline, evaluated by free-run simulation.

    python examples/sysid_wiener_hammerstein.py              # default size
    python examples/sysid_wiener_hammerstein.py --size tiny  # seconds (the smoke test)
    python examples/sysid_wiener_hammerstein.py --epochs 10 --batches-per-epoch 300

The budget is ``--steps`` per model, or ``--epochs`` of ``--batches-per-epoch`` batches
(default: one pass over the training windows), validated at each epoch's end.

Same recipe and flags as examples/sysid_silverbox.py (which holds the shared code):
the data is simulated and written to contiguous HDF5 under ``--data`` (default
``runs/sysid_wiener_hammerstein_<size>``), one ``step=<n> loss=<loss>`` line per GRU
training step, then the free-run test table and PNG plots.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sysid_silverbox import SIZES as SILVERBOX_SIZES  # noqa: E402  (next to this file)
from sysid_silverbox import run  # noqa: E402  (the shared recipe)

# The Silverbox sizes; the default one differs in window, stride, steps and ARX lags.
SIZES = {
    "tiny": SILVERBOX_SIZES["tiny"],
    "default": dict(SILVERBOX_SIZES["default"], window=500, stride=25, steps=2000, na=10, nb=10),
}


def main(argv: list[str] | None = None) -> dict[str, float]:
    return run("wiener_hammerstein", argv, SIZES, description=__doc__)


if __name__ == "__main__":
    main()
