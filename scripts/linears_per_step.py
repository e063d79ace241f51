"""Times all the linears of one decode step of a bf16 model with the ``bf16w`` kernel, per row count.

Every ``nn.Linear`` of the model (all layers and the LM head) is multiplied by ``rows`` float32 rows
with :func:`beaconkv.kernels.bf16w.bf16w_linear`, in the model's order, so each weight is read from
memory as in a real step. Prints the best of ``--repeats`` passes per row count and the row-tokens per
second the linears alone allow: the ceiling of a decode step of that many rows on this CPU.

    python scripts/linears_per_step.py --rows 1,4,8,14,16 --threads 2
"""

from __future__ import annotations

import argparse
import time

import torch

from beaconkv.kernels.bf16w import bf16w_linear, bf16w_status
from beaconkv.models.embedded import embedded_model_path
from beaconkv.models.loading import load_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="checkpoint folder or hub id (default: the embedded model)")
    parser.add_argument("--rows", default="1,4,8,14,16", help="row counts, comma-separated (default 1,4,8,14,16)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    parser.add_argument("--repeats", type=int, default=3, help="passes per row count; the best counts (default 3)")
    args = parser.parse_args()
    reason = bf16w_status()
    if reason is not None:
        raise SystemExit(f"the bf16w kernel is unavailable here: {reason}")
    if args.threads:
        torch.set_num_threads(args.threads)
    model = load_model(args.model or embedded_model_path(), dtype=torch.bfloat16)
    weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
    params = sum(w.numel() for w in weights)
    rows_list = [int(r) for r in args.rows.split(",")]
    best = {r: float("inf") for r in rows_list}
    for _ in range(args.repeats):  # interleaved, so that a slow moment of the machine hits every count
        for rows in rows_list:
            xs = {w.shape[1]: torch.randn(rows, w.shape[1]) for w in weights}
            for w in weights[:8]:  # warm the code paths
                bf16w_linear(xs[w.shape[1]], w)
            t0 = time.perf_counter()
            for w in weights:
                bf16w_linear(xs[w.shape[1]], w)
            best[rows] = min(best[rows], time.perf_counter() - t0)
    print(f"{len(weights)} linears, {params / 1e6:.1f}M weights, {torch.get_num_threads()} thread(s)")
    print("| rows | linears ms/step | row-tokens/s, linears only | GFLOP/s |")
    print("|---:|---:|---:|---:|")
    for rows in rows_list:
        s = best[rows]
        print(f"| {rows} | {1e3 * s:.1f} | {rows / s:.0f} | {2 * params * rows / s / 1e9:.0f} |")


if __name__ == "__main__":
    main()
