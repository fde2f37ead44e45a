"""The model's vocabulary as the grammar sees it: the true bytes each token id stands for.

Two vocabulary kinds are understood:

- byte-level BPE (GPT-2, Llama 3, Qwen): token strings are bytes written through GPT-2's
  byte→unicode table ("Ġ" is the space byte); every byte is a base token.
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral): "▁" is the space byte and
  `<0xNN>` tokens stand for the single byte NN. tokenizers marks those byte tokens as special added
  tokens; they are bytes here, never special.

Special tokens (BOS, EOS, headers, pad, unk, ...) have no bytes (None): a grammar never allows them
inside the structure, and EOS only where the grammar accepts.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from grammar.spec import GrammarError

VocabKind = Literal["byte_bpe", "sentencepiece"]

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
_SPACE_PIECE = "\u2581"


def gpt2_unicode_to_byte() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode table: printable stand-in character → byte value."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    table = {chr(b): b for b in printable}
    shift = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shift)] = b
            shift += 1
    return table


@dataclass(frozen=True)
class TokenizerInfo:
    """Per-token true bytes of a vocabulary, its special and EOS ids, and a fingerprint.

    token_bytes[i] is None for special tokens and for ids the tokenizer does not define.
    fingerprint identifies everything a compiled grammar depends on (bytes, specials, EOS ids).
    """

    kind: VocabKind
    token_bytes: tuple[bytes | None, ...]
    eos_token_ids: tuple[int, ...]
    special_token_ids: frozenset[int]
    fingerprint: str

    def __post_init__(self) -> None:
        if self.kind not in ("byte_bpe", "sentencepiece"):
            raise GrammarError(f"unknown vocabulary kind {self.kind!r}")
        if not self.eos_token_ids:
            raise GrammarError("TokenizerInfo needs at least one EOS token id")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise GrammarError(f"EOS id {eos} is outside the vocabulary (size {self.vocab_size})")
        if not set(self.eos_token_ids) <= self.special_token_ids:
            raise GrammarError("EOS ids must be special tokens (they carry no bytes)")

    @property
    def vocab_size(self) -> int:
        return len(self.token_bytes)

    @classmethod
    def from_file(cls, path: str | Path, eos_token_ids: Sequence[int] | None = None) -> TokenizerInfo:
        """Load tokenizer.json (or a model directory holding it).

        With no eos_token_ids, the ids of `eos_token` in tokenizer_config.json and of every
        `eos_token_id` in generation_config.json next to it are used.
        """
        from tokenizers import Tokenizer

        path = Path(path)
        directory = path if path.is_dir() else path.parent
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise GrammarError(f"no tokenizer.json at {file}")
        tokenizer = Tokenizer.from_file(str(file))
        if eos_token_ids is None:
            eos_token_ids = _eos_ids_from_configs(directory, tokenizer)
        return cls.from_tokenizer(tokenizer, eos_token_ids)

    @classmethod
    def from_tokenizer(cls, tokenizer, eos_token_ids: Sequence[int]) -> TokenizerInfo:
        """Build from a `tokenizers.Tokenizer` and the ids that end generation."""
        spec = json.loads(tokenizer.to_str())
        kind = _detect_kind(spec)
        vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        special = {int(i) for i, tok in tokenizer.get_added_tokens_decoder().items() if tok.special}
        added = {int(i): tok.content for i, tok in tokenizer.get_added_tokens_decoder().items()}
        unicode_to_byte = gpt2_unicode_to_byte()
        token_bytes: list[bytes | None] = []
        specials: set[int] = set()
        for token_id in range(vocab_size):
            piece = tokenizer.id_to_token(token_id)
            byte = _BYTE_FALLBACK.match(piece) if kind == "sentencepiece" and piece is not None else None
            if piece is None or (token_id in special and byte is None):
                token_bytes.append(None)
                specials.add(token_id)
            elif byte is not None:
                token_bytes.append(bytes([int(byte.group(1), 16)]))
            elif token_id in added:  # a non-special added token is its literal text
                token_bytes.append(added[token_id].encode())
            elif kind == "byte_bpe":
                token_bytes.append(_byte_level_bytes(piece, unicode_to_byte))
            else:
                token_bytes.append(piece.replace(_SPACE_PIECE, " ").encode())
        eos = tuple(dict.fromkeys(int(i) for i in eos_token_ids))
        for i in eos:
            if 0 <= i < vocab_size and token_bytes[i] is not None:
                raise GrammarError(f"EOS id {i} ({tokenizer.id_to_token(i)!r}) is not a special token")
        digest = hashlib.sha256(kind.encode())
        for i, b in enumerate(token_bytes):
            digest.update(b"\x00S%d" % i if b is None else b"\x01" + len(b).to_bytes(4, "little") + b)
        digest.update(repr(eos).encode())
        return cls(kind, tuple(token_bytes), eos, frozenset(specials), digest.hexdigest()[:32])


def _byte_level_bytes(piece: str, unicode_to_byte: dict[str, int]) -> bytes:
    try:
        return bytes(unicode_to_byte[ch] for ch in piece)
    except KeyError as e:
        raise GrammarError(f"byte-level token {piece!r} holds {e.args[0]!r}, not a byte stand-in") from None


def _detect_kind(spec: dict) -> VocabKind:
    model = spec.get("model") or {}
    if model.get("type") != "BPE":
        raise GrammarError(f"unsupported tokenizer model {model.get('type')!r}: only BPE vocabularies are mapped")
    if model.get("byte_fallback"):
        return "sentencepiece"
    if _mentions_byte_level(spec.get("pre_tokenizer")) or _mentions_byte_level(spec.get("decoder")):
        return "byte_bpe"
    raise GrammarError("unsupported BPE vocabulary: neither byte-level (ByteLevel) nor byte fallback (<0xNN>)")


def _mentions_byte_level(component: dict | None) -> bool:
    if not component:
        return False
    if component.get("type") == "ByteLevel":
        return True
    parts = component.get("pretokenizers") or component.get("decoders") or []
    return any(_mentions_byte_level(part) for part in parts)


def _eos_ids_from_configs(directory: Path, tokenizer) -> list[int]:
    ids: list[int] = []
    config = directory / "tokenizer_config.json"
    if config.is_file():
        eos = json.loads(config.read_text()).get("eos_token")
        eos = eos.get("content") if isinstance(eos, dict) else eos
        if isinstance(eos, str) and tokenizer.token_to_id(eos) is not None:
            ids.append(tokenizer.token_to_id(eos))
    generation = directory / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
        ids.extend(value if isinstance(value, list) else [] if value is None else [value])
    if not ids:
        raise GrammarError(f"no EOS token found in {directory}: pass eos_token_ids")
    return ids
