"""Shared fixtures of the evaluation tests: the shared data folder and a fake chat tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

# <repo>/tests/eval/conftest.py -> <repo>/../shared/data (never copied into the project).
SHARED_DATA = Path(__file__).resolve().parents[2].parent / "shared" / "data"


@pytest.fixture(scope="session")
def shared_data() -> Path:
    """The shared data folder with aime24.jsonl and math500.jsonl."""
    if not (SHARED_DATA / "aime24.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    return SHARED_DATA


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
