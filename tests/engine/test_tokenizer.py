"""Tokenizer, chat template sandbox, incremental detokenization, stop strings."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tokenization.tokenizer import IncrementalDetokenizer, Tokenizer

TEXTS = [
    "hello world 日本語 and 中文字 😀🚀 naïve café 🦀 漢字",  # 🦀 and 漢 are not in the training corpus
    "👩‍💻 writes 한국어 → Ωmega € ß 🙂 done Жψğ",
    "plain ascii only, with numbers 42 and 3.14",
]


@pytest.mark.parametrize("kind", ["byte_bpe", "sentencepiece"])
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_detokenization_equals_full_decode(tokenizer_dirs, kind, text):
    tok = Tokenizer(tokenizer_dirs[kind])
    prompt = tok.encode("the model says:")
    ids = tok.encode(text, add_special_tokens=False)
    if kind == "sentencepiece" and not text.isascii():  # unseen characters go through <0xNN> byte fallback
        pieces = [tok.backend.id_to_token(i) for i in ids]
        assert any(p.startswith("<0x") for p in pieces)
    detok = IncrementalDetokenizer(tok, prompt)
    streamed = "".join(detok.add([i]) for i in ids)
    full = tok.decode(prompt + ids)[len(tok.decode(prompt)):]
    assert streamed == full
    assert "\ufffd" not in streamed


def test_special_tokens_are_skipped_in_text(tokenizer_dirs):
    tok = Tokenizer(tokenizer_dirs["byte_bpe"])
    eot = tok.eos_token_ids[0]
    detok = IncrementalDetokenizer(tok, [])
    text = "".join(detok.add([i]) for i in [*tok.encode("hi there", add_special_tokens=False), eot])
    assert text == "hi there"


def test_chat_template_renders(tokenizer_dirs):
    """The template's sandbox and failures: tests/tokenization/test_chat_template.py."""
    tok = Tokenizer(tokenizer_dirs["byte_bpe"])
    rendered = tok.apply_chat_template([{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "hi"}])
    assert rendered.startswith("<|begin_of_text|><|start_header_id|>system")
    assert rendered.endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


@pytest.mark.parametrize("kind", ["byte_bpe", "sentencepiece"])
def test_stop_string_split_across_tokens(make_model, kind):
    llm = LLM(make_model("llama", kind), num_kv_blocks=64)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    full = llm.generate("the model", params)[0].outputs[0]
    detok = IncrementalDetokenizer(llm.tokenizer, llm.tokenizer.encode("the model"))
    pieces = [detok.add([t]) for t in full.token_ids]
    # a stop string made of the end of one token's text and the start of the next one's
    i = next(i for i in range(5, len(pieces) - 1)
             if pieces[i].strip() and pieces[i + 1].strip() and "\ufffd" not in pieces[i] + pieces[i + 1])
    stop = pieces[i][-1] + pieces[i + 1][0]
    expected = full.text[: full.text.find(stop)]
    out = llm.generate("the model", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                                                   stop=[stop]))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == expected
    assert stop not in out.text
    kept = llm.generate("the model", SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                                                    include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == expected + stop


def test_a_sequence_ending_mid_character_is_flushed_at_finish(tokenizer_dirs):
    tok = Tokenizer(tokenizer_dirs["byte_bpe"])
    ids = tok.encode("ok 🦀", add_special_tokens=False)
    detok = IncrementalDetokenizer(tok, [])
    streamed = "".join(detok.add([i]) for i in ids[:-1])  # the crab's last byte never comes
    assert "\ufffd" not in streamed and "\ufffd" in tok.decode(ids[:-1])
    assert streamed + detok.flush() == tok.decode(ids[:-1])
