"""Tokenizer (tokenizer.json via `tokenizers`), sandboxed chat templates, incremental detokenization."""

from __future__ import annotations

import hashlib
import json
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from wire.checkpoint import CheckpointError


class ChatTemplateError(ValueError):
    pass


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


class Tokenizer:
    """Encode, decode and render chat prompts the way the checkpoint's own files say."""

    def __init__(self, model_dir: str | Path, extra_eos_ids: tuple[int, ...] = ()) -> None:
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise CheckpointError(f"{path}: tokenizer.json is missing")
        try:
            self._tok = HFTokenizer.from_file(str(tok_file))
        except Exception as e:  # the Rust library raises a bare Exception on malformed files
            raise CheckpointError(f"{tok_file}: cannot be loaded ({e})") from None
        cfg_file = path / "tokenizer_config.json"
        cfg = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template: str | None = cfg.get("chat_template")
        if isinstance(self.chat_template, list):  # named templates: take "default"
            named = {t["name"]: t["template"] for t in self.chat_template}
            self.chat_template = named.get("default") or next(iter(named.values()))
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = tuple(sorted({*extra_eos_ids, *([] if eos_id is None else [eos_id])}))
        self.special_token_ids = frozenset(
            tid for tid, tok in self._tok.get_added_tokens_decoder().items() if tok.special
        )
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(tok_file.read_bytes()).hexdigest()[:16]
        self._env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        self._env.globals["raise_exception"] = _raise
        self._env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self._template: Template | None = None

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]  # padded model vocab rows decode to nothing
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages with the checkpoint's template in a sandboxed Jinja environment."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use the completions API")
        try:
            if self._template is None:
                self._template = self._env.from_string(self.chat_template)
            return self._template.render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs,
            )
        except TemplateError as e:
            raise ChatTemplateError(f"chat template failed: {e}") from None


def _raise(message: str) -> None:
    raise TemplateError(message)


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids, never emitting half a UTF-8 character.

    Keeps a small window [prefix_offset, read_offset) of already-emitted tokens as context so that
    tokenizers which strip a leading space (SentencePiece "▁") or merge bytes across tokens (byte-level
    BPE, <0xNN> byte fallback) decode each new piece exactly as a full decode would.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        tail = prompt_token_ids[-self.CONTEXT_TOKENS :]
        self.ids: list[int] = list(tail)
        self.prefix_offset = 0
        self.read_offset = len(tail)
        self.text = ""

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly decodable text (possibly empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self.text += delta
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (bytes that never completed a
        character decode to U+FFFD, as a full decode would show them)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        self.prefix_offset = self.read_offset = len(self.ids)
        self.text += delta
        return delta
