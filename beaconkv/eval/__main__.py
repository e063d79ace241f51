"""``python -m beaconkv.eval ...`` and ``torchrun --nproc-per-node N -m beaconkv.eval ...``."""

from __future__ import annotations

import argparse
import sys

from beaconkv.eval.cli import add_eval_arguments, run_eval_from_args


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the evaluation.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status.
    """
    parser = argparse.ArgumentParser(
        prog="python -m beaconkv.eval",
        description="Evaluate a reasoning model with a compressed KV cache on a benchmark.",
    )
    add_eval_arguments(parser)
    return run_eval_from_args(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
