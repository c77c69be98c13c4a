"""``python -m blox.launch -n N [--devices-per-process K] SCRIPT [ARGS...]``: run SCRIPT as N
processes of one ``jax.distributed`` group on this machine (see `blox.distributed.launch`
and docs/multihost.md)."""

import sys

from blox.distributed._launch import main

if __name__ == "__main__":
    sys.exit(main())
