"""Tokenizer and chat templates: parity with transformers' rendering, Qwen3's enable_thinking, eos ids."""

from __future__ import annotations

import json

import pytest

import beaconkv
from beaconkv.tokenizer import Tokenizer

# A template in the shape of Qwen3's: thinking switch, system turn, generation prompt.
QWEN3_LIKE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
    "{%- endif %}"
)


@pytest.fixture(scope="module")
def embedded_dir():
    return beaconkv.embedded_model_path()


@pytest.fixture(scope="module")
def qwen_like_dir(embedded_dir, tmp_path_factory):
    import shutil

    d = tmp_path_factory.mktemp("qwen_tok")
    for f in ("tokenizer.json", "config.json"):
        shutil.copy(embedded_dir / f, d / f)
    cfg = json.loads((embedded_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = QWEN3_LIKE
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 0]}))
    return d


def test_chat_template_renders_like_transformers(embedded_dir):
    from transformers import AutoTokenizer

    ours = beaconkv.load_tokenizer(embedded_dir)
    ref = AutoTokenizer.from_pretrained(embedded_dir)
    for msgs in (
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Héllo 中文 🙂"}],
        [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
    ):
        for gen in (True, False):
            expect = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen) == expect
            assert ours.apply_chat_template(msgs, add_generation_prompt=gen, tokenize=True) == ref.encode(
                expect, add_special_tokens=False)


def test_qwen3_enable_thinking_switch(qwen_like_dir):
    from transformers import AutoTokenizer

    ours = beaconkv.load_tokenizer(qwen_like_dir)
    ref = AutoTokenizer.from_pretrained(qwen_like_dir)
    msgs = [{"role": "user", "content": "Solve x+1=2."}]
    for flag in (True, False):
        got = ours.apply_chat_template(msgs, enable_thinking=flag)
        assert got == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True, enable_thinking=flag)
        assert ("<think>" in got) is (not flag)
    assert ours.eos_token_ids == [2, 0]


def test_encode_decode_round_trip(embedded_dir):
    tok = beaconkv.load_tokenizer(embedded_dir)
    for text in ("Hello world", "12345 3.14159", "  indented\n\tcode()", "Ünïcødé 中文 🙂"):
        assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids and tok.decode([tok.eos_token_ids[0]], skip_special_tokens=True) == ""


def test_missing_tokenizer_file(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        Tokenizer.from_pretrained(tmp_path)


def test_no_template_is_a_clear_error(embedded_dir, tmp_path):
    import shutil

    shutil.copy(embedded_dir / "tokenizer.json", tmp_path / "tokenizer.json")
    tok = Tokenizer.from_pretrained(tmp_path)
    with pytest.raises(ValueError, match="no chat_template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
