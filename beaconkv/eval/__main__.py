"""``python -m beaconkv.eval ...`` and ``torchrun --nproc-per-node N -m beaconkv.eval ...``.

The same command as ``beaconkv eval``, run through :func:`beaconkv.command.module_main`: wrong
input is one line ``beaconkv eval: error: ...`` with exit status 2 (``--debug`` shows the
traceback). Under ``torchrun`` every rank runs this module; the runner reads the rank from the
environment (:mod:`beaconkv.eval.distributed`).
"""

from __future__ import annotations

import sys

from ..command import module_main
from .cli import add_eval_arguments, run_eval_from_args


def main(argv: list[str] | None = None) -> int:
    """Parse the command line and run the evaluation.

    Args:
        argv: Arguments without the program name (default: ``sys.argv[1:]``).

    Returns:
        The exit status: 0, 2 after wrong input, 130 when interrupted.
    """
    return module_main("eval", add_eval_arguments, run_eval_from_args, argv)


if __name__ == "__main__":
    sys.exit(main())
