"""Teacher-forced fidelity of compressed KV caches against FullKV on long reasoning traces.

One token stream (a reasoning trace: prompt rendered with the chat template, then the model output
forced token by token) goes through the *real* decode path — a :class:`~beaconkv.session.Session`
per run, the model's public ``prefill``/``decode_step`` — once with FullKV (the reference) and once
per policy and budget, all in lock-step (:class:`LockStep`). At every decode step we compare the
next-token distributions (KL, top-1) and the attention recall of global and local queries.

Modules: :mod:`.traces` (what is forced), :mod:`.metrics` (per-step measures), :mod:`.cache_stack`
(several caches driven as one batch), :mod:`.lockstep` (the runs), :mod:`.study` (the policy x budget grid
and its rows), :mod:`.report` (CSV, markdown, plots), :mod:`.cli` (``beaconkv fidelity``).
"""

from .errors import FidelityError
from .lockstep import LockStep, StepOutput
from .metrics import (
    GlobalQueryRule,
    LengthAwareRule,
    attention_distance,
    held_attention_mass,
    held_attention_masses,
    kl_divergence,
)
from .report import METRICS, POLICY_ORDER, markdown_table, plot_fidelity, write_csv
from .study import FidelityRow, Run, auto_n_recent, measure_fidelity, study_runs
from .traces import (
    Trace,
    forced_tokens,
    generate_traces,
    load_traces,
    read_trace_records,
    select_records,
    trace_from_record,
)

__all__ = [
    "METRICS", "POLICY_ORDER", "FidelityError", "FidelityRow", "GlobalQueryRule", "LengthAwareRule", "LockStep",
    "Run", "StepOutput", "Trace", "attention_distance", "auto_n_recent", "forced_tokens", "generate_traces",
    "held_attention_mass", "held_attention_masses", "kl_divergence", "load_traces", "markdown_table",
    "measure_fidelity", "plot_fidelity", "read_trace_records", "select_records", "study_runs", "trace_from_record",
    "write_csv",
]
