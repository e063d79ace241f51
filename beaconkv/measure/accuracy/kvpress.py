"""NVIDIA kvpress as a comparator: runs its presses on our token ids in its own environment, as a subprocess.

kvpress 0.5.5 pins transformers < 5.3 while ``beaconkv[hf]`` needs >= 5.25, so kvpress lives in
``.venv-kvpress/`` (``make kvpress-venv``) and never in beaconkv's environment. :func:`run_kvpress` writes a
job file, runs :mod:`~beaconkv.measure.accuracy.kvpress_driver` (a standalone script) with that
environment's Python, and parses the one JSON line per case it writes back into :class:`KvpressResult`.

Same model, same token ids (raw continuation, no chat template: the ids go to kvpress as they are), and the
same budget: kvpress sizes its prefill compression by a ratio, the fraction of the context it removes, where
our policies keep a count of tokens; :func:`kvpress_ratio` turns the count our policy keeps of a context
into the ratio that makes kvpress keep exactly as many, and :func:`tokens_kept_of_prompt` reads that count
off a policy's own schedule. At decode time kvpress's ``DecodingPress`` takes a count (``target_size``) and
an interval (``compression_interval``) directly: pass them in ``decode``.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import BeaconKVError
from ...paths import REPO_ROOT

#: The kvpress presses the comparator runs (``--compare kvpress:snapkv,...``); ``"none"`` is kvpress's model
#: with no compression, the reference its presses are read against.
PRESSES = ("snapkv", "expected_attention", "tova", "knorm", "streaming", "adakv-snapkv", "none")
#: ``"prefill"``: compress the context once (kvpress's pipeline protocol); ``"decode"``: kvpress's
#: ``DecodingPress`` around the press, during the teacher-forced decode steps and the answer.
MODES = ("prefill", "decode")
#: The standalone script :func:`run_kvpress` runs in kvpress's environment.
DRIVER = Path(__file__).resolve().with_name("kvpress_driver.py")
#: Where ``make kvpress-venv`` builds kvpress's environment (the checkout's root).
KVPRESS_VENV = REPO_ROOT / ".venv-kvpress"
#: Environment variable naming another Python for kvpress (one with kvpress 0.5.x, torch and transformers).
PYTHON_ENV = "BEACONKV_KVPRESS_PYTHON"
#: The keys ``decode`` may hold: ``DecodingPress``'s parameter names.
DECODE_KEYS = ("compression_interval", "target_size", "hidden_states_buffer_size")
#: How many characters of the driver's stderr an error quotes.
_STDERR_TAIL = 3000


class KvpressError(BeaconKVError):
    """The kvpress comparator could not run: a bad setting, a driver that failed, timed out or wrote
    something unreadable. The message names the value and the fix."""


class KvpressUnavailable(KvpressError):
    """kvpress's environment is not there: build it with ``make kvpress-venv``."""


@dataclass(frozen=True)
class KvpressCase:
    """One prompt for kvpress, as token ids (batch 1).

    Attributes:
        id: Unique within a run; the result carries it back.
        context_ids: The prompt kvpress prefills (and compresses, in mode ``"prefill"``); not empty. For the
            question-aware protocol, end it with the question and leave ``question_ids`` empty.
        decode_ids: Tokens fed one at a time after the prefill (teacher forcing): the decode steps a
            ``DecodingPress`` compresses during, in mode ``"decode"``.
        question_ids: Fed in one forward on the compressed cache after the decode steps (may be empty).
        max_new_tokens: Greedy tokens to generate after the question.
    """

    id: str
    context_ids: tuple[int, ...]
    decode_ids: tuple[int, ...] = ()
    question_ids: tuple[int, ...] = ()
    max_new_tokens: int = 16

    def __post_init__(self) -> None:
        for name in ("context_ids", "decode_ids", "question_ids"):
            value = getattr(self, name)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value):
                raise KvpressError(f"KvpressCase {self.id!r}: {name} must hold token ids (ints >= 0)")
            object.__setattr__(self, name, tuple(value))
        if not self.context_ids:
            raise KvpressError(f"KvpressCase {self.id!r}: context_ids is empty; a case needs a context to prefill")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise KvpressError(f"KvpressCase {self.id!r}: max_new_tokens={self.max_new_tokens!r} must be an int >= 0")


@dataclass(frozen=True)
class KvpressResult:
    """What kvpress did on one :class:`KvpressCase`.

    Attributes:
        id: The case's id.
        generated_ids: The greedy answer (empty when ``error`` is set).
        kv_bytes_after_prefill: Bytes of the cache's keys and values after the prefill and its compression.
        peak_kv_bytes: The most bytes the cache's keys and values held at once during the case (sampled
            after every layer's attention, before a press compresses that layer).
        prefill_s: Seconds of the prefill (with its compression).
        decode_s: Seconds of the decode steps, the question and the answer together.
        error: None, or why kvpress could not run this case (the phase, the exception and its message),
            e.g. a press kvpress cannot use under ``DecodingPress`` with these settings.
        kv_tokens_after_prefill: Tokens attention still sees after the prefill, averaged over layers and KV
            heads. Equal to the stored length except under AdaKV, which masks keys per head instead of
            removing them (so its ``kv_bytes`` stay those of the whole context).
    """

    id: str
    generated_ids: tuple[int, ...]
    kv_bytes_after_prefill: int | None
    peak_kv_bytes: int | None
    prefill_s: float | None
    decode_s: float | None
    error: str | None
    kv_tokens_after_prefill: float | None = None


# ---------------------------------------------------------------------------------------- budgets
def kvpress_ratio(n_keep: int, context_len: int) -> float:
    """kvpress's ``compression_ratio`` that keeps exactly ``n_keep`` tokens of a ``context_len``-token context.

    ``ratio = 1 - n_keep / context_len``, where ``n_keep`` is the number of the context's tokens our policy
    keeps (:func:`tokens_kept_of_prompt`). kvpress keeps ``int(context_len * (1 - ratio))`` tokens (its
    ``compute_n_kept``; StreamingLLM the same), and that float product can land just below ``n_keep``; the
    ratio returned is nudged by the smallest float steps until kvpress's own arithmetic gives ``n_keep``.

    Args:
        n_keep: Tokens kept, ``1 <= n_keep <= context_len`` (kvpress keeps at least one).
        context_len: Tokens in the context kvpress compresses.

    Returns:
        A ratio in ``[0, 1)``; 0 when ``n_keep == context_len`` (nothing removed).

    Raises:
        KvpressError: ``context_len < 1`` or ``n_keep`` outside ``[1, context_len]``.

    Example:
        >>> kvpress_ratio(256, 1024)
        0.75
        >>> int(1000 * (1 - kvpress_ratio(333, 1000)))
        333
    """
    for name, value in (("n_keep", n_keep), ("context_len", context_len)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise KvpressError(f"{name}={value!r} must be an int")
    if context_len < 1:
        raise KvpressError(f"context_len={context_len} must be >= 1")
    if not 1 <= n_keep <= context_len:
        raise KvpressError(f"n_keep={n_keep} must be in [1, context_len={context_len}] (kvpress keeps at least one "
                           "token); a policy that keeps the whole context compares with press 'none'")
    ratio = 1.0 - n_keep / context_len
    for _ in range(64):
        kept = int(context_len * (1 - ratio))
        if kept == n_keep:
            return max(ratio, 0.0)
        ratio = math.nextafter(ratio, -math.inf if kept < n_keep else math.inf)
    raise KvpressError(f"no float ratio makes kvpress keep {n_keep} of {context_len} tokens")  # pragma: no cover


def tokens_kept_of_prompt(policy: Any, context_len: int) -> int:
    """Tokens of a ``context_len``-token prompt that ``policy`` still holds right after its prefill.

    Read off the policy's own settings, the way its ``after_prefill`` decides: the protected prefix
    (``policy.prefix_lengths``: ``n_prefix``, or the whole prompt when ``n_prefix`` is None, the default)
    always stays; the prompt's other tokens are evicted when they reach the schedule's eviction point, down
    to the schedule's keep count. Under the default :class:`~beaconkv.policies.schedules.AtBudget` schedule
    that is ``n_prefix + floor(ratio * budget)`` once ``context_len - n_prefix`` reaches ``budget``, else the
    whole prompt. kvpress protects no prefix: compare it with policies made with ``n_prefix=0`` (kvpress's own
    sink tokens aside). Feed the result to :func:`kvpress_ratio`.

    Args:
        policy: An :class:`~beaconkv.policies.base.EvictionPolicy` (FullKV keeps everything).
        context_len: Tokens in the prompt.

    Returns:
        The number of prompt tokens kept: ``context_len`` when the prefill evicts nothing.

    Raises:
        KvpressError: ``context_len < 1``.
        PolicyConfigError: The policy's ``n_prefix`` is longer than the prompt.

    Example:
        >>> from beaconkv.policies.registry import make_policy
        >>> tokens_kept_of_prompt(make_policy("snapkv", budget=256, n_prefix=0), 2031)
        224
        >>> tokens_kept_of_prompt(make_policy("snapkv", budget=256), 2031)  # n_prefix=None: the whole prompt
        2031
    """
    if not isinstance(context_len, int) or context_len < 1:
        raise KvpressError(f"context_len={context_len!r} must be an int >= 1")
    if not policy.evicts:
        return context_len
    (n_prefix,) = policy.prefix_lengths([context_len])
    evictable = context_len - n_prefix
    schedule = policy.schedule
    if evictable < schedule.evict_at(policy, 0):
        return context_len
    return n_prefix + min(evictable, schedule.keep(policy, evictable, 0))


# ---------------------------------------------------------------------------- what kvpress cannot do
#: kvpress 0.5.5's defaults for the press parameters :func:`unsupported_reason` looks at.
_SNAPKV_WINDOW = 64
_SINK_TOKENS = {"streaming": 4, "expected_attention": 4}


def unsupported_reason(press: str, mode: str, *, batch: int = 1, decode: dict | None = None,
                       press_kwargs: dict | None = None, context_len: int | None = None) -> str | None:
    """Why kvpress cannot run a setting as asked, known before running it (None: nothing known against it).

    For the comparison table's note: a setting named here is either refused by kvpress (the driver would
    return the case with ``error`` set) or runs with a meaning that differs from ours.

    Args:
        press: One of :data:`PRESSES`.
        mode: One of :data:`MODES`.
        batch: Sequences our side decodes together.
        decode: The ``DecodingPress`` settings of mode ``"decode"``.
        press_kwargs: Parameters passed to the scorer press.
        context_len: Tokens of the context kvpress prefills.

    Returns:
        A sentence, or None.
    """
    kwargs = press_kwargs or {}
    reasons = []
    if batch > 1:
        reasons.append(f"batch={batch}: kvpress runs one sequence at a time here (its pipeline is batch 1, and a "
                       "padded batch would let its presses score the pad tokens); its memory is one sequence's")
    window = kwargs.get("window_size", _SNAPKV_WINDOW)
    if press in ("snapkv", "adakv-snapkv"):
        if mode == "decode" and decode is not None and decode.get("compression_interval", 0) <= window:
            reasons.append(f"decode-time SnapKV scores with the last window_size={window} of the hidden states "
                           f"buffered since the previous compression, only compression_interval="
                           f"{decode.get('compression_interval')} of them: kvpress refuses it (raise the interval "
                           "above the window or pass press_kwargs window_size)")
        if mode == "prefill" and context_len is not None and context_len <= window:
            reasons.append(f"a context of {context_len} tokens is not longer than SnapKV's window_size={window}: "
                           "kvpress refuses it")
    sinks = kwargs.get("n_sink", _SINK_TOKENS.get(press, 0))
    if context_len is not None and sinks and context_len <= sinks:
        reasons.append(f"a context of {context_len} tokens is not longer than the press's n_sink={sinks}")
    if press == "adakv-snapkv":
        reasons.append("AdaKV in kvpress masks pruned keys per head instead of removing them: its KV bytes are "
                       "the uncompressed cache's")
    return "; ".join(reasons) or None


# ------------------------------------------------------------------------------------ the driver
def default_python() -> Path:
    """kvpress's interpreter: ``$BEACONKV_KVPRESS_PYTHON`` if set, else ``.venv-kvpress/bin/python`` of the checkout."""
    env = os.environ.get(PYTHON_ENV)
    return Path(env) if env else KVPRESS_VENV / "bin" / "python"


def _check_settings(press: str, compression_ratio: float, mode: str, decode: dict | None, threads: int) -> None:
    if press not in PRESSES:
        raise KvpressError(f"press={press!r} is not a kvpress comparator; use one of {', '.join(PRESSES)}")
    if mode not in MODES:
        raise KvpressError(f"mode={mode!r} must be one of {', '.join(MODES)}")
    if not isinstance(compression_ratio, (int, float)) or not 0.0 <= compression_ratio < 1.0:
        raise KvpressError(f"compression_ratio={compression_ratio!r} must be in [0, 1) (the fraction kvpress "
                           "removes); kvpress_ratio(n_keep, context_len) computes it from a kept count")
    if not isinstance(threads, int) or threads < 1:
        raise KvpressError(f"threads={threads!r} must be an int >= 1")
    if mode == "decode":
        if compression_ratio != 0:
            raise KvpressError(f"compression_ratio={compression_ratio} with mode='decode': kvpress's DecodingPress "
                               "sizes its compressions from decode['target_size']; pass compression_ratio=0")
        if press == "none" and decode is None:
            return  # nothing to schedule: the decode steps run uncompressed
        if decode is None or not {"compression_interval", "target_size"} <= set(decode):
            raise KvpressError(f"mode='decode' needs decode={{'compression_interval': N, 'target_size': M}}, got "
                               f"{decode!r}")
        unknown = set(decode) - set(DECODE_KEYS)
        if unknown:
            raise KvpressError(f"decode keys {sorted(unknown)} are not DecodingPress settings; use "
                               f"{', '.join(DECODE_KEYS)}")
    elif decode is not None:
        raise KvpressError(f"decode={decode!r} with mode='prefill', which compresses nothing after the prefill: "
                           "drop it or use mode='decode'")
    if press == "none" and compression_ratio != 0:
        raise KvpressError(f"compression_ratio={compression_ratio} with press='none' (no compression): pass 0")


def build_job(cases: Sequence[KvpressCase], *, press: str, compression_ratio: float, mode: str, model_dir: Path,
              threads: int = 1, decode: dict | None = None, dtype: str = "float32",
              press_kwargs: dict | None = None, stop_ids: Sequence[int] = ()) -> dict:
    """The job (the driver's JSON input) for these cases and settings; the arguments as :func:`run_kvpress`'s.

    Raises:
        KvpressError: A setting outside its range or duplicate case ids.
    """
    _check_settings(press, compression_ratio, mode, decode, threads)
    ids = [case.id for case in cases]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise KvpressError(f"case id {dup!r} appears twice; ids must be unique")
    return {
        "model": str(Path(model_dir).resolve()), "dtype": dtype, "threads": threads, "press": press,
        "compression_ratio": float(compression_ratio), "mode": mode, "decode": dict(decode) if decode else None,
        "press_kwargs": dict(press_kwargs or {}), "stop_ids": [int(t) for t in stop_ids],
        "cases": [{"id": c.id, "context_ids": list(c.context_ids), "decode_ids": list(c.decode_ids),
                   "question_ids": list(c.question_ids), "max_new_tokens": c.max_new_tokens} for c in cases],
    }


def _opt(value: Any, kind: type, line: int, key: str) -> Any:
    if value is None:
        return None
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise KvpressError(f"kvpress driver output line {line}: {key}={value!r} is not a {kind.__name__}")
    return value


def parse_results(text: str, cases: Sequence[KvpressCase]) -> list[KvpressResult]:
    """The driver's output (one JSON object per line, the cases' order) as :class:`KvpressResult`.

    Args:
        text: The output file's text.
        cases: The cases of the job, in order.

    Returns:
        One result per case, in the cases' order.

    Raises:
        KvpressError: A line that is not JSON, a missing or mistyped key, a result for another case, or
            fewer or more lines than cases.
    """
    lines = [line for line in text.splitlines() if line.strip()]
    if len(lines) != len(cases):
        raise KvpressError(f"the kvpress driver wrote {len(lines)} results for {len(cases)} cases")
    results = []
    for n, (line, case) in enumerate(zip(lines, cases), start=1):
        try:
            raw = json.loads(line)
        except ValueError as err:
            raise KvpressError(f"kvpress driver output line {n} is not JSON ({err}): {line[:200]!r}") from err
        if not isinstance(raw, dict):
            raise KvpressError(f"kvpress driver output line {n} is not an object: {line[:200]!r}")
        missing = [k for k in ("id", "generated_ids", "kv_bytes_after_prefill", "peak_kv_bytes", "prefill_s",
                               "decode_s", "error") if k not in raw]
        if missing:
            raise KvpressError(f"kvpress driver output line {n} lacks {', '.join(missing)}")
        if raw["id"] != case.id:
            raise KvpressError(f"kvpress driver output line {n} is for case {raw['id']!r}, expected {case.id!r}")
        generated = raw["generated_ids"]
        if not isinstance(generated, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                      for t in generated):
            raise KvpressError(f"kvpress driver output line {n}: generated_ids={generated!r} is not a list of ints")
        results.append(KvpressResult(
            id=case.id, generated_ids=tuple(generated),
            kv_bytes_after_prefill=_opt(raw["kv_bytes_after_prefill"], int, n, "kv_bytes_after_prefill"),
            peak_kv_bytes=_opt(raw["peak_kv_bytes"], int, n, "peak_kv_bytes"),
            prefill_s=_opt(raw["prefill_s"], float, n, "prefill_s"),
            decode_s=_opt(raw["decode_s"], float, n, "decode_s"),
            error=_opt(raw["error"], str, n, "error"),
            kv_tokens_after_prefill=_opt(raw.get("kv_tokens_after_prefill"), float, n, "kv_tokens_after_prefill"),
        ))
    return results


def _python_or_raise(python: Path | None) -> Path:
    exe = Path(python) if python is not None else default_python()
    if not exe.exists():
        how = f"${PYTHON_ENV}" if python is None and os.environ.get(PYTHON_ENV) else "the kvpress environment"
        raise KvpressUnavailable(
            f"kvpress's Python {exe} does not exist ({how}): run `make kvpress-venv` in the beaconkv checkout "
            f"(it builds {KVPRESS_VENV.name}/ with kvpress 0.5.5), or pass python= / set ${PYTHON_ENV} to a "
            "Python that has kvpress 0.5.x")
    return exe


def _driver_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false")
    return env


def run_kvpress(cases: Sequence[KvpressCase], *, press: str, compression_ratio: float, mode: str, model_dir: Path,
                python: Path | None = None, threads: int = 1, decode: dict | None = None,
                timeout_s: float = 3600.0, dtype: str = "float32", press_kwargs: dict | None = None,
                stop_ids: Sequence[int] = ()) -> list[KvpressResult]:
    """Runs one kvpress press over ``cases`` in kvpress's environment; one result per case, in order.

    The driver (:mod:`~beaconkv.measure.accuracy.kvpress_driver`) loads ``model_dir`` with transformers, runs
    each case's protocol (prefill the context under the press, teacher-forced decode steps, the question,
    a greedy answer) and reports per case; a case kvpress cannot run comes back with ``error`` set while
    the others run.

    Args:
        cases: The prompts, as token ids.
        press: One of :data:`PRESSES`.
        compression_ratio: kvpress's fraction of the context removed at the prefill (:func:`kvpress_ratio`
            from the count our policy keeps); 0 in mode ``"decode"`` and for ``"none"``.
        mode: ``"prefill"`` (compress the context once, kvpress's pipeline) or ``"decode"`` (kvpress's
            ``DecodingPress`` during the decode steps and the answer).
        model_dir: A Hugging Face model directory (``beaconkv.embedded_model_path()``).
        python: kvpress's interpreter (default :func:`default_python`).
        threads: torch threads in the driver.
        decode: Mode ``"decode"``: ``{"compression_interval": N, "target_size": M}`` (kvpress's names;
            ``hidden_states_buffer_size`` optional); None with press ``"none"`` (nothing to schedule).
        timeout_s: Seconds the whole driver run may take (it is killed after that).
        dtype: ``"float32"``, ``"bfloat16"`` or ``"float16"``.
        press_kwargs: More parameters of kvpress's scorer press (e.g. ``{"window_size": 32}`` for SnapKV).
        stop_ids: Token ids that end an answer early (kept in it); none: exactly ``max_new_tokens``.

    Returns:
        One :class:`KvpressResult` per case, in the cases' order.

    Raises:
        KvpressUnavailable: kvpress's Python is not there (run ``make kvpress-venv``).
        KvpressError: A bad setting, or a driver that exited with an error, timed out or wrote unreadable
            results (the message quotes its stderr).
    """
    job = build_job(cases, press=press, compression_ratio=compression_ratio, mode=mode, model_dir=model_dir,
                    threads=threads, decode=decode, dtype=dtype, press_kwargs=press_kwargs, stop_ids=stop_ids)
    exe = _python_or_raise(python)
    if not cases:
        return []
    with tempfile.TemporaryDirectory(prefix="beaconkv-kvpress-") as tmp:
        job_path, out_path = Path(tmp, "job.json"), Path(tmp, "out.jsonl")
        job_path.write_text(json.dumps(job), encoding="utf-8")
        # -I: the driver's folder (which holds this kvpress.py) must not shadow the kvpress package, and the
        # caller's PYTHONPATH must not mix beaconkv's environment into kvpress's
        cmd = [str(exe), "-I", str(DRIVER), str(job_path), str(out_path)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=_driver_env(threads),
                                  stdin=subprocess.DEVNULL)
        except subprocess.TimeoutExpired as err:
            done = _count_lines(out_path)
            raise KvpressError(f"the kvpress driver ran past timeout_s={timeout_s:g} s for press={press!r} "
                               f"({done} of {len(cases)} cases done) and was killed; raise timeout_s or run "
                               "fewer or shorter cases") from err
        except OSError as err:
            raise KvpressUnavailable(f"cannot start kvpress's Python {exe}: {err}; rebuild it with "
                                     "`make kvpress-venv`") from err
        if proc.returncode != 0:
            raise KvpressError(f"the kvpress driver exited with status {proc.returncode} for press={press!r}, "
                               f"mode={mode!r}:\n{proc.stderr[-_STDERR_TAIL:]}")
        if not out_path.is_file():
            raise KvpressError(f"the kvpress driver exited 0 but wrote no results file:\n{proc.stderr[-_STDERR_TAIL:]}")
        return parse_results(out_path.read_text(encoding="utf-8"), cases)


def kvpress_versions(python: Path | None = None, timeout_s: float = 120.0) -> dict:
    """The versions of Python, torch, transformers and kvpress in kvpress's environment (for a report).

    Raises:
        KvpressUnavailable: kvpress's Python is not there (run ``make kvpress-venv``).
        KvpressError: The driver could not report them.
    """
    exe = _python_or_raise(python)
    try:
        proc = subprocess.run([str(exe), "-I", str(DRIVER), "--versions"], capture_output=True, text=True,
                              timeout=timeout_s, env=_driver_env(1), stdin=subprocess.DEVNULL)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise KvpressError(f"cannot ask {exe} for its versions: {err}") from err
    if proc.returncode != 0:
        raise KvpressError(f"{exe} {DRIVER.name} --versions exited {proc.returncode}:\n{proc.stderr[-_STDERR_TAIL:]}")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError) as err:
        raise KvpressError(f"{exe} {DRIVER.name} --versions printed {proc.stdout[:200]!r}, not JSON") from err


def _count_lines(path: Path) -> int:
    try:
        return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
    except OSError:
        return 0
