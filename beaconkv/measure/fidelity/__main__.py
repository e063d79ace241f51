"""``python -m beaconkv.measure.fidelity``: the same as ``beaconkv fidelity``."""

import sys

from ...command import module_main
from .cli import add_fidelity_arguments, run_fidelity

if __name__ == "__main__":
    sys.exit(module_main("fidelity", add_fidelity_arguments, run_fidelity))
