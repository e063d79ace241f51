"""Every field of OpenAI's two create-calls is implemented, refused or (when it cannot change the answer)
ignored — taken from the installed ``openai`` package's own parameter types, so a field OpenAI adds fails here
until it is placed; each refused field gets 400 ``unsupported`` when on and is accepted when off; each ignored
field is accepted."""

from __future__ import annotations

import typing

import pytest

from beaconkv.serve.schema import IGNORED_FIELDS, REFUSED_FIELDS, ChatCompletionRequest, CompletionRequest

from .conftest import NAME

openai = pytest.importorskip("openai")

IMPLEMENTED = {
    "chat": {"messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
             "stream_options", "stop", "seed", "presence_penalty", "frequency_penalty", "logit_bias", "logprobs",
             "top_logprobs"},
    "text": {"prompt", "model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop", "seed",
             "presence_penalty", "frequency_penalty", "logit_bias", "logprobs"},
}
ROUTES = {"chat": ("/v1/chat/completions", ChatCompletionRequest), "text": ("/v1/completions", CompletionRequest)}
BASE = {"chat": {"model": NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1},
        "text": {"model": NAME, "prompt": "hi", "max_tokens": 1}}
# a value that turns each refused feature on
ON = {"echo": True, "suffix": "tail", "best_of": 2, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": "required", "functions": [{"name": "f"}], "function_call": {"name": "f"},
      "response_format": {"type": "json_object"}, "audio": {"voice": "alloy", "format": "wav"},
      "modalities": ["text", "audio"], "prediction": {"type": "content", "content": "x"}, "reasoning_effort": "high",
      "verbosity": "low", "web_search_options": {}, "moderation": {"model": "x"}, "repetition_penalty": 1.2,
      "min_p": 0.1, "min_tokens": 3, "use_beam_search": True, "length_penalty": 0.5, "stop_token_ids": [5],
      "prompt_logprobs": 1, "guided_json": {}, "guided_regex": "a+", "guided_choice": ["a"], "guided_grammar": "x",
      "structured_outputs": {"json": {}}}
OFF = {"echo": False, "suffix": "", "best_of": 1, "tools": [], "tool_choice": "none", "functions": [],
       "function_call": "auto", "response_format": {"type": "text"}, "modalities": ["text"], "repetition_penalty": 1,
       "min_p": 0, "min_tokens": 0, "use_beam_search": False, "length_penalty": 1.0, "stop_token_ids": []}


def _openai_fields(kind: str) -> set[str]:
    if kind == "chat":
        from openai.types.chat import completion_create_params as params
    else:
        from openai.types import completion_create_params as params
    return set(typing.get_type_hints(params.CompletionCreateParamsBase)) | {"stream"}


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_every_openai_field_is_implemented_refused_or_ignored(kind):
    fields = _openai_fields(kind)
    declared = set(ROUTES[kind][1].model_fields)
    assert fields <= declared, f"fields the model does not declare (they would be silently ignored): {fields - declared}"
    placed = IMPLEMENTED[kind] | set(REFUSED_FIELDS) | IGNORED_FIELDS
    assert fields <= placed, f"OpenAI fields neither implemented, refused nor ignored: {fields - placed}"
    assert not IMPLEMENTED[kind] & (set(REFUSED_FIELDS) | IGNORED_FIELDS)


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_a_refused_field_gets_400_unsupported_when_on_and_is_accepted_when_off(live, kind):
    path, model = ROUTES[kind]
    refused = [f for f in REFUSED_FIELDS if f in model.model_fields]
    assert set(ON) >= set(refused)
    for field in refused:
        r = live.post(path, json={**BASE[kind], field: ON[field]})
        assert r.status_code == 400, (field, r.text)
        error = r.json()["error"]
        assert (error["param"], error["code"]) == (field, "unsupported") and "not supported" in error["message"]
        for off in (None, OFF.get(field, None)):
            r = live.post(path, json={**BASE[kind], field: off})
            assert r.status_code == 200, (field, off, r.text)


@pytest.mark.parametrize("kind", ["chat", "text"])
def test_an_ignored_field_is_accepted(live, kind):
    path, model = ROUTES[kind]
    for field in sorted(f for f in IGNORED_FIELDS if f in model.model_fields):
        r = live.post(path, json={**BASE[kind], field: {"any": ["value"]}})
        assert r.status_code == 200, (field, r.text)
