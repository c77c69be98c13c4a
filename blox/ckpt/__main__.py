"""``python -m blox.ckpt verify DIR [--step N]``: check a checkpoint without a model.

Prints `blox.ckpt.verify`'s table (step, leaves, bytes, status, detail). Exit status: 0
when every step checked is ok, 1 when one is corrupted, damaged or unverified, 2 for a
usage error (no such directory or step).
"""

from __future__ import annotations

import argparse
import sys

from blox.ckpt._verify import verify


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m blox.ckpt", description="Checkpoint tools of blox.ckpt."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    check = commands.add_parser(
        "verify",
        help="check every leaf of every step against its checksum (no model needed)",
        description="Reads every leaf of each committed step and compares it with the "
        "checksum saved with it. Exit status 0: all ok; 1: a step is corrupted, damaged "
        "or unverified; 2: usage error.",
    )
    check.add_argument("directory", help="the checkpoint root directory")
    check.add_argument("--step", type=int, default=None, help="only this step")
    args = parser.parse_args(argv)
    try:
        rows = verify(args.directory, args.step)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0 if all(r.ok for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
