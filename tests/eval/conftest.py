"""Shared fixtures of the evaluation tests: the project's data folder and a fake chat tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from beaconkv.paths import data_dir


@pytest.fixture(scope="session")
def project_data() -> Path:
    """The project's own data folder (``beaconkv.paths.data_dir()``): aime24.jsonl, math500.jsonl, traces/."""
    folder = data_dir()
    for name in ("aime24.jsonl", "math500.jsonl"):
        assert (folder / name).is_file(), f"{folder / name} is missing: the project ships it under data/"
    return folder


class FakeChatTokenizer:
    """ChatML-like template; records the keyword arguments it was called with."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=False, **kwargs):
        self.calls.append({"add_generation_prompt": add_generation_prompt, "tokenize": tokenize, **kwargs})
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return text + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.fixture
def fake_tokenizer() -> FakeChatTokenizer:
    """A fresh fake tokenizer."""
    return FakeChatTokenizer()
