"""The accuracy suite: which cells to run, running them (resumable, in worker processes), and their records.

A **cell** is one (engine, task, length, protocol, policy, budget): ``engine`` is ``"beaconkv"`` (our policies,
:mod:`~beaconkv.measure.accuracy.runner`) or ``"kvpress"`` (a kvpress press on the same token ids,
:mod:`~beaconkv.measure.accuracy.kvpress`). Budgets come from compression ratios: at compression ``c`` a
cell's budget is ``round(tokens / c)``, ``tokens`` being what the policy must compress (the context, the
question included for ``aware``; the prompt plus the decode steps for the needle in the decode), so 4x and
8x mean the same across lengths. Every policy runs with an int ``n_prefix`` (default 4), so the prompt is
evictable: with the whole prompt protected (beaconkv's default) a prompt-side task could not lose its
needle.

Records (``results.jsonl`` in the output folder, one JSON line per finished cell, with every case's
outcome) make a run resumable: a cell already recorded with the same settings is not run again (a line
torn by a kill is set aside in ``results.jsonl.torn`` and its cell runs again); a folder holding another
run's settings is refused.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from ...errors import BeaconKVError
from .runner import PROTOCOLS
from .tasks import TASKS

__all__ = ["AccuracyError", "Cell", "SuiteConfig", "cells_of", "load_records", "run_suite"]

DECODE_TASK = "decode_needle"


class AccuracyError(BeaconKVError, ValueError):
    """A bad setting of the accuracy suite, or an output folder holding another run; the message says the fix."""


@dataclass(frozen=True)
class Cell:
    """One cell of the suite (see the module docstring).

    Attributes:
        engine: ``"beaconkv"`` or ``"kvpress"``.
        task: A task of :data:`~beaconkv.measure.accuracy.tasks.TASKS`.
        length: Context tokens (decode steps for the needle in the decode).
        protocol: ``"aware"``, ``"agnostic"`` or ``"decode"``.
        policy: A beaconkv policy name, or a kvpress press.
        budget: ``B_max`` (None: FullKV, or kvpress with no press).
        compression: The compression it stands for (None with no budget).
    """

    engine: str
    task: str
    length: int
    protocol: str
    policy: str
    budget: int | None
    compression: float | None

    @property
    def key(self) -> str:
        """A stable text key (the records' index)."""
        return "|".join(str(v) for v in asdict(self).values())


@dataclass(frozen=True)
class SuiteConfig:
    """The suite's settings.

    Attributes:
        tasks: Tasks to run.
        lengths: Context lengths (tokens) of the prompt-side tasks.
        decode_lengths: Decode steps of the needle in the decode.
        compressions: Compression ratios (each cell's budget is its tokens divided by one).
        policies: beaconkv policies (registry names; ``full`` is the reference, run once per task/length/protocol).
        protocols: Protocols of the prompt-side tasks (the needle in the decode is always ``decode``).
        cases: Cases per cell.
        n_prefix: Protected leading tokens of every policy (an int: the prompt is evictable).
        prefill_chunk: Prefill in chunks of this many tokens, evicting between them (None: whole prompts).
        batch: Cases run together in one session.
        seed: The cases' seed.
        model: Checkpoint (``"embedded"``: SmolLM2-135M-Instruct).
        compare: kvpress presses run on the same cells (``()``: none).
        kvpress_python: kvpress's interpreter (None: ``.venv-kvpress``).
        policy_kwargs: More settings of some policies: name -> ``[(parameter, value), ...]`` (the command
            line's ``--policy-arg``, each key going to the policies that take it).
    """

    tasks: tuple[str, ...] = ("passkey", "multikey", "multivalue", "vartrack", DECODE_TASK)
    lengths: tuple[int, ...] = (1024, 2048, 4096, 8000)
    decode_lengths: tuple[int, ...] = (1024, 2048, 4096)
    compressions: tuple[float, ...] = (4.0, 8.0)
    policies: tuple[str, ...] = ("full", "beacon", "snapkv", "expected_attention", "triattention", "streaming")
    protocols: tuple[str, ...] = ("aware", "agnostic")
    cases: int = 50
    n_prefix: int = 4
    prefill_chunk: int | None = None
    batch: int = 10
    seed: int = 0
    model: str = "embedded"
    compare: tuple[str, ...] = ()
    kvpress_python: str | None = field(default=None, compare=False)
    policy_kwargs: dict[str, list[tuple[str, Any]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        unknown = [t for t in self.tasks if t not in TASKS]
        if unknown:
            raise AccuracyError(f"unknown tasks {unknown}; choose from {', '.join(TASKS)}")
        bad = [p for p in self.protocols if p not in PROTOCOLS[:2]]
        if bad:
            raise AccuracyError(f"protocols {bad} are not aware/agnostic (the decode task has its own)")
        for name in ("cases", "batch"):
            if getattr(self, name) < 1:
                raise AccuracyError(f"{name}={getattr(self, name)} must be >= 1")
        if any(c <= 1 for c in self.compressions):
            raise AccuracyError(f"compressions {list(self.compressions)} must all be > 1 (4 = keep a quarter)")
        if self.n_prefix < 0:
            raise AccuracyError(f"n_prefix={self.n_prefix} must be >= 0")

    def settings(self) -> dict[str, Any]:
        """What must match for a resume: everything that changes a cell's outcome."""
        out = {"cases": self.cases, "n_prefix": self.n_prefix, "prefill_chunk": self.prefill_chunk,
               "seed": self.seed, "model": self.model}
        if self.policy_kwargs:  # older runs had none: their settings stay as they were
            out["policy_kwargs"] = {k: [list(kv) for kv in v] for k, v in sorted(self.policy_kwargs.items())}
        return out


def _budget(tokens: int, compression: float) -> int:
    return max(8, round(tokens / compression))


def cell_tokens(task: str, length: int, decode_prompt: int = 48) -> int:
    """The tokens a cell's policy compresses: the context, or the needle's prompt plus the decode steps."""
    return decode_prompt + length if task == DECODE_TASK else length


def cells_of(config: SuiteConfig) -> list[Cell]:
    """Every cell of a configuration, in run order (task, length, protocol, then policies)."""
    cells = []
    for task in config.tasks:
        lengths = config.decode_lengths if task == DECODE_TASK else config.lengths
        protocols = ("decode",) if task == DECODE_TASK else config.protocols
        for length in lengths:
            for protocol in protocols:
                tokens = cell_tokens(task, length)
                for engine, names, reference in (("beaconkv", config.policies, "full"), ("kvpress", config.compare, "none")):
                    for name in names:  # the reference (no compression) once; the others at every compression
                        budgets = [(None, None)] if name == reference else [(_budget(tokens, c), c)
                                                                             for c in config.compressions]
                        cells.extend(Cell(engine, task, length, protocol, name, b, c) for b, c in budgets)
    return cells


def load_records(out_dir: Path) -> dict[str, dict[str, Any]]:
    """The finished cells recorded in ``out_dir`` (key -> record); a torn last line is ignored."""
    path = Path(out_dir) / "results.jsonl"
    records: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return records
    with path.open(encoding="utf-8") as f:
        for line in f:
            try:
                record = json.loads(line)
            except ValueError:
                continue  # a cell whose write was interrupted: it runs again
            records[Cell(**record["cell"]).key] = record
    return records


def _append(out_dir: Path, record: dict[str, Any]) -> None:
    with (out_dir / "results.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")
        f.flush()
        os.fsync(f.fileno())


def _check_settings(out_dir: Path, settings: dict[str, Any]) -> None:
    path = out_dir / "settings.json"
    if path.exists():
        theirs = json.loads(path.read_text(encoding="utf-8"))
        if theirs != settings:
            diff = {k: (theirs.get(k), settings.get(k)) for k in sorted(set(theirs) | set(settings))
                    if theirs.get(k) != settings.get(k)}
            raise AccuracyError(f"{out_dir} holds a run with other settings (theirs, this run's): {diff}; "
                                "use another --out or delete it")
    else:
        path.write_text(json.dumps(settings, indent=2) + "\n", encoding="utf-8")


# ---------------------------------------------------------------------------------------------- workers
_WORKER: dict[str, Any] = {}


def _init_worker(model: str, threads: int | None) -> None:
    """Loads the model and tokenizer once per worker process."""
    import torch

    from ...models.embedded import embedded_model_path
    from ...models.loading import load_model
    from ...tokenizer import load_tokenizer

    if threads is not None:
        torch.set_num_threads(threads)
    path = embedded_model_path() if model == "embedded" else model
    _WORKER.update(path=Path(path), model=load_model(path, dtype=torch.float32, device="cpu"),
                   tok=load_tokenizer(path))


def _cases(config: SuiteConfig, cell: Cell) -> list:
    from .tasks import make_cases, tokenize_case

    tok = _WORKER["tok"]
    cases = make_cases(cell.task, cell.length, config.cases, lambda s: len(tok.encode(s)), seed=config.seed)
    decode = cell.length if cell.task == DECODE_TASK else 0
    return [tokenize_case(c, tok.encode, tok.encode_prompt, decode) for c in cases]


def _policy(config: SuiteConfig, cell: Cell):
    from ...policies.registry import auto_n_recent, make_policy

    if cell.budget is None:
        return None
    kwargs = {"n_prefix": config.n_prefix, "n_recent": auto_n_recent(cell.budget),
              **dict(config.policy_kwargs.get(cell.policy, []))}
    return make_policy(cell.policy, budget=cell.budget, **kwargs)


def run_cell(config: SuiteConfig, cell: Cell, on_batch: Callable[[int], None] | None = None) -> dict[str, Any]:
    """Runs one cell in this process (the model loaded by :func:`_init_worker`) and returns its record."""
    import time

    cases = _cases(config, cell)
    t0 = time.perf_counter()
    if cell.engine == "kvpress":
        from .compare import run_kvpress_cell

        outcomes = run_kvpress_cell(config, cell, cases, _WORKER["path"], _WORKER["tok"].decode,
                                    reference=_policy(config, replace(cell, policy="beacon")))
    else:
        from .runner import run_cases

        outcomes = [asdict(o) for o in run_cases(
            _WORKER["model"], _WORKER["tok"].decode, _policy(config, cell), cases, cell.protocol,
            prefill_chunk=config.prefill_chunk, batch=config.batch, on_batch=on_batch)]
    return {"cell": asdict(cell), "settings": config.settings(), "outcomes": outcomes,
            "wall_s": time.perf_counter() - t0}


def _run_in_worker(config: SuiteConfig, cell: Cell) -> dict[str, Any]:
    return run_cell(config, cell)


def run_suite(
    config: SuiteConfig,
    out_dir: Path,
    *,
    num_workers: int = 1,
    threads: int | None = None,
    progress: bool = True,
) -> Iterator[dict[str, Any]]:
    """Runs every cell not yet recorded in ``out_dir``, yielding each record as it is appended.

    Args:
        config: The suite.
        out_dir: The output folder (made if missing; ``results.jsonl``, ``settings.json``).
        num_workers: Processes running cells at once (each loads the model once).
        threads: Torch threads per process (None: torch's default).
        progress: A progress bar over the cases.

    Yields:
        The record of each cell finished in this run.

    Raises:
        AccuracyError: ``out_dir`` holds a run with other settings.
    """
    from tqdm.auto import tqdm

    from ...eval.results import set_aside_torn_tail

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    _check_settings(out_dir, config.settings())
    set_aside_torn_tail(out_dir / "results.jsonl")  # a cell cut by a kill: its bytes go aside, the cell runs again
    done = load_records(out_dir)
    todo = [c for c in cells_of(config) if c.key not in done]
    bar = tqdm(total=len(todo) * config.cases, unit="case", desc="accuracy", disable=not progress)
    try:
        if num_workers <= 1:
            _init_worker(config.model, threads)
            for cell in todo:
                bar.set_postfix_str(f"{cell.task} {cell.length} {cell.protocol} {cell.policy}@{cell.budget}")
                record = run_cell(config, cell, on_batch=bar.update if cell.engine == "beaconkv" else None)
                if cell.engine != "beaconkv":
                    bar.update(config.cases)
                _append(out_dir, record)
                yield record
            return
        with ProcessPoolExecutor(num_workers, mp_context=get_context("spawn"), initializer=_init_worker,
                                 initargs=(config.model, threads)) as pool:
            futures = {pool.submit(_run_in_worker, config, cell): cell for cell in todo}
            for future in as_completed(futures):
                record = future.result()
                _append(out_dir, record)
                bar.update(config.cases)
                yield record
    finally:
        bar.close()


def wilson(correct: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of ``correct`` successes in ``n`` trials (95% by default), as fractions."""
    if n == 0:
        return (math.nan, math.nan)
    p = correct / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def summarize(records: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per cell: accuracy with its 95% interval, memory and seconds per case."""
    rows = []
    for record in records:
        outs = record["outcomes"]
        ok = [o for o in outs if o.get("error") is None]
        correct = sum(bool(o["correct"]) for o in ok)
        lo, hi = wilson(correct, len(ok))
        mean = (lambda key: sum(o[key] for o in ok) / len(ok) if ok else math.nan)
        rows.append({**record["cell"], "n": len(ok), "correct": correct,
                     "accuracy": correct / len(ok) if ok else math.nan, "lo": lo, "hi": hi,
                     "slots": mean("slots"), "kv_mib": mean("kv_bytes") / 2**20,
                     "prefill_s": mean("prefill_s"), "decode_s": mean("decode_s"),
                     "errors": sorted({o["error"] for o in outs if o.get("error")}),
                     "wall_s": record.get("wall_s", math.nan)})
    return rows
