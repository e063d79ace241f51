"""Recorded CUDA graphs and compiled decode against eager on one batch: ms per step, token agreement, evictions.

Where the CUDA default is decided: the eager step recorded as CUDA graphs (``graphs``, the default on CUDA: no code
generation) against ``torch.compile``'s shapes, which must measure faster to replace it. The last stage of
``scripts/gpu_check.sh`` (``graph_vs_compile``; inductor's cold compiles take minutes, so it runs when the deadline
leaves room); on a CPU (``--smoke``) the same code runs with a tiny model, the graphs through the op-replay
recorder, to prove that the stage works. For each policy (FullKV and BeaconKV) the batch is decoded eagerly once,
then, for each shape of ``--compile-shapes`` in turn (``graphs``: the eager step and evictions recorded as CUDA
graphs; ``regions``: one compiled graph whose layers are one nested compile region, compiled from one layer;
``whole``: one compiled graph with every layer traced; see :class:`~beaconkv.execution.CompileConfig`), twice (the
second run is warm: no compile or recording time in its figure), and one line is printed as soon as it is
measured, so a shape whose compile outlasts the time left still leaves the lines of the shapes before it::

    BeaconKV(128) [regions]: eager 21.40 ms/step, compiled 6.10 ms/step (3.5x), first compile 41.2 s, 8/8 sequences identical to eager, 16 compiled evictions

Run ``python -m beaconkv.measure.speed.graph_decode --help`` for the options.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from ...arguments import model_path
from ...execution import CompileConfig
from ...generation import GenerationOutput, generate
from ...models.decoder import CausalLM
from ...models.loading import load_model
from ...models.random_weights import RANDOM_SHAPES, random_model
from ...policies.beacon import BeaconKV
from .compile_time import shape_compile_config
from .machine import DTYPES, random_prompts

__all__ = ["GraphDecodeRow", "graph_decode_configs", "main", "measure_graph_decode"]

GRAPHS = "graphs"
"""The shape name of the recorded CUDA graphs (:class:`~beaconkv.execution.GraphExecutor`)."""


def graph_decode_configs(shapes: str, backend: str = "inductor", recorder: str = "cuda") -> dict[str, CompileConfig]:
    """The execution of each comma-separated shape name: ``graphs`` (recorded CUDA graphs, through ``recorder``),
    or a compiled shape (:func:`~beaconkv.measure.speed.compile_time.shape_compile_config`) with ``backend``.

    Raises:
        ValueError: An unknown shape name.
    """
    configs = {}
    for shape in (s.strip() for s in shapes.split(",")):
        if not shape:
            continue
        if shape == GRAPHS:
            configs[shape] = CompileConfig(strategy="graphs", recorder=recorder)
            continue
        try:
            configs[shape] = dataclasses.replace(shape_compile_config(shape, backend), strategy="compile")
        except ValueError as err:
            raise ValueError(f"{err} Or '{GRAPHS}': the eager step recorded as CUDA graphs.") from err
    return configs


@dataclass(frozen=True)
class GraphDecodeRow:
    """One policy's figures.

    Attributes:
        policy: ``"FullKV"`` or ``"BeaconKV(<budget>)"``.
        shape: The decode step's execution (``"graphs"``, ``"regions"``, ``"whole"``; a name of ``--compile-shapes``).
        eager_ms: Eager decode, ms per step (prefill excluded).
        compiled_ms: Warm decode in that shape (recorded graphs replayed, or compiled), ms per step.
        identical: Sequences whose tokens equal the eager run's.
        batch: Sequences decoded.
        compiled_evictions: Evictions that ran as compiled graphs in the warm run.
        compile_s: Seconds the first run in this shape spent compiling or recording graphs (graphs that an earlier
            run in the process compiled with the same settings are reused, not counted).
    """

    policy: str
    shape: str
    eager_ms: float
    compiled_ms: float
    identical: int
    batch: int
    compiled_evictions: int
    compile_s: float

    def line(self) -> str:
        """The summary line (see the module docstring)."""
        return (f"{self.policy} [{self.shape}]: eager {self.eager_ms:.2f} ms/step, compiled {self.compiled_ms:.2f} "
                f"ms/step ({self.eager_ms / self.compiled_ms:.1f}x), first compile {self.compile_s:.1f} s, "
                f"{self.identical}/{self.batch} sequences identical to eager, {self.compiled_evictions} compiled "
                "evictions")


def _ms_per_step(out: GenerationOutput) -> float:
    s = out.stats
    return 1e3 * (s.wall_time_s - s.prefill_s) / max(s.decode_steps, 1)


def measure_graph_decode(model: CausalLM, batch: int, prompt_tokens: int, new_tokens: int, budget: int,
                         compile_configs: dict[str, CompileConfig], n_recent: int = 16) -> Iterator[GraphDecodeRow]:
    """Eager once, then compiled twice per shape, for FullKV and ``BeaconKV(budget)``: one row per shape and policy,
    yielded as soon as it is measured (shapes in the order given, FullKV first in each).

    Args:
        model: The model.
        batch: Sequences decoded together.
        prompt_tokens: Length of each random prompt.
        new_tokens: Tokens each sequence generates (no stop token).
        budget: BeaconKV's budget.
        compile_configs: The compile settings of each shape, by its name (on a GPU each replays as CUDA graphs).
        n_recent: BeaconKV's ``n_recent`` (and ``n_beacon``).
    """
    prompts = random_prompts(batch, prompt_tokens, model.config.vocab_size)
    policies = {"FullKV": lambda: None,
                f"BeaconKV({budget})": lambda: BeaconKV(budget, n_recent=n_recent, n_beacon=n_recent)}

    def run(make: Callable[[], BeaconKV | None], config: CompileConfig | bool) -> GenerationOutput:
        return generate(model, None, prompts, max_new_tokens=new_tokens, eos_token_ids=[], policy=make(),
                        compile=config, kernels="model")

    eager = {label: run(make, False) for label, make in policies.items()}
    for shape, config in compile_configs.items():
        for label, make in policies.items():
            first, warm = run(make, config), run(make, config)  # the second compiled run is warm
            same = sum(a == b for a, b in zip(eager[label].token_ids, warm.token_ids))
            yield GraphDecodeRow(label, shape, _ms_per_step(eager[label]), _ms_per_step(warm), same, batch,
                                 warm.stats.compiled_evictions, first.stats.compile_s)


def main(argv: list[str] | None = None) -> int:
    """``python -m beaconkv.measure.speed.graph_decode``: prints one line per policy."""
    parser = argparse.ArgumentParser(prog="python -m beaconkv.measure.speed.graph_decode",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="embedded",
                        help=f"'embedded', a checkpoint, or a random shape: {', '.join(RANDOM_SHAPES)}")
    parser.add_argument("--dtype", default="bf16", choices=sorted(DTYPES), help="model dtype (default bf16)")
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    parser.add_argument("--batch", type=int, default=8, help="sequences (default 8)")
    parser.add_argument("--prompt-tokens", type=int, default=64, help="prompt length (default 64)")
    parser.add_argument("--new-tokens", type=int, default=256, help="tokens generated (default 256)")
    parser.add_argument("--budget", type=int, default=128, help="BeaconKV's budget (default 128)")
    parser.add_argument("--n-recent", type=int, default=16, help="BeaconKV's n_recent and n_beacon (default 16)")
    parser.add_argument("--compile-backend", default="inductor",
                        help="torch.compile backend (default inductor: CUDA graphs on a GPU; aot_eager checks the "
                             "graphs quickly)")
    parser.add_argument("--compile-shapes", default="graphs,regions,whole",
                        help="decode-step executions, in this order: graphs (the eager step recorded as CUDA graphs: "
                             "the CUDA default), regions (one compiled graph, its layers one nested compile region: "
                             "compiles from one layer), whole (every layer traced), layerwise (a compiled graph per "
                             "layer, no CUDA graphs) (default graphs,regions,whole)")
    parser.add_argument("--recorder", default=None, choices=("cuda", "op_replay"),
                        help="what records the graphs shape (default: cuda on a GPU, op_replay on a CPU)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    try:
        configs = graph_decode_configs(args.compile_shapes, args.compile_backend,
                                       args.recorder or ("cuda" if device.type == "cuda" else "op_replay"))
    except ValueError as err:
        parser.error(str(err))
    dtype = DTYPES[args.dtype]
    if args.model in RANDOM_SHAPES:
        model = random_model(RANDOM_SHAPES[args.model](), dtype, device)
    else:
        model = load_model(model_path(args.model), dtype=dtype, device=device)
    for row in measure_graph_decode(model, args.batch, args.prompt_tokens, args.new_tokens, args.budget, configs,
                                    n_recent=args.n_recent):
        print(row.line(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
