"""Tokenizer: the checkpoint's ``tokenizer.json`` through the ``tokenizers`` library, and its chat
template rendered with jinja2 (no dependency on transformers).

The chat template is read from ``chat_template.jinja`` or ``tokenizer_config.json`` and rendered
the way Hugging Face renders it (sandboxed environment, ``trim_blocks``/``lstrip_blocks``,
``raise_exception``, ``tojson``, ``strftime_now``), so template switches such as Qwen3's
``enable_thinking`` work. End-of-sequence ids come from ``generation_config.json`` (falling back
to ``config.json`` and the tokenizer's eos token).

Every file is checked as it is read: a ``tokenizer.json`` the ``tokenizers`` library refuses (invalid
UTF-8, garbage JSON, a wrong structure), a config that is not a JSON object, or a value of the wrong
type raises :class:`TokenizerFileError` naming the file (the library's own exceptions name none).
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

from .models.loading import CheckpointError, resolve_checkpoint


class TokenizerFileError(CheckpointError):
    """A checkpoint's tokenizer files cannot be read: a ``tokenizer.json`` the ``tokenizers`` library
    refuses, a ``tokenizer_config.json`` / ``generation_config.json`` / ``config.json`` that is not a
    JSON object, or a chat template, special token or end-of-sequence id of the wrong type. The
    message names the file."""


_RESTORE = "restore the checkpoint's original file (re-download it or copy it from the model's page)"


def _token_str(tok: Any, path: Path, key: str) -> str | None:
    """``"<s>"`` or ``{"content": "<s>", ...}`` -> ``"<s>"`` (None stays None)."""
    content = tok.get("content") if isinstance(tok, dict) else tok
    if content is not None and not isinstance(content, str):
        raise TokenizerFileError(f"{path}: {key}={str(tok)[:80]!r} must be a string or {{\"content\": string}}; "
                                 f"{_RESTORE}.")
    return content


def _as_list(x: Any, path: Path, key: str) -> list[int]:
    """An id or a list of ids -> a list of ids (None -> [])."""
    if x is None:
        return []
    ids = list(x) if isinstance(x, list) else [x]
    if any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in ids):
        raise TokenizerFileError(f"{path}: {key}={str(x)[:80]} must be a token id or a list of token ids "
                                 f"(non-negative integers); {_RESTORE}.")
    return ids


def _chat_template(value: Any, path: Path) -> str | None:
    """A template string, or the ``"default"`` one (else the first) of a list of named templates."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
        return next((t["template"] for t in value if t.get("name") == "default"), value[0]["template"])
    raise TokenizerFileError(f"{path}: chat_template must be a string or a list of "
                             f"{{\"name\": ..., \"template\": string}}, got {str(value)[:80]!r}; {_RESTORE}.")


class Tokenizer:
    """Encodes, decodes and applies the chat template of one checkpoint.

    Args:
        tokenizer: A ``tokenizers.Tokenizer``.
        chat_template: Jinja source of the chat template (None: no template).
        bos_token: Beginning-of-sequence token string, if any.
        eos_token: End-of-sequence token string, if any.
        eos_token_ids: Ids that end generation.
    """

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        chat_template: str | None = None,
        bos_token: str | None = None,
        eos_token: str | None = None,
        eos_token_ids: list[int] | None = None,
    ) -> None:
        self._tok = tokenizer
        self.chat_template = chat_template
        self.bos_token = bos_token
        self.eos_token = eos_token
        ids = list(eos_token_ids or [])
        if not ids and eos_token is not None and tokenizer.token_to_id(eos_token) is not None:
            ids = [tokenizer.token_to_id(eos_token)]
        self.eos_token_ids: list[int] = ids
        self._template = None

    @classmethod
    def from_pretrained(cls, path_or_id: str | Path) -> "Tokenizer":
        """Loads ``tokenizer.json`` and friends from a checkpoint directory or hub id.

        Raises:
            FileNotFoundError: No ``tokenizer.json`` in the directory.
            TokenizerFileError: A tokenizer file cannot be read or has a wrong structure (the message
                names the file and what is wrong with it).
        """
        d = resolve_checkpoint(path_or_id)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise FileNotFoundError(f"no tokenizer.json in {d}; beaconkv needs a fast-tokenizer file.")
        tcfg = _read_json(d / "tokenizer_config.json")
        template = _chat_template(tcfg.get("chat_template"), d / "tokenizer_config.json")
        jinja = d / "chat_template.jinja"
        if jinja.is_file():
            try:
                template = jinja.read_text(encoding="utf-8")
            except (OSError, UnicodeDecodeError) as err:
                raise TokenizerFileError(f"{jinja} cannot be read as UTF-8 text ({err}); {_RESTORE}.") from None
        gen_path, cfg_path = d / "generation_config.json", d / "config.json"
        eos_ids = (_as_list(_read_json(gen_path).get("eos_token_id"), gen_path, "eos_token_id")
                   or _as_list(_read_json(cfg_path).get("eos_token_id"), cfg_path, "eos_token_id"))
        try:
            tokenizer = _HFTokenizer.from_file(str(tj))
        except Exception as err:  # the tokenizers library raises a bare Exception that names no file
            raise TokenizerFileError(
                f"{tj} cannot be loaded by the tokenizers library ({str(err)[:300]}); {_RESTORE} — beaconkv needs "
                "a fast-tokenizer tokenizer.json."
            ) from None
        return cls(
            tokenizer,
            chat_template=template,
            bos_token=_token_str(tcfg.get("bos_token"), d / "tokenizer_config.json", "bos_token"),
            eos_token=_token_str(tcfg.get("eos_token"), d / "tokenizer_config.json", "eos_token"),
            eos_token_ids=eos_ids,
        )

    @property
    def backend(self) -> _HFTokenizer:
        """The ``tokenizers.Tokenizer`` underneath (its added tokens, offsets and post-processing)."""
        return self._tok

    @property
    def vocab_size(self) -> int:
        """Size of the vocabulary including added tokens."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_token_id(self) -> int:
        """An id safe to pad with (the first eos id, or 0)."""
        return self.eos_token_ids[0] if self.eos_token_ids else 0

    def token_to_id(self, token: str) -> int | None:
        """The id of a token string, or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids.

        Args:
            text: The text.
            add_special_tokens: Apply the tokenizer's post-processor (e.g. Llama 3's BOS).
        """
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_prompt(self, text: str) -> list[int]:
        """Encodes a prompt: adds the tokenizer's special tokens unless the text already starts with BOS."""
        already = self.bos_token is not None and text.startswith(self.bos_token)
        return self.encode(text, add_special_tokens=not already)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Ids -> text."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        enable_thinking: bool | None = None,
        tokenize: bool = False,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders a conversation with the checkpoint's chat template.

        Args:
            messages: ``[{"role": "user", "content": "..."}, ...]``.
            add_generation_prompt: Append the assistant turn opener.
            enable_thinking: Qwen3's switch (passed to the template only when not None).
            tokenize: Return ids instead of text.
            **kwargs: Further template variables.

        Returns:
            The rendered text, or its ids when ``tokenize``.

        Raises:
            ValueError: The checkpoint has no chat template, or the template raised an error.
        """
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain prompts instead.")
        if not messages:
            raise ValueError("messages is empty; pass at least one {'role': ..., 'content': ...}.")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
            env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
                x, indent=indent, ensure_ascii=ensure_ascii
            )
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        variables = dict(kwargs, bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        if enable_thinking is not None:
            variables["enable_thinking"] = enable_thinking
        text = self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, **variables)
        return self.encode(text) if tokenize else text

    def chat_prompt(self, user: str, system: str | None = None, enable_thinking: bool | None = None) -> str:
        """Renders a single user turn (with an optional system message) ready for generation."""
        msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return self.apply_chat_template(msgs, enable_thinking=enable_thinking)  # type: ignore[return-value]


def _raise(message: str) -> None:
    raise TemplateError(message)


def _read_json(p: Path) -> dict[str, Any]:
    """The JSON object in ``p`` ({} if there is no such file); raises :class:`TokenizerFileError`."""
    if not p.is_file():
        return {}
    try:
        value = json.loads(p.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as err:  # JSONDecodeError, UnicodeDecodeError, nesting...
        raise TokenizerFileError(f"{p} is not valid UTF-8 JSON ({type(err).__name__}: {str(err)[:200]}); "
                                 f"{_RESTORE}.") from None
    if not isinstance(value, dict):
        raise TokenizerFileError(f"{p} must hold a JSON object, not a {type(value).__name__}; {_RESTORE}.")
    return value


def load_tokenizer(path_or_id: str | Path) -> Tokenizer:
    """Loads the tokenizer of a checkpoint directory or hub id (see :meth:`Tokenizer.from_pretrained`)."""
    return Tokenizer.from_pretrained(path_or_id)
