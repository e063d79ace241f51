"""``python -m beaconkv.measure.speed``: the same as ``beaconkv bench``."""

import sys

from ...command import module_main
from .cli import add_bench_arguments, run_bench

if __name__ == "__main__":
    sys.exit(module_main("bench", add_bench_arguments, run_bench))
