"""Fuzzed checkpoints: Hypothesis mutates a tiny checkpoint's ``config.json`` and its safetensors header,
and every example ends, within :data:`TIME_LIMIT_S`, in either

* a named error (:class:`CheckpointError`, :class:`ConfigFileError` or :class:`UnsupportedModelError`,
  never a bare ``RuntimeError``/``KeyError``/``struct.error``/torch error) whose message names the
  checkpoint's directory, or
* a correct load: the unmutated checkpoint's logits where the mutation means nothing (an unknown key,
  an absent key with its default, a header that parses to the same tensors); exactly the tensors the
  mutated file holds where it is still a valid safetensors file (two same-sized tensors' names or
  bytes swapped); finite logits where a rotary setting changed.

Each mutation kind is its own test case, so every kind runs whatever Hypothesis draws, and the kinds
whose outcome is known are asserted exactly (a wrong type, an out-of-range value, a wrong width, a
non-float dtype and a reshaped tensor are always refused; an unknown key always loads the same
logits). The examples come from the ``ci`` profile of ``tests/conftest.py`` (derandomized).
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

import beaconkv
from beaconkv.models import CheckpointError, ConfigFileError, ModelConfig, UnsupportedModelError
from beaconkv.models.config import CONFIG_LIMITS

from ..conftest import save_tiny_model

NAMED = (CheckpointError, ConfigFileError, UnsupportedModelError)
TIME_LIMIT_S = 5.0
FUZZ = settings(max_examples=40, deadline=None)
IDS = torch.arange(3, 30)[None]
ARCHS = ("llama", "qwen2", "qwen3")

# The keys ModelConfig.from_dict reads; any other key is ignored.
KNOWN_KEYS = {
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "attention_bias", "rope_parameters", "rope_scaling", "rope_theta", "bos_token_id", "eos_token_id", "hidden_act",
    "mlp_bias", "use_sliding_window", "layer_types", "partial_rotary_factor",
}
ROPE_KEYS = {"rope_type", "type", "factor", "rope_theta", "low_freq_factor", "high_freq_factor",
             "original_max_position_embeddings", "beta_fast", "beta_slow", "attention_factor", "mscale",
             "mscale_all_dim", "truncate", "partial_rotary_factor"}
# The JSON kind of every field the decoder uses (absent ones are skipped per architecture).
FIELDS = {
    "vocab_size": "int", "hidden_size": "int", "intermediate_size": "int", "num_hidden_layers": "int",
    "num_attention_heads": "int", "num_key_value_heads": "int", "head_dim": "int", "max_position_embeddings": "int",
    "rms_norm_eps": "float", "tie_word_embeddings": "bool", "attention_bias": "bool", "mlp_bias": "bool",
    "use_sliding_window": "bool", "bos_token_id": "id", "eos_token_id": "id", "rope_parameters": "object",
    "layer_types": "list", "hidden_act": "str",
}
WIDTHS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
          "num_key_value_heads", "head_dim", "max_position_embeddings")
REQUIRED = {"model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads"}
# Absent keys whose default contradicts the checkpoint (the rest default to what the checkpoint holds,
# except the rotary settings, whose default is another, loadable rotary embedding).
REFUSED_IF_ABSENT = {"llama": REQUIRED | {"num_key_value_heads"}, "qwen2": REQUIRED | {"num_key_value_heads"},
                     "qwen3": REQUIRED | {"num_key_value_heads", "head_dim", "tie_word_embeddings"}}
CHANGED_IF_ABSENT = {"rope_parameters"}
SAFETENSORS_DTYPES = ["BOOL", "U8", "I8", "F8_E5M2", "F8_E4M3", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                      "F64", "I64", "U64"]
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "I16": 2, "U16": 2, "F16": 2, "BF16": 2,
               "I32": 4, "U32": 4, "F32": 4, "F64": 8, "I64": 8, "U64": 8}

json_leaves = (st.none() | st.booleans() | st.integers(-(10**12), 10**12) | st.floats(allow_nan=True)
               | st.text(max_size=8))
json_values = st.recursive(json_leaves, lambda inner: st.lists(inner, max_size=3)
                           | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=6)


class Base:
    """An unmutated checkpoint: its config, header, data bytes and reference logits (a plain class: the
    examples Hypothesis prints show its one-word repr, not the bytes)."""

    def __init__(self, arch: str, config: dict[str, Any], header_bytes: bytes, data: bytes, logits: torch.Tensor):
        self.arch, self.config, self.header_bytes, self.data, self.logits = arch, config, header_bytes, data, logits
        self.header: dict[str, Any] = json.loads(header_bytes)

    @property
    def tensors(self) -> list[str]:
        return sorted(k for k in self.header if k != "__metadata__")

    def __repr__(self) -> str:
        return f"Base({self.arch!r})"


def _split(path: Path) -> tuple[bytes, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return raw[8:8 + n], raw[8 + n:]


@pytest.fixture(scope="module")
def bases(tiny_models, tmp_path_factory) -> dict[str, Base]:
    dirs = {kind: tiny_models[kind][0] for kind in ARCHS}
    dirs["qwen3_yarn"] = tmp_path_factory.mktemp("qwen3_yarn")
    save_tiny_model("qwen3_yarn", dirs["qwen3_yarn"])
    out = {}
    for kind, d in dirs.items():
        header_bytes, data = _split(d / "model.safetensors")
        out[kind] = Base(kind, json.loads((d / "config.json").read_text()), header_bytes, data,
                         beaconkv.load_model(d)(IDS))
    return out


@pytest.fixture(scope="module")
def scratch(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matmuls run in one thread: on a busy 2-core box, two OpenMP threads make a 3 ms forward 300 ms."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _write(scratch: Path, config: Any, header: dict[str, Any] | bytes, data: bytes) -> Path:
    d = Path(tempfile.mkdtemp(dir=scratch))
    (d / "config.json").write_text(json.dumps(config))
    if isinstance(header, dict):
        header = json.dumps(header).encode()
        header += b" " * (-len(header) % 8)
    (d / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + data)
    return d


def _load(d: Path):
    """Loads ``d``: ``(model, None)`` or ``(None, named error)``, within the time bound; anything else fails."""
    start = time.perf_counter()
    try:
        model, err = beaconkv.load_model(d), None
    except NAMED as e:
        model, err = None, e
    elapsed = time.perf_counter() - start
    assert elapsed < TIME_LIMIT_S, f"loading took {elapsed:.1f} s"
    if err is not None:
        assert type(err) in NAMED and str(d) in str(err), f"{type(err).__name__} names no file of {d}: {err}"
    return model, err


def _check(d: Path, base: Base, expect: str, field: str | None = None) -> None:
    """Asserts the outcome of loading ``d``, then removes it.

    ``expect`` is ``|``-separated outcomes, any of which passes: ``refused`` (a named error, naming
    ``field`` if given), ``same`` (the reference logits), ``faithful`` (exactly the mutated file's
    tensors) or ``finite`` (finite logits).
    """
    allowed = expect.split("|")
    try:
        model, err = _load(d)
        if err is not None:
            assert "refused" in allowed, f"refused, expected {expect}: {err}"
            assert field is None or field in str(err), f"{field} not named in: {err}"
            return
        assert allowed != ["refused"], "the mutation was loaded"
        logits = model(IDS)
        if "same" in allowed:
            torch.testing.assert_close(logits, base.logits, atol=0, rtol=0)
        elif "finite" in allowed:
            assert torch.isfinite(logits).all()
        else:  # faithful: the model holds exactly the file's tensors
            stored = load_file(d / "model.safetensors")
            for name, value in model.state_dict().items():
                source = "model.embed_tokens.weight" if name == "lm_head.weight" and name not in stored else name
                assert torch.equal(value, stored[source]), name
    finally:
        shutil.rmtree(d, ignore_errors=True)


def _effective(base: Base, field: str) -> Any:
    return getattr(ModelConfig.from_dict(base.config), field)


# --------------------------------------------------------------------------------------------
# config.json


def _fields(bases: dict[str, Base], kind: str) -> st.SearchStrategy:
    """``(arch, field)`` for the fields of JSON kind ``kind`` present in an architecture's config."""
    return st.sampled_from([(a, f) for a in ARCHS for f, k in FIELDS.items() if k == kind and f in bases[a].config])


def _wrong_type(kind: str) -> st.SearchStrategy:
    other = {
        "int": st.floats(allow_nan=True) | st.text(max_size=6) | st.booleans() | st.lists(st.integers(), max_size=2)
        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        "float": st.text(max_size=6) | st.booleans() | st.lists(st.floats(), max_size=2) | st.dictionaries(
            st.text(max_size=3), st.floats(), max_size=2),
        "bool": st.integers() | st.floats(allow_nan=True) | st.text(max_size=6) | st.lists(st.booleans(), max_size=2)
        | st.dictionaries(st.text(max_size=3), st.booleans(), max_size=2),
        "id": st.floats(allow_nan=True) | st.text(max_size=6) | st.booleans() | st.dictionaries(
            st.text(max_size=3), st.integers(), max_size=2) | st.lists(st.floats() | st.text() | st.booleans(),
                                                                        min_size=1, max_size=3),
        "object": st.integers() | st.floats(allow_nan=True) | st.text(max_size=6) | st.booleans()
        | st.lists(st.integers(), max_size=2),
        "list": st.integers() | st.floats(allow_nan=True) | st.text(max_size=6) | st.booleans()
        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
        "str": st.integers() | st.floats(allow_nan=True) | st.booleans() | st.lists(st.text(), max_size=2)
        | st.text(max_size=8).filter(lambda t: t not in ("silu", "swish")),
    }
    return other[kind]


def _out_of_range(field: str, vocab: int) -> st.SearchStrategy:
    kind = FIELDS[field]
    if kind == "int":
        limit = CONFIG_LIMITS[field]
        strategy = st.integers(max_value=0) | st.integers(min_value=limit + 1, max_value=10**40)
        return strategy | st.integers(0, 2047).map(lambda k: 2 * k + 1) if field == "head_dim" else strategy
    if kind == "float":
        return st.floats(max_value=0) | st.floats(min_value=1, exclude_min=True) | st.just(math.nan)
    return st.integers(max_value=-1) | st.integers(min_value=vocab, max_value=10**30)  # token ids


@pytest.mark.parametrize("kind", sorted(set(FIELDS.values())))
@FUZZ
@given(data=st.data())
def test_a_value_of_the_wrong_json_type_is_refused_naming_the_field(bases, scratch, kind, data):
    arch, field = data.draw(_fields(bases, kind), label="arch, field")
    base = bases[arch]
    value = data.draw(_wrong_type(kind), label="value")
    _check(_write(scratch, {**base.config, field: value}, base.header, base.data), base, "refused", field)


@pytest.mark.parametrize("kind", ["int", "float", "id"])
@FUZZ
@given(data=st.data())
def test_a_value_out_of_range_is_refused_naming_the_field(bases, scratch, kind, data):
    arch, field = data.draw(_fields(bases, kind), label="arch, field")
    base = bases[arch]
    value = data.draw(_out_of_range(field, base.config["vocab_size"]), label="value")
    _check(_write(scratch, {**base.config, field: value}, base.header, base.data), base, "refused", field)


@pytest.mark.parametrize("field", WIDTHS)
@FUZZ
@given(data=st.data())
def test_a_width_other_than_the_checkpoints_is_refused(bases, scratch, field, data):
    """Every width but max_position_embeddings is pinned by the tensors; that one only bounds prompts."""
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    base = bases[arch]
    true = _effective(base, field)
    values = st.integers(1, 1500).map(lambda v: 2 * v) if field == "head_dim" else st.integers(1, 3000)
    value = data.draw(values.filter(lambda v: v != true), label="value")
    expect = "same" if field == "max_position_embeddings" else "refused"
    _check(_write(scratch, {**base.config, field: value}, base.header, base.data), base, expect)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_absent_key(bases, scratch, arch):
    """Every key of the config deleted in turn: refused (naming it), or the same logits, or (the rotary
    settings) another loadable rotary embedding."""
    base = bases[arch]
    for key in sorted(base.config):
        expect = "refused" if key in REFUSED_IF_ABSENT[arch] else "finite" if key in CHANGED_IF_ABSENT else "same"
        config = {k: v for k, v in base.config.items() if k != key}
        _check(_write(scratch, config, base.header, base.data), base, expect, key if expect == "refused" else None)


@FUZZ
@given(data=st.data())
def test_absent_keys_together(bases, scratch, data):
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    base = bases[arch]
    gone = data.draw(st.sets(st.sampled_from(sorted(base.config)), min_size=2, max_size=5), label="absent")
    expect = ("refused" if gone & REFUSED_IF_ABSENT[arch] else "finite" if gone & CHANGED_IF_ABSENT else "same")
    config = {k: v for k, v in base.config.items() if k not in gone}
    _check(_write(scratch, config, base.header, base.data), base, expect)


@FUZZ
@given(data=st.data())
def test_unknown_keys_change_nothing(bases, scratch, data):
    arch = data.draw(st.sampled_from(ARCHS), label="arch")
    base = bases[arch]
    names = st.text(min_size=1, max_size=12).filter(lambda k: k not in KNOWN_KEYS and k not in base.config)
    extra = data.draw(st.dictionaries(names, json_values, min_size=1, max_size=4), label="extra")
    rope_names = st.text(min_size=1, max_size=12).filter(lambda k: k not in ROPE_KEYS)
    rope_extra = data.draw(st.dictionaries(rope_names, json_leaves, max_size=3), label="rope extra")
    config = {**base.config, **extra, "rope_parameters": {**base.config["rope_parameters"], **rope_extra}}
    _check(_write(scratch, config, base.header, base.data), base, "same")


@pytest.mark.parametrize("arch", ["llama", "qwen3_yarn"])
@FUZZ
@given(data=st.data())
def test_rotary_settings(bases, scratch, arch, data):
    """A scaled rope's parameters: refused, or loaded with finite logits (the same ones if nothing changed)."""
    base = bases[arch]
    rope = dict(base.config["rope_parameters"])
    key = data.draw(st.sampled_from(sorted(ROPE_KEYS)), label="key")
    if data.draw(st.booleans(), label="delete"):
        rope.pop(key, None)
    else:
        rope[key] = data.draw(json_leaves | st.floats(-1e9, 1e9) | st.integers(-(10**6), 10**8)
                              | st.sampled_from(["default", "linear", "llama3", "yarn", "dynamic"]), label="value")
    config = {**base.config, "rope_parameters": rope}
    d = _write(scratch, config, base.header, base.data)
    try:
        same = ModelConfig.from_dict(config).rope == ModelConfig.from_dict(base.config).rope
    except NAMED:
        same = False
    _check(d, base, "same" if same else "refused|finite")


# --------------------------------------------------------------------------------------------
# the safetensors header


def _header(base: Base) -> dict[str, Any]:
    """A fresh copy of the unmutated header."""
    return json.loads(base.header_bytes)


def _numel(shape: list[int]) -> int:
    return math.prod(shape)


@FUZZ
@given(data=st.data())
def test_any_dtype_string(bases, scratch, data):
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    name = data.draw(st.sampled_from(base.tensors), label="tensor")
    dtype = data.draw(st.sampled_from(SAFETENSORS_DTYPES) | st.text(max_size=8), label="dtype")
    header = _header(base)
    header[name]["dtype"] = dtype
    _check(_write(scratch, base.config, header, base.data), base, "same" if dtype == "F32" else "refused")


@pytest.mark.parametrize("dtype", [d for d in SAFETENSORS_DTYPES if d != "F32"])
@settings(FUZZ, max_examples=8)
@given(data=st.data())
def test_another_dtype_over_the_same_bytes_is_refused_naming_the_tensor(bases, scratch, dtype, data):
    """The shape is fitted so the bytes still match, so safetensors accepts the file: the check is ours."""
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    name = data.draw(st.sampled_from(base.tensors), label="tensor")
    header = _header(base)
    entry, size = header[name], DTYPE_BYTES[dtype]
    rows = entry["shape"][0] * 4
    entry["dtype"] = dtype
    entry["shape"] = ([rows // size, *entry["shape"][1:]] if rows % size == 0
                      else [_numel(entry["shape"]) * 4 // size])
    d = _write(scratch, base.config, header, base.data)
    if dtype in ("F16", "BF16"):  # a float weight: the shapes are then wrong
        _check(d, base, "refused", name)
    else:
        _check(d, base, "refused", f"{name} ({dtype}, in model.safetensors)")


def _reshapes(shape: list[int]) -> st.SearchStrategy:
    """Other shapes of the same number of elements: 1, 2 or 3 factors."""
    n = _numel(shape)
    divisors = [k for k in range(1, n + 1) if n % k == 0]
    return st.one_of(
        st.just([n]),
        st.sampled_from(divisors).map(lambda k: [k, n // k]),
        st.tuples(st.sampled_from(divisors), st.sampled_from(divisors)).filter(
            lambda ab: n % (ab[0] * ab[1]) == 0).map(lambda ab: [ab[0], ab[1], n // (ab[0] * ab[1])]),
    )


@pytest.mark.parametrize("kind", ["random", "same number of elements", "transposed", "extra dimension"])
@FUZZ
@given(data=st.data())
def test_a_changed_shape_is_refused(bases, scratch, kind, data):
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    name = data.draw(st.sampled_from(base.tensors), label="tensor")
    header = _header(base)
    old = header[name]["shape"]
    new = data.draw({
        "random": st.lists(st.integers(0, 300), max_size=3),
        "same number of elements": _reshapes(old),
        "transposed": st.just(old[::-1]),
        "extra dimension": st.integers(0, len(old)).map(lambda i: [*old[:i], 1, *old[i:]]),
    }[kind], label="shape")
    header[name]["shape"] = new
    same_bytes = _numel(new) == _numel(old)
    _check(_write(scratch, base.config, header, base.data), base, "same" if new == old else "refused",
           name if same_bytes else None)  # a shape of other bytes is refused by safetensors, naming the file


def _sizes(base: Base) -> dict[str, int]:
    return {n: e["data_offsets"][1] - e["data_offsets"][0] for n, e in base.header.items() if n != "__metadata__"}


def _pairs(base: Base, same_size: bool | None) -> list[tuple[str, str]]:
    sizes = _sizes(base)
    names = base.tensors
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1:]
            if same_size is None or (sizes[a] == sizes[b]) == same_size]


@pytest.mark.parametrize("kind", ["any", "shift", "swap any two", "swap two of a size"])
@FUZZ
@given(data=st.data())
def test_changed_offsets(bases, scratch, kind, data):
    """Offsets that no longer tile the data are refused; two same-sized tensors' offsets swapped make a valid
    file, which loads exactly what it holds."""
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    header = _header(base)
    end = len(base.data)
    if kind in ("any", "shift"):
        name = data.draw(st.sampled_from(base.tensors), label="tensor")
        start, stop = header[name]["data_offsets"]
        if kind == "any":
            new = data.draw(st.lists(st.integers(-5, end + 100), min_size=0, max_size=3), label="offsets")
        else:
            delta = data.draw(st.integers(-end, end).filter(bool), label="delta")
            new = [start + delta, stop + delta]
        header[name]["data_offsets"] = new
        expect = "same" if new == [start, stop] else "refused"
    else:
        a, b = data.draw(st.sampled_from(_pairs(base, True if kind == "swap two of a size" else None)), label="pair")
        header[a]["data_offsets"], header[b]["data_offsets"] = header[b]["data_offsets"], header[a]["data_offsets"]
        expect = "faithful" if _sizes(base)[a] == _sizes(base)[b] else "refused"
    _check(_write(scratch, base.config, header, base.data), base, expect)


@pytest.mark.parametrize("kind", ["rename", "another layer", "swap two names", "drop", "duplicate"])
@FUZZ
@given(data=st.data())
def test_changed_names(bases, scratch, kind, data):
    """A name the architecture does not have, a layer index off the config's, a dropped or duplicated entry:
    refused. Two same-shaped tensors' names swapped: a valid file, loaded exactly as it is."""
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    header = _header(base)
    raw: bytes | None = None
    if kind == "swap two names":
        a, b = data.draw(st.sampled_from(_pairs(base, None)), label="pair")
        header[a], header[b] = header[b], header[a]
        expect = "faithful" if header[a]["shape"] == header[b]["shape"] else "refused"
    else:
        name = data.draw(st.sampled_from(base.tensors), label="tensor")
        entry = header.pop(name)
        expect = "refused"
        if kind == "rename":
            new = data.draw(st.text(min_size=1, max_size=40).filter(lambda t: t not in base.header), label="name")
            header[new] = entry
        elif kind == "another layer":
            layer = data.draw(st.integers(0, 10**15), label="layer")
            parts = name.split(".")
            if parts[:2] == ["model", "layers"]:
                new = ".".join([*parts[:2], str(layer), *parts[3:]])
                expect = "same" if new == name else "refused"
            else:
                new = f"model.layers.{layer}.{name}"
            if new in header:  # the entry it lands on is lost: the offsets no longer tile the data
                header.pop(new)
            header[new] = entry
        elif kind == "duplicate":  # the raw JSON holds the key twice, the second time with other offsets
            other = dict(entry, data_offsets=data.draw(st.lists(st.integers(0, len(base.data)), min_size=2,
                                                                max_size=2), label="offsets"))
            text = json.dumps({**header, name: entry})[:-1] + f", {json.dumps(name)}: {json.dumps(other)}}}"
            raw = text.encode() + b" " * (-len(text.encode()) % 8)
            expect = "refused|same"  # same only if the offsets drawn are the entry's own
        # "drop": the entry is gone, its bytes are a hole
    _check(_write(scratch, base.config, raw if raw is not None else header, base.data), base, expect)


@FUZZ
@given(data=st.data())
def test_metadata(bases, scratch, data):
    """``__metadata__`` is a map of strings to strings (or absent); anything else is refused."""
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    meta = data.draw(json_values | st.dictionaries(st.text(max_size=6), st.text(max_size=6), max_size=3),
                     label="metadata")
    header = {**_header(base), "__metadata__": meta}
    valid = meta is None or (isinstance(meta, dict) and all(isinstance(v, str) for v in meta.values()))
    _check(_write(scratch, base.config, header, base.data), base, "same" if valid else "refused")


@pytest.mark.parametrize("kind", ["header bytes", "length prefix"])
@FUZZ
@given(data=st.data())
def test_corrupted_header_bytes(bases, scratch, kind, data):
    base = bases[data.draw(st.sampled_from(ARCHS), label="arch")]
    raw = bytearray(base.header_bytes)
    d = Path(tempfile.mkdtemp(dir=scratch))
    (d / "config.json").write_text(json.dumps(base.config))
    if kind == "header bytes":
        flips = data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)), min_size=1,
                                   max_size=3), label="flips")
        for at, value in flips:
            raw[at] = value
        length = len(raw)
        try:
            same = json.loads(bytes(raw)) == base.header
        except ValueError:
            same = False
        expect = "same" if same else "refused|faithful"
    else:
        length = data.draw(st.integers(0, 2**64 - 1).filter(lambda n: n != len(raw)), label="length")
        expect = "refused"
    (d / "model.safetensors").write_bytes(length.to_bytes(8, "little") + bytes(raw) + base.data)
    _check(d, base, expect)
