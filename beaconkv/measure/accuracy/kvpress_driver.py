"""Runs NVIDIA kvpress on token ids, one JSON line per case: the comparator's side of ``--compare kvpress:...``.

This file is a standalone script, run by path in kvpress's own environment (``make kvpress-venv``; kvpress
0.5.5 pins a transformers that beaconkv cannot use), so it imports nothing of beaconkv: the standard library,
torch, transformers and kvpress only, and kvpress only when a press is asked for. The main environment drives
it through :func:`beaconkv.measure.accuracy.kvpress.run_kvpress`::

    .venv-kvpress/bin/python beaconkv/measure/accuracy/kvpress_driver.py JOB.json OUT.jsonl
    .venv-kvpress/bin/python beaconkv/measure/accuracy/kvpress_driver.py --versions

The job (JSON) names the model (a Hugging Face directory), ``dtype``, ``threads``, one ``press`` of
:data:`PRESSES`, kvpress's ``compression_ratio`` (the fraction removed), the ``mode`` and the ``cases``; see
:func:`validate_job`. Each case runs the protocol of :func:`run_case` on a fresh cache, batch 1:

1. **prefill** ``context_ids``. In mode ``"prefill"`` the press is active here only: kvpress's pipeline
   protocol (compress the context once, then answer); the question is not visible to it. For the
   question-aware variant the caller puts the question at the end of ``context_ids`` and passes an empty
   ``question_ids``.
2. **decode** ``decode_ids`` one token at a time (teacher forcing). In mode ``"decode"`` kvpress's
   ``DecodingPress(base press, **job["decode"])`` is active from here to the end of the case (as in
   kvpress's pipeline, which keeps a decoding press on through the question and the answer); the prefill
   is then not compressed. In mode ``"prefill"`` nothing is compressed after the prefill.
3. **question**: ``question_ids`` in one forward on the (compressed) cache, skipped when empty.
4. **generate** ``max_new_tokens`` tokens greedily (argmax, the first maximum on a tie); the first comes
   from the logits of the last token fed, whichever step fed it. A token of the job's ``stop_ids`` ends the
   answer (and is kept); with none, exactly ``max_new_tokens`` are generated.

Positions are the tokens' true positions, counted here and passed as ``position_ids`` (kvpress's pipeline
does the same): a compressed cache is shorter than the sequence it stands for, and transformers would
otherwise number the next token from the cache's length.

Output, one line per case in the job's order, written and flushed as each case ends::

    {"id", "generated_ids", "kv_bytes_after_prefill", "kv_tokens_after_prefill", "peak_kv_bytes",
     "prefill_s", "decode_s", "error"}

* ``kv_bytes_after_prefill``: the bytes of the cache's key and value tensors once the prefill (and its
  compression) is done.
* ``kv_tokens_after_prefill``: the tokens attention can still see then, averaged over layers and KV heads.
  It differs from the stored length only under AdaKV: kvpress's ``AdaKVPress`` evicts nothing, it masks
  the pruned keys of each head (its attention patch replaces them by keys whose weight underflows to zero),
  so its ``kv_bytes`` stay those of the full cache.
* ``peak_kv_bytes``: the most bytes the key and value tensors held at once over the whole case, sampled
  after every layer's attention *before* a press compresses that layer (the moment a layer holds its whole
  context during a compressed prefill, or ``target_size + compression_interval`` tokens just before a
  decode-time compression), and after every forward.
* ``prefill_s``: seconds of step 1; ``decode_s``: seconds of steps 2 to 4 together.
* ``error``: None, or why this case could not run (the phase, the exception and its message: a press
  kvpress cannot use in that setting, a context shorter than a press's window, a bad token id); the other
  fields are then empty or None, and the next case runs.

A job that cannot run at all (unreadable, a setting outside its range, kvpress not installed for a press)
prints one line naming the problem and the fix on stderr and exits with status 2.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

try:
    from beaconkv.errors import BeaconKVError
except ImportError:  # run by path in kvpress's environment, where beaconkv is not installed: the stdlib only
    class BeaconKVError(Exception):  # type: ignore[no-redef]
        """Stands in for :class:`beaconkv.errors.BeaconKVError` in kvpress's environment."""

#: The press names a job may ask for, as ``beaconkv accuracy --compare kvpress:...`` spells them.
PRESSES = ("none", "snapkv", "expected_attention", "tova", "knorm", "streaming", "adakv-snapkv")
#: ``"prefill"``: compress the context once (kvpress's pipeline); ``"decode"``: a ``DecodingPress`` after it.
MODES = ("prefill", "decode")
#: The ``dtype`` names a job may use (names of ``torch`` dtypes).
DTYPES = ("float32", "bfloat16", "float16")
#: The keys of a job's ``decode`` settings: ``DecodingPress``'s own parameter names.
DECODE_KEYS = ("compression_interval", "target_size", "hidden_states_buffer_size")
#: The keys every output line carries.
RESULT_KEYS = ("id", "generated_ids", "kv_bytes_after_prefill", "kv_tokens_after_prefill", "peak_kv_bytes",
               "prefill_s", "decode_s", "error")
#: Exit status of a job that cannot run at all.
EXIT_BAD_JOB = 2


class JobError(BeaconKVError, ValueError):
    """A job the driver cannot run at all: the message names the value, the limit and the fix."""


# ------------------------------------------------------------------------------------------ the job
def _ids(case_id: str, key: str, value: Any, *, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        raise JobError(f"case {case_id!r}: {key} must be a list of int token ids, got {type(value).__name__}")
    if not value and not allow_empty:
        raise JobError(f"case {case_id!r}: {key} is empty; a case needs at least one context token")
    return value


def validate_job(job: Any) -> dict:
    """Checks a job (the parsed JSON) and returns it with its optional keys filled in.

    Keys: ``model`` (a directory transformers loads), ``dtype`` (:data:`DTYPES`, default ``"float32"``),
    ``threads`` (torch threads, default 1), ``press`` (:data:`PRESSES`), ``compression_ratio`` (kvpress's
    fraction removed, in [0, 1); must be 0 in mode ``"decode"``, where ``DecodingPress`` sets its base
    press's ratio from ``target_size`` at each compression), ``mode`` (:data:`MODES`), ``decode`` (mode
    ``"decode"`` only: ``compression_interval`` and ``target_size``, optionally
    ``hidden_states_buffer_size``; may be left out with press ``"none"``), ``press_kwargs`` (optional: more parameters of the scorer press, e.g.
    ``{"window_size": 32}`` for SnapKV, the inner SnapKV under AdaKV), ``stop_ids`` (optional token ids
    that end an answer), ``attn_implementation`` (default ``"sdpa"``) and ``cases``: a list of
    ``{"id", "context_ids", "decode_ids", "question_ids", "max_new_tokens"}``.

    Args:
        job: The parsed job file.

    Returns:
        The job, with defaults for the optional keys.

    Raises:
        JobError: A missing key or a value outside its range, naming it and the accepted values.
    """
    if not isinstance(job, dict):
        raise JobError(f"the job must be a JSON object, got {type(job).__name__}")
    for key in ("model", "press", "compression_ratio", "mode", "cases"):
        if key not in job:
            raise JobError(f"the job has no {key!r}; see validate_job's docstring for the keys")
    out = dict(job)
    out.setdefault("dtype", "float32")
    out.setdefault("threads", 1)
    out.setdefault("decode", None)
    out.setdefault("press_kwargs", {})
    out.setdefault("stop_ids", [])
    out.setdefault("attn_implementation", "sdpa")
    if out["press"] not in PRESSES:
        raise JobError(f"press={out['press']!r} is not one of {', '.join(PRESSES)}")
    if out["mode"] not in MODES:
        raise JobError(f"mode={out['mode']!r} is not one of {', '.join(MODES)}")
    if out["dtype"] not in DTYPES:
        raise JobError(f"dtype={out['dtype']!r} is not one of {', '.join(DTYPES)}")
    threads = out["threads"]
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise JobError(f"threads={threads!r} must be an int >= 1")
    ratio = out["compression_ratio"]
    if not isinstance(ratio, (int, float)) or isinstance(ratio, bool) or not 0.0 <= ratio < 1.0:
        raise JobError(f"compression_ratio={ratio!r} must be a number in [0, 1) (kvpress's fraction removed)")
    if out["mode"] == "decode":
        if ratio != 0:
            raise JobError(f"compression_ratio={ratio!r} with mode='decode': DecodingPress sets its base press's "
                           "ratio from decode.target_size at each compression; pass compression_ratio=0")
        decode = out["decode"]
        if not (out["press"] == "none" and decode is None):  # press 'none' has nothing to schedule
            if not isinstance(decode, dict) or not {"compression_interval", "target_size"} <= decode.keys():
                raise JobError(f"mode='decode' needs decode={{'compression_interval': N, 'target_size': M}}, "
                               f"got {decode!r}")
            for key, value in decode.items():
                if key not in DECODE_KEYS:
                    raise JobError(f"decode.{key} is not a DecodingPress setting; use {', '.join(DECODE_KEYS)}")
                floor = 0 if key == "hidden_states_buffer_size" else 1
                if not isinstance(value, int) or isinstance(value, bool) or value < floor:
                    raise JobError(f"decode.{key}={value!r} must be an int >= {floor}")
    elif out["decode"] is not None:
        raise JobError(f"decode={out['decode']!r} is given with mode='prefill', which compresses nothing after "
                       "the prefill; drop it or use mode='decode'")
    if out["press"] == "none" and out["mode"] == "prefill" and ratio != 0:
        raise JobError(f"compression_ratio={ratio!r} with press='none': nothing would compress; pass 0")
    if not isinstance(out["press_kwargs"], dict):
        raise JobError(f"press_kwargs={out['press_kwargs']!r} must be an object of press parameters")
    if out["press"] == "none" and out["press_kwargs"]:
        raise JobError(f"press_kwargs={out['press_kwargs']!r} with press='none': there is no press to set")
    _ids("(job)", "stop_ids", out["stop_ids"], allow_empty=True)
    cases = out["cases"]
    if not isinstance(cases, list):
        raise JobError(f"cases must be a list, got {type(cases).__name__}")
    seen = set()
    for n, case in enumerate(cases):
        if not isinstance(case, dict) or not isinstance(case.get("id"), str):
            raise JobError(f"cases[{n}] must be an object with a string 'id'")
        if case["id"] in seen:
            raise JobError(f"cases[{n}]: id {case['id']!r} appears twice; ids must be unique")
        seen.add(case["id"])
    return out


def _check_case(case: dict, vocab_size: int) -> tuple[list[int], list[int], list[int], int]:
    """The case's ids and answer length, checked (a bad case is that case's error, not the job's)."""
    cid = case["id"]
    context = _ids(cid, "context_ids", case.get("context_ids"), allow_empty=False)
    decode = _ids(cid, "decode_ids", case.get("decode_ids", []), allow_empty=True)
    question = _ids(cid, "question_ids", case.get("question_ids", []), allow_empty=True)
    for key, ids in (("context_ids", context), ("decode_ids", decode), ("question_ids", question)):
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise JobError(f"case {cid!r}: {key} holds {bad[0]}, outside the model's vocabulary [0, {vocab_size})")
    max_new = case.get("max_new_tokens")
    if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 0:
        raise JobError(f"case {cid!r}: max_new_tokens={max_new!r} must be an int >= 0")
    return context, decode, question, max_new


# ------------------------------------------------------------------------------------- the press
def build_press(press: str, compression_ratio: float, mode: str, decode: dict | None = None,
                press_kwargs: dict | None = None) -> Any:
    """The kvpress press object for a job's settings (None for ``"none"``).

    ``snapkv``: ``SnapKVPress``; ``expected_attention``: ``ExpectedAttentionPress``; ``tova``: ``TOVAPress``;
    ``knorm``: ``KnormPress``; ``streaming``: ``StreamingLLMPress``; ``adakv-snapkv``:
    ``AdaKVPress(SnapKVPress(...))``, each with kvpress's defaults plus ``press_kwargs``. In mode
    ``"decode"`` the scorer is wrapped in ``DecodingPress(base_press, **decode)``.

    Args:
        press: One of :data:`PRESSES`.
        compression_ratio: kvpress's fraction removed at the prefill (0 in mode ``"decode"``).
        mode: One of :data:`MODES`.
        decode: ``DecodingPress`` settings (mode ``"decode"``).
        press_kwargs: More parameters of the scorer press.

    Returns:
        The press (a kvpress ``BasePress``), or None.

    Raises:
        JobError: kvpress is not installed in this interpreter, or a press parameter it refuses.
    """
    if press == "none":
        return None
    try:
        import kvpress
    except ImportError as err:
        raise JobError(f"press={press!r} needs kvpress, which {sys.executable} cannot import ({err}); run this "
                       "driver with .venv-kvpress/bin/python (make kvpress-venv)") from err
    scorers = {"snapkv": kvpress.SnapKVPress, "expected_attention": kvpress.ExpectedAttentionPress,
               "tova": kvpress.TOVAPress, "knorm": kvpress.KnormPress, "streaming": kvpress.StreamingLLMPress,
               "adakv-snapkv": kvpress.SnapKVPress}
    ratio = compression_ratio if mode == "prefill" else 0.0
    try:
        scorer = scorers[press](compression_ratio=ratio, **(press_kwargs or {}))
        obj = kvpress.AdaKVPress(scorer) if press == "adakv-snapkv" else scorer
        if mode == "decode":
            obj = kvpress.DecodingPress(base_press=obj, **(decode or {}))
    except (TypeError, AssertionError, ValueError) as err:
        raise JobError(f"kvpress refuses press={press!r} with press_kwargs={press_kwargs!r}, decode={decode!r}: "
                       f"{type(err).__name__}: {err}") from err
    return obj


# ---------------------------------------------------------------------------------------- memory
def kv_bytes(cache: Any) -> int:
    """Bytes of a transformers cache's key and value tensors, summed over its layers."""
    total = 0
    for layer in getattr(cache, "layers", []):
        for name in ("keys", "values"):
            t = getattr(layer, name, None)
            if t is not None and hasattr(t, "element_size"):
                total += t.numel() * t.element_size()
    return total


def visible_tokens(model: Any, cache: Any) -> float:
    """Tokens attention sees, averaged over layers and KV heads: the stored length less the keys kvpress's
    AdaKV masks (``module.masked_key_indices``)."""
    layers = _decoder_layers(model)
    counts = []
    for i, cache_layer in enumerate(cache.layers):
        keys = getattr(cache_layer, "keys", None)
        if keys is None or keys.dim() != 4:
            counts.append(0.0)
            continue
        heads, length = keys.shape[1], keys.shape[2]
        masked = getattr(layers[i].self_attn, "masked_key_indices", None) if i < len(layers) else None
        n_masked = int(masked[0].numel()) if masked is not None else 0
        counts.append((heads * length - n_masked) / heads)
    return sum(counts) / len(counts) if counts else 0.0


def _decoder_layers(model: Any) -> Any:
    inner = model.model.language_model if hasattr(model.model, "language_model") else model.model
    return inner.layers


class KVMeter:
    """Samples the cache's bytes after every attention layer and keeps the peak of a case.

    Its forward hooks are registered on the attention modules *before* a press's (hooks run in the order
    they were registered), so each sample sees a layer with its new keys written and not yet compressed.
    """

    def __init__(self, model: Any) -> None:
        """Registers one hook per attention module of ``model`` (for the meter's lifetime)."""
        self.cache: Any = None
        self.peak = 0
        self.handles = [layer.self_attn.register_forward_hook(self._hook) for layer in _decoder_layers(model)]

    def _hook(self, module: Any, args: Any, output: Any) -> None:
        self.sample()

    def start(self, cache: Any) -> None:
        """Starts a case on ``cache``: the peak restarts from its current size."""
        self.cache, self.peak = cache, 0
        self.sample()

    def sample(self) -> int:
        """Samples the current cache's bytes now; returns them."""
        now = kv_bytes(self.cache) if self.cache is not None else 0
        self.peak = max(self.peak, now)
        return now


# ------------------------------------------------------------------------------------------ a case
def _cache_argument(model: Any) -> str:
    """The name the model's ``forward`` takes its cache by: ``past_key_values`` in the transformers kvpress
    0.5.5 allows (< 5.3; kvpress's hooks read that name too), ``cache`` from transformers 5.25 on."""
    import inspect

    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _forward(model: Any, ids: list[int], cache: Any, start: int, meter: KVMeter) -> Any:
    """One forward of ``ids`` at true positions ``start ...``; returns the last token's logits."""
    import torch

    input_ids = torch.tensor([ids], dtype=torch.long)
    position_ids = torch.arange(start, start + len(ids), dtype=torch.long).unsqueeze(0)
    out = model(input_ids=input_ids, position_ids=position_ids, use_cache=True, logits_to_keep=1,
                **{_cache_argument(model): cache})
    meter.sample()
    return out.logits[0, -1]


def run_case(model: Any, press: Any, mode: str, case: dict, meter: KVMeter, stop_ids: frozenset[int] = frozenset(),
             ) -> dict:
    """Runs one case (the protocol of the module docstring) and returns its output line.

    Args:
        model: A transformers causal LM.
        press: The kvpress press of the job, or None.
        mode: ``"prefill"`` or ``"decode"``.
        case: ``{"id", "context_ids", "decode_ids", "question_ids", "max_new_tokens"}``.
        meter: The model's :class:`KVMeter`.
        stop_ids: Token ids that end the answer.

    Returns:
        The case's result (:data:`RESULT_KEYS`); ``error`` names the phase and the exception when it failed.
    """
    import contextlib

    import torch
    from transformers import DynamicCache

    result = {"id": case["id"], "generated_ids": [], "kv_bytes_after_prefill": None,
              "kv_tokens_after_prefill": None, "peak_kv_bytes": None, "prefill_s": None, "decode_s": None,
              "error": None}
    phase = "checking the case"
    try:
        context, decode_ids, question, max_new = _check_case(case, model.config.vocab_size)
        for layer in _decoder_layers(model):  # AdaKV's masks of an earlier case must not leak into this one
            if hasattr(layer.self_attn, "masked_key_indices"):
                layer.self_attn.masked_key_indices = None
        cache = DynamicCache()
        meter.start(cache)
        prefill_press = press if press is not None and mode == "prefill" else None
        decode_press = press if press is not None and mode == "decode" else None
        with torch.inference_mode():
            phase = "prefill"
            t0 = time.perf_counter()
            with prefill_press(model) if prefill_press is not None else contextlib.nullcontext():
                logits = _forward(model, context, cache, 0, meter)
            result["prefill_s"] = time.perf_counter() - t0
            result["kv_bytes_after_prefill"] = kv_bytes(cache)
            result["kv_tokens_after_prefill"] = visible_tokens(model, cache)
            pos = len(context)
            t0 = time.perf_counter()
            generated: list[int] = []
            with decode_press(model) if decode_press is not None else contextlib.nullcontext():
                for n, token in enumerate(decode_ids):
                    phase = f"decode step {n} of {len(decode_ids)}"
                    logits = _forward(model, [token], cache, pos, meter)
                    pos += 1
                if question:
                    phase = "question"
                    logits = _forward(model, question, cache, pos, meter)
                    pos += len(question)
                for n in range(max_new):
                    phase = f"generation step {n} of {max_new}"
                    token = int(logits.argmax())
                    generated.append(token)
                    if token in stop_ids or n == max_new - 1:
                        break
                    logits = _forward(model, [token], cache, pos, meter)
                    pos += 1
            result["decode_s"] = time.perf_counter() - t0
        result["generated_ids"] = generated
        result["peak_kv_bytes"] = meter.peak
    except Exception as err:  # noqa: BLE001 -- one case's failure is that case's error; the job goes on
        message = str(err).strip().splitlines()[0] if str(err).strip() else ""
        result.update(generated_ids=[], kv_bytes_after_prefill=None, kv_tokens_after_prefill=None,
                      peak_kv_bytes=None, prefill_s=None, decode_s=None,
                      error=f"{phase}: {type(err).__name__}: {message}"[:2000])
    finally:
        meter.cache = None
    return result


# ------------------------------------------------------------------------------------------- main
def load_model(path: str, dtype: str, attn_implementation: str = "sdpa") -> Any:
    """The model of a job, in eval mode (``AutoModelForCausalLM.from_pretrained``)."""
    import torch
    from transformers import AutoModelForCausalLM

    if not Path(path, "config.json").is_file():
        raise JobError(f"model={path!r} is not a Hugging Face model directory (no config.json there)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation=attn_implementation)
    return model.eval()


def run_job(job: dict, out_path: Path) -> int:
    """Runs a validated job, writing one line per case to ``out_path``; returns the number of cases with an error."""
    import torch

    torch.set_num_threads(job["threads"])
    press = build_press(job["press"], float(job["compression_ratio"]), job["mode"], job["decode"],
                        job["press_kwargs"])
    model = load_model(job["model"], job["dtype"], job["attn_implementation"])
    meter = KVMeter(model)
    stop_ids = frozenset(job["stop_ids"])
    failed = 0
    with open(out_path, "w", encoding="utf-8") as out:
        for case in job["cases"]:
            result = run_case(model, press, job["mode"], case, meter, stop_ids)
            failed += result["error"] is not None
            for key in ("prefill_s", "decode_s"):
                if result[key] is not None and not math.isfinite(result[key]):
                    result[key] = None
            out.write(json.dumps(result) + "\n")
            out.flush()
    return failed


def versions() -> dict:
    """The versions of python, torch, transformers and kvpress (None when one is not installed), and the file
    ``import kvpress`` loads (``kvpress_file``: the package, not beaconkv's ``kvpress.py`` beside this script)."""
    from importlib import metadata

    found: dict[str, str | None] = {"python": sys.version.split()[0]}
    for name in ("torch", "transformers", "kvpress"):
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    try:
        import kvpress

        found["kvpress_file"] = kvpress.__file__
    except ImportError:
        found["kvpress_file"] = None
    return found


def main(argv: list[str] | None = None) -> int:
    """``kvpress_driver.py JOB.json OUT.jsonl`` or ``kvpress_driver.py --versions``; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--versions"]:
        print(json.dumps(versions()))
        return 0
    if len(argv) != 2:
        print("usage: kvpress_driver.py JOB.json OUT.jsonl | --versions", file=sys.stderr)
        return EXIT_BAD_JOB
    try:
        try:
            job = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
        except (OSError, ValueError) as err:
            raise JobError(f"cannot read the job file {argv[0]}: {err}") from err
        run_job(validate_job(job), Path(argv[1]))
    except JobError as err:
        print(f"kvpress_driver: {err}", file=sys.stderr)
        return EXIT_BAD_JOB
    return 0


def _drop_own_folder_from_path() -> None:
    """Run by path, Python puts this file's folder first on ``sys.path``, and that folder holds beaconkv's
    ``kvpress.py``, which would shadow the kvpress package: take it off."""
    here = Path(__file__).resolve().parent
    sys.path[:] = [p for p in sys.path if Path(p or os.getcwd()).resolve() != here]


if __name__ == "__main__":
    _drop_own_folder_from_path()
    sys.exit(main())
