"""The tensor-parallel device check: NCCL over the GPUs when the machine has enough of them, else it says it skipped.

``python -m beaconkv.measure.distributed_check`` (what a GPU check script runs) saves a small random Qwen3
checkpoint — 8 query and 2 KV heads, so 2 ranks split the KV heads and 4 replicate them — generates with
it in one process, then with ``--ranks`` ranks (NCCL on ``cuda:0 .. ranks-1``, or gloo with ``--device cpu``),
for BeaconKV, SnapKV and a head-adaptive SnapKV, and compares the greedy tokens and every eviction's kept
positions per KV head. It prints one line per policy and exits 1 on a mismatch; on a machine with fewer
GPUs than ranks it prints ``tensor parallelism: skipped (...)`` and exits 0, so a single-GPU check still
states that this part did not run.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from ..models.config import ModelConfig, RopeConfig
from ..models.random_weights import random_model

__all__ = ["CHECK_CONFIG", "main", "run_check", "save_random_checkpoint"]

CHECK_CONFIG = ModelConfig(
    model_type="qwen3", vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
    num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, qk_norm=True,
    tie_word_embeddings=False, rope=RopeConfig(theta=1e6),
)
"""The check's model: Qwen3's quirks (q/k norms, ``head_dim`` unequal to ``hidden / heads``), an untied head."""


def save_random_checkpoint(config: ModelConfig, directory: str | Path, seed: int = 0, scale: float = 10.0) -> Path:
    """Writes a checkpoint of ``config`` with random weights (``model.safetensors`` and ``config.json``).

    Args:
        config: The architecture.
        directory: Where to write (made if missing).
        seed: Seed of the weights.
        scale: Multiplies the weights of :func:`~beaconkv.models.random_weights.random_model` (``N(0, 0.02)``),
            so that logits are far apart and a greedy token does not hang on rounding.

    Returns:
        The directory.
    """
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    model = random_model(config, torch.float32, "cpu", seed)
    tensors = {name: (t if "norm" in name else t * scale).contiguous() for name, t in model.state_dict().items()
               if not (name == "lm_head.weight" and config.tie_word_embeddings)}
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    c = config
    raw = {"model_type": c.model_type, "vocab_size": c.vocab_size, "hidden_size": c.hidden_size,
           "intermediate_size": c.intermediate_size, "num_hidden_layers": c.num_hidden_layers,
           "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
           "head_dim": c.head_dim, "rms_norm_eps": c.rms_norm_eps, "max_position_embeddings": c.max_position_embeddings,
           "tie_word_embeddings": c.tie_word_embeddings, "attention_bias": c.attention_bias,
           "rope_theta": c.rope.theta, "hidden_act": "silu"}
    (directory / "config.json").write_text(json.dumps(raw, indent=1), encoding="utf-8")
    return directory


def run_check(device: str, ranks: int, log: Callable[[str], None] = print, max_new_tokens: int = 96,
              threads: int | None = None, budget: int = 64) -> bool:
    """Generates with one process and with ``ranks`` ranks; True when every policy evicted and its tokens and kept
    positions match.

    Args:
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL, ranks on ``cuda:0 ..``).
        ranks: The tensor-parallel size.
        log: Where each line goes.
        max_new_tokens: New tokens per prompt.
        threads: torch CPU threads of every rank (None: torch's default).
        budget: The policies' budget (64 evicts within 96 new tokens; the CPU rehearsal's 16 within 24).
    """
    import beaconkv
    from beaconkv import BeaconKV, HeadAdaptive, SnapKV

    from ..distributed.group import backend_for
    from ..distributed.launch import TensorParallelRun

    policies = {f"BeaconKV({budget})": lambda: BeaconKV(budget, telemetry=True),
                f"SnapKV({budget})": lambda: SnapKV(budget, telemetry=True),
                f"SnapKV({budget}, head_adaptive)": lambda: SnapKV(budget, allocation=HeadAdaptive(), telemetry=True)}
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, CHECK_CONFIG.vocab_size, (n,), generator=g).tolist() for n in (40, 17, 65)]
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        path = save_random_checkpoint(CHECK_CONFIG, tmp)
        whole = beaconkv.load_model(path, device=device)
        want = {name: beaconkv.generate(whole, None, prompts, max_new_tokens=max_new_tokens, policy=make())
                for name, make in policies.items()}
        del whole
        t0 = time.perf_counter()
        with TensorParallelRun(path, ranks, device=device, threads=threads) as run:
            log(f"tensor parallelism: {ranks} ranks on {device} ({backend_for(device)}) started in "
                f"{time.perf_counter() - t0:.1f}s; {run.model.shard_plan.describe()}")
            for name, make in policies.items():
                got = beaconkv.generate(run.model, None, prompts, max_new_tokens=max_new_tokens, policy=make())
                same_tokens = got.token_ids == want[name].token_ids
                pairs = list(zip(got.telemetry, want[name].telemetry))
                same_kept = len(got.telemetry) == len(want[name].telemetry) and all(
                    torch.equal(a.kept_positions, b.kept_positions) for a, b in pairs)
                evicted = len(got.telemetry) > 0  # no eviction: no kept positions compared, a check that proves little
                ok &= same_tokens and same_kept and evicted
                log(f"  {name}: tokens {'equal' if same_tokens else 'DIFFER'}, kept positions "
                    f"{'equal' if same_kept else 'DIFFER'} over {len(got.telemetry)} layer evictions"
                    f"{'' if evicted else ' (NONE: raise --max-new-tokens or lower --budget)'}, "
                    f"{got.stats.tokens_per_s:.0f} tokens/s")
    return ok


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m beaconkv.measure.distributed_check [--device cuda|cpu] [--ranks N] [--max-new-tokens N] [--threads N]``;
    0 when it passed or skipped."""
    parser = argparse.ArgumentParser(prog="python -m beaconkv.measure.distributed_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cuda: NCCL over the GPUs (default); cpu: gloo, every rank on this CPU")
    parser.add_argument("--ranks", type=int, default=2, help="tensor-parallel size (default 2; 4 replicates the KV "
                                                                "heads)")
    parser.add_argument("--max-new-tokens", type=int, default=96, help="new tokens per prompt (default 96)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads of every rank (default: torch's)")
    parser.add_argument("--budget", type=int, default=64, help="the policies' budget (default 64)")
    args = parser.parse_args(argv)
    if args.device == "cuda":
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < args.ranks:
            print(f"tensor parallelism: skipped ({gpus} GPU(s) here, {args.ranks} needed for NCCL over {args.ranks} "
                  "ranks; the gloo tests of make test cover the CPU)")
            return 0
    ok = run_check(args.device, args.ranks, max_new_tokens=args.max_new_tokens, threads=args.threads,
                   budget=args.budget)
    print("tensor parallelism: " + ("passed" if ok else "FAILED: the ranks disagree with one process, or no "
                                    "eviction to compare (the lines above say which)"))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
