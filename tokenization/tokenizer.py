"""Tokenizer (tokenizer.json via `tokenizers`), chat prompts, incremental detokenization.

Chat prompts: the checkpoint's template (tokenization/chat_template.py) renders the messages, and only
the template's own markup becomes control tokens; the same strings typed by a user or a tool are
tokenized as text (tokenization/control_tokens.py). An operator can allow them
(`special_tokens_in_content=True`) for clients that are trusted to write markup.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from tokenization.chat_template import ChatTemplate, ChatTemplateError, find_chat_template
from tokenization.control_tokens import ControlTokens
from tokenization.tool_formats import ToolCalling, resolve_tool_calling
from wire.checkpoint import CheckpointError

__all__ = ["ChatTemplateError", "IncrementalDetokenizer", "Tokenizer"]

log = logging.getLogger(__name__)


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):  # {"content": "<s>", ...} in older tokenizer_config files
        return value.get("content")
    return value


GIL_FREE_CHARS = 16_384  # texts at least this long are encoded with the GIL released


def _encode_ids(tok: HFTokenizer, text: str) -> list[int]:
    """`text`'s token ids, no special tokens added. NOTE: `encode_batch` releases the GIL while the Rust
    side works (`encode` holds it throughout), so a long prompt tokenized in a thread leaves the event
    loop running; short texts take `encode`, which costs less."""
    if len(text) < GIL_FREE_CHARS:
        return tok.encode(text, add_special_tokens=False).ids
    return tok.encode_batch([text], add_special_tokens=False)[0].ids


class Tokenizer:
    """Encode, decode and render chat prompts the way the checkpoint's own files say.

    `chat_template`: a template file that replaces the checkpoint's (the operator's `--chat-template`).
    A checkpoint template that does not compile leaves the model without one (chat requests are
    refused with the compile error); an override that does not compile raises ChatTemplateError.
    """

    def __init__(self, model_dir: str | Path, extra_eos_ids: tuple[int, ...] = (), *,
                 chat_template: str | Path | None = None, special_tokens_in_content: bool = False) -> None:
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
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.add_bos = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        eos_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.eos_token_ids: tuple[int, ...] = tuple(sorted({*extra_eos_ids, *([] if eos_id is None else [eos_id])}))
        added = self._tok.get_added_tokens_decoder()
        self.special_token_ids = frozenset(tid for tid, tok in added.items() if tok.special)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.fingerprint = hashlib.sha256(tok_file.read_bytes()).hexdigest()[:16]
        self.special_tokens_in_content = special_tokens_in_content
        self.chat_template, self._template_error = self._load_template(path, chat_template)
        # Markup: every special added token, and the other added tokens the template writes itself
        # (Qwen's <tool_call> is not special, yet a user must not open a call with it).
        literal = self.chat_template.literal_text() if self.chat_template else ""
        self.control_tokens = ControlTokens(
            tok.content for tok in added.values()
            if tok.special or (tok.content in literal and not tok.content.isspace()))
        self._text_tok: HFTokenizer | None = None  # built on first use: control tokens read as text
        self._text_tok_lock = threading.Lock()

    def _load_template(self, path: Path, override: str | Path | None) -> tuple[ChatTemplate | None, str]:
        try:
            source = find_chat_template(path, override)
            if source is None:
                return None, "this model has no chat template; use the completions API"
            return ChatTemplate(source, self.bos_token, self.eos_token), ""
        except ChatTemplateError as e:
            if override is not None:
                raise
            log.warning("%s", e)
            return None, str(e)

    @property
    def backend(self) -> HFTokenizer:
        return self._tok

    def token_id(self, token: str) -> int | None:
        """The id of a token given by its vocabulary string (an added token's content), or None."""
        return self._tok.token_to_id(token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = _encode_ids(self._tok, text)
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def encode_text(self, text: str) -> list[int]:
        """`text` as plain text: the control tokens' strings in it are split into ordinary tokens."""
        return _encode_ids(self._plain_text_tokenizer(), text)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        ids = [i for i in ids if 0 <= i < self.vocab_size]  # padded model vocab rows decode to nothing
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    # ----- chat prompts -----------------------------------------------------------------------------

    def render_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text the template renders. Raises ChatTemplateError."""
        return self.control_tokens.restore(self._render_marked(messages, tools, add_generation_prompt, template_kwargs))

    def encode_chat(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
                    add_generation_prompt: bool = True, template_kwargs: Mapping[str, Any] | None = None) -> list[int]:
        """The prompt's token ids: the template's markup as control tokens, every string the request
        supplied as text (unless `special_tokens_in_content`). The rendered text holds BOS where the
        template writes it, so nothing is added. Raises ChatTemplateError."""
        text = self._render_marked(messages, tools, add_generation_prompt, template_kwargs)
        if not self.control_tokens.has_markers(text):
            return _encode_ids(self._tok, text)
        ids: list[int] = []
        for piece, is_control in self.control_tokens.split(text):
            if is_control:
                ids += _encode_ids(self._tok, piece)
            elif self.control_tokens.has_markers(piece):
                ids += self.encode_text(self.control_tokens.restore(piece))
            else:
                ids += _encode_ids(self._tok, piece)
        return ids

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """`render_chat` with transformers' spelling (`tools=` and template kwargs as keywords)."""
        tools = kwargs.pop("tools", None)
        return self.render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                template_kwargs=kwargs)

    def tool_calling(self, override: str | None = None) -> ToolCalling:
        """How this model does tool calls: `override` (a format name, the operator's --tool-call-parser), or
        the format its template's markup shows, or the default; logs a warning when the template shows no
        tools. Raises ValueError for an unknown format name."""
        template = self.chat_template
        if template is None:
            return resolve_tool_calling(None, False, override)
        return resolve_tool_calling(template.literal_text(), template.renders_tools(), override)

    def _render_marked(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None,
                       add_generation_prompt: bool, template_kwargs: Mapping[str, Any] | None) -> str:
        if self.chat_template is None:
            raise ChatTemplateError(self._template_error)
        if not self.special_tokens_in_content:
            messages, tools = self.control_tokens.mark(messages), self.control_tokens.mark(tools)
            template_kwargs = self.control_tokens.mark(dict(template_kwargs or {}))
        return self.chat_template.render(messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                         kwargs=template_kwargs)

    def _plain_text_tokenizer(self) -> HFTokenizer:
        """The same tokenizer without the control tokens among its added tokens (built once)."""
        with self._text_tok_lock:
            if self._text_tok is None:
                data = json.loads(self._tok.to_str())
                data["added_tokens"] = [t for t in data.get("added_tokens", []) if t["content"] not in self.control_tokens]
                self._text_tok = HFTokenizer.from_str(json.dumps(data))
            return self._text_tok


class IncrementalDetokenizer:
    """Streams text for a growing list of token ids, never emitting half a UTF-8 character.

    Keeps a small window [prefix_offset, read_offset) of already-emitted tokens as context so that
    tokenizers which strip a leading space (SentencePiece "▁") or merge bytes across tokens (byte-level
    BPE, <0xNN> byte fallback) decode each new piece exactly as a full decode would. Only that window
    and the tokens not yet decodable are kept: each `add` costs the same at any position in the output.
    """

    CONTEXT_TOKENS = 5

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        tail = prompt_token_ids[-self.CONTEXT_TOKENS :]
        self.ids: list[int] = list(tail)
        self.prefix_offset = 0
        self.read_offset = len(tail)

    def add(self, token_ids: list[int]) -> str:
        """Append tokens; returns the newly decodable text (possibly empty)."""
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special)
        if len(new_text) <= len(prefix_text) or new_text.endswith("\ufffd"):
            return ""
        delta = new_text[len(prefix_text) :]
        del self.ids[: self.read_offset]  # NOTE: what is before the new window is never read again
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return delta

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held back (bytes that never completed a
        character decode to U+FFFD, as a full decode would show them)."""
        decode = self.tokenizer.decode
        prefix_text = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        new_text = decode(self.ids[self.prefix_offset :], self.skip_special)
        delta = new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""
        del self.ids[: self.read_offset]
        self.prefix_offset, self.read_offset = 0, len(self.ids)
        return delta
