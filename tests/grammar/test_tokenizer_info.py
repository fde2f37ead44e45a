"""True bytes per token for byte-level BPE and SentencePiece byte-fallback vocabularies."""

from __future__ import annotations

import pytest

from demo.checkpoint import synthetic_corpus
from grammar import GrammarError, TokenizerInfo
from grammar.tokenizer_info import gpt2_unicode_to_byte


@pytest.mark.parametrize("kind", ["byte_bpe", "sentencepiece"])
def test_token_bytes_reassemble_the_encoded_text(kind, tokenizer_infos, tokenizers):
    info, tokenizer = tokenizer_infos[kind], tokenizers[kind]
    assert info.kind == kind and info.vocab_size == tokenizer.get_vocab_size()
    texts = [*synthetic_corpus(50, seed=3), "tab\tnew\nline ü 日本 🚀 {\"k\": [1, 2]}", "  two  spaces"]
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        joined = b"".join(info.token_bytes[i] for i in ids)
        # SentencePiece's normalizer prepends "▁" (a space) to the text
        assert joined == (b" " if kind == "sentencepiece" else b"") + text.encode()


def test_special_tokens_have_no_bytes_and_byte_fallback_tokens_are_bytes(tokenizer_infos, tokenizers):
    sp, bpe = tokenizer_infos["sentencepiece"], tokenizer_infos["byte_bpe"]
    tok = tokenizers["sentencepiece"]
    assert sp.eos_token_ids == (tok.token_to_id("<|eot_id|>"),)
    assert {tok.id_to_token(i) for i in sp.special_token_ids} == {
        "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>", "<|start_header_id|>",
        "<|end_header_id|>", "<|pad|>"}
    assert sp.token_bytes[tok.token_to_id("<0x7B>")] == b"{"
    assert sp.token_bytes[tok.token_to_id("<0xFF>")] == b"\xff"
    assert all(sp.token_bytes[i] is None for i in sp.special_token_ids)
    assert sorted({b for b in bpe.token_bytes if b is not None and len(b) == 1}) == [bytes([i]) for i in range(256)]
    assert len(gpt2_unicode_to_byte()) == 256


def test_fingerprint_is_stable_and_sensitive(tokenizer_dirs, tokenizer_infos):
    again = TokenizerInfo.from_file(tokenizer_dirs["byte_bpe"] / "tokenizer.json")
    assert again.fingerprint == tokenizer_infos["byte_bpe"].fingerprint
    other_eos = TokenizerInfo.from_file(tokenizer_dirs["byte_bpe"], eos_token_ids=[1, 2])
    assert other_eos.fingerprint != again.fingerprint
    assert other_eos.fingerprint != tokenizer_infos["sentencepiece"].fingerprint


def test_bad_inputs(tokenizer_dirs, tmp_path):
    with pytest.raises(GrammarError, match="no tokenizer.json"):
        TokenizerInfo.from_file(tmp_path)
    with pytest.raises(GrammarError, match="is not a special token"):
        TokenizerInfo.from_file(tokenizer_dirs["byte_bpe"], eos_token_ids=[300])
    with pytest.raises(GrammarError, match="outside the vocabulary"):
        TokenizerInfo.from_file(tokenizer_dirs["byte_bpe"], eos_token_ids=[10**6])
