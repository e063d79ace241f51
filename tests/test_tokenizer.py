"""Tokenizer and chat templates: parity with transformers' rendering, Qwen3's enable_thinking, eos ids, and an error
naming the file for every tokenizer file that cannot be read."""

from __future__ import annotations

import json
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import beaconkv
from beaconkv.tokenizer import Tokenizer, TokenizerFileError

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


# --------------------------------------------------------------------------------------------
# every tokenizer file that cannot be read is named


@pytest.fixture()
def tok_dir(embedded_dir, tmp_path):
    import shutil

    for f in ("tokenizer.json", "tokenizer_config.json", "config.json"):
        shutil.copy(embedded_dir / f, tmp_path / f)
    return tmp_path


@pytest.mark.parametrize(("content", "reason"), [
    (b"\xff\xfe garbage \x00\x81", "stream did not contain valid UTF-8"),
    (b"{ this is not json", "key must be a string"),
    (b"", "EOF while parsing"),
    (b'{"model": 3}', ""),  # valid JSON, wrong structure
    (b"[1, 2, 3]", ""),
], ids=["invalid UTF-8", "garbage JSON", "empty", "wrong structure", "a list"])
def test_unreadable_tokenizer_json_names_the_file(tok_dir, content, reason):
    (tok_dir / "tokenizer.json").write_bytes(content)
    with pytest.raises(TokenizerFileError, match=re.escape(str(tok_dir / "tokenizer.json"))
                       + rf" cannot be loaded by the tokenizers library \(.*{re.escape(reason)}.*\); restore"):
        Tokenizer.from_pretrained(tok_dir)


def test_truncated_tokenizer_json_names_the_file(tok_dir):
    text = (tok_dir / "tokenizer.json").read_bytes()
    (tok_dir / "tokenizer.json").write_bytes(text[: len(text) // 2])
    with pytest.raises(TokenizerFileError, match=re.escape(str(tok_dir / "tokenizer.json"))):
        Tokenizer.from_pretrained(tok_dir)


TC, GC = "tokenizer_config.json", "generation_config.json"


@pytest.mark.parametrize(("name", "content", "message"), [
    (TC, b"{not json", rf"{TC} is not valid UTF-8 JSON \(JSONDecodeError"),
    (TC, b"\xff\xfe", rf"{TC} is not valid UTF-8 JSON \(UnicodeDecodeError"),
    (TC, b"[1]", rf"{TC} must hold a JSON object, not a list"),
    (TC, b'{"chat_template": 3}', rf"{TC}: chat_template must be a string or a list"),
    (TC, b'{"chat_template": [{"name": "default"}]}', rf"{TC}: chat_template must be a string or a list"),
    (TC, b'{"eos_token": {"content": 5}}', rf"{TC}: eos_token=.* must be a string"),
    (GC, b'{"eos_token_id": "2"}', rf"{GC}: eos_token_id=2 must be a token id"),
    (GC, b'{"eos_token_id": [2, 1.5]}', rf"{GC}: eos_token_id=\[2, 1.5\] must be"),
    (GC, b'"x"', rf"{GC} must hold a JSON object, not a str"),
    ("config.json", b"{", r"config.json is not valid UTF-8 JSON"),
    ("chat_template.jinja", b"\xff{{ x }}", r"chat_template.jinja cannot be read as UTF-8 text"),
])
def test_unreadable_tokenizer_side_files_name_the_file(tok_dir, name, content, message):
    (tok_dir / name).write_bytes(content)
    with pytest.raises(TokenizerFileError, match=re.escape(str(tok_dir)) + "/" + message):
        Tokenizer.from_pretrained(tok_dir)


def test_tokenizer_file_error_is_a_checkpoint_error():
    from beaconkv.models import CheckpointError

    assert issubclass(TokenizerFileError, CheckpointError) and issubclass(TokenizerFileError, ValueError)


def test_named_chat_templates_pick_default(tok_dir):
    cfg = json.loads((tok_dir / "tokenizer_config.json").read_text())
    cfg["chat_template"] = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(cfg))
    assert Tokenizer.from_pretrained(tok_dir).chat_template == "D"


@pytest.mark.parametrize("kind", ["flip bytes", "truncate", "insert bytes"])
@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_a_damaged_tokenizer_json_is_refused_naming_it_or_loads(embedded_dir, tmp_path_factory, kind, data):
    """Byte-level damage ends in TokenizerFileError naming the file (never the library's bare Exception, nor a
    panic), or in a tokenizer that still encodes and decodes."""
    raw = bytearray((embedded_dir / "tokenizer.json").read_bytes())
    if kind == "flip bytes":
        for at, value in data.draw(st.lists(st.tuples(st.integers(0, len(raw) - 1), st.integers(0, 255)),
                                            min_size=1, max_size=5), label="flips"):
            raw[at] = value
    elif kind == "truncate":
        raw = raw[:data.draw(st.integers(0, len(raw) - 1), label="length")]
    else:
        at = data.draw(st.integers(0, len(raw)), label="at")
        raw[at:at] = data.draw(st.binary(min_size=1, max_size=10), label="bytes")
    d = tmp_path_factory.mktemp("damaged")
    (d / "tokenizer.json").write_bytes(bytes(raw))
    try:
        tok = Tokenizer.from_pretrained(d)
    except TokenizerFileError as err:
        assert str(d / "tokenizer.json") in str(err)
    else:
        assert isinstance(tok.decode(tok.encode("Hello world")), str)
