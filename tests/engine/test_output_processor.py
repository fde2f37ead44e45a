"""Tokens to deltas: a long stream costs O(1) per step per request; stop strings, n > 1, abort."""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.output_processor import OutputProcessor
from engine.plan import SampledToken
from engine.request import Request, RequestStatus
from tokenization.tokenizer import Tokenizer
from wire.protocol import GenerateDelta, encode_message

LONG = 2000
NEVER = "qzqzqzqzqz"  # a stop string the tiny model will not write: text is held back, never cut


def test_a_2000_token_stream_costs_o1_per_step(llama_dir, monkeypatch):
    llm = LLM(llama_dir, num_kv_blocks=136, block_size=16)  # 136 * 16 tokens: room for prompt + 2000
    steps: list[dict] = []
    original = OutputProcessor.process

    def measured(self, updates):  # what one step hands the output processor and keeps in it
        deltas, hits = original(self, updates)
        children = [child for _, child in self._child_to_parent.values()]
        steps.append({"updates": len(updates), "deltas": deltas,
                      "held": max((len(c.pending) for c in children), default=0),
                      "window": max((len(c.detok.ids) for c in children), default=0)})
        return deltas, hits

    monkeypatch.setattr(OutputProcessor, "process", measured)
    params = SamplingParams(max_tokens=LONG, ignore_eos=True, temperature=0.0, logprobs=2, stop=[NEVER])
    out = llm.generate("the cache serves many tenants", params)[0].outputs[0]
    assert len(out.token_ids) == LONG and out.finish_reason == "length"

    deltas = [d for s in steps for d in s["deltas"]]
    assert sum(len(s.token_ids) for d in deltas for s in d.samples) == LONG
    assert all(len(s.token_ids) <= 1 and len(s.logprobs) <= 1 for d in deltas for s in d.samples)
    assert all(len(lp.top) == 2 for d in deltas for s in d.samples for lp in s.logprobs)
    assert max(s["updates"] for s in steps) == 1 and max(len(s["deltas"]) for s in steps) == 1
    # Nothing a step emits or keeps grows with the position: compare the first and last quarter.
    # (A cumulative copy would make the last quarter's lines ~1000x the first's.)
    sizes = [len(encode_message(d)) for d in deltas]
    quarter = len(sizes) // 4
    assert sum(sizes[-quarter:]) <= 1.2 * sum(sizes[:quarter]) and max(sizes) < 400
    assert max(s["held"] for s in steps) < len(NEVER) + 16  # only text that could still become the stop
    assert max(s["window"] for s in steps) <= 16  # the detokenizer's context window, not the output
    assert "".join(s.text for d in deltas for s in d.samples) == out.text
    assert out.text == llm.tokenizer.decode(out.token_ids)


def _processor(llama_dir) -> tuple[OutputProcessor, Tokenizer]:
    tok = Tokenizer(llama_dir)
    return OutputProcessor(tok), tok


def _feed(proc: OutputProcessor, reqs: list[Request], tokens: list[list[int]]) -> list[GenerateDelta]:
    """One step per column of `tokens` (one row per request); the last token finishes with "length"."""
    out = []
    for step in range(max(len(t) for t in tokens)):
        updates = []
        for req, toks in zip(reqs, tokens, strict=True):
            if step < len(toks):
                req.output_token_ids.append(toks[step])
                if step == len(toks) - 1:
                    req.status = RequestStatus.FINISHED_LENGTH
                updates.append((req, SampledToken(toks[step])))
        deltas, _ = proc.process(updates)
        out += deltas
    return out


def test_stop_string_across_tokens_is_held_back_then_cut(llama_dir):
    proc, tok = _processor(llama_dir)
    ids = tok.encode("hello world STOP and more", add_special_tokens=False)
    params = SamplingParams(max_tokens=50, stop=["STOP"])
    req = Request("r", [1, 2], params, status=RequestStatus.RUNNING)
    proc.add("r", [1, 2], params, ["r"])
    deltas, hits = [], []
    for t in ids:
        req.output_token_ids.append(t)
        got, h = proc.process([(req, SampledToken(t))])
        deltas += got
        hits += h
        if h:
            break
    assert hits == [("r", "STOP")]
    assert "".join(s.text for d in deltas for s in d.samples) == "hello world "
    assert deltas[-1].finished and deltas[-1].samples[0].finish_reason == "stop"
    assert deltas[-1].samples[0].stop_reason == "STOP" and not proc.has("r")


@pytest.mark.parametrize("n", [1, 3])
def test_samples_stream_independently_and_the_request_finishes_with_the_last(llama_dir, n):
    proc, tok = _processor(llama_dir)
    params = SamplingParams(n=n, max_tokens=8)
    ids = [f"r#{i}" for i in range(n)] if n > 1 else ["r"]
    reqs = [Request(cid, [1, 2], params, status=RequestStatus.RUNNING) for cid in ids]
    proc.add("r", [1, 2], params, ids)
    rows = [tok.encode(" ab" * (i + 1), add_special_tokens=False) for i in range(n)]
    deltas = _feed(proc, reqs, rows)
    assert [d.finished for d in deltas] == [False] * (len(deltas) - 1) + [True]
    for i in range(n):
        mine = [s for d in deltas for s in d.samples if s.index == i]
        assert [t for s in mine for t in s.token_ids] == rows[i]
        assert "".join(s.text for s in mine) == " ab" * (i + 1) and mine[-1].finish_reason == "length"


def test_abort_emits_held_text_and_forgets_the_request(llama_dir):
    proc, tok = _processor(llama_dir)
    params = SamplingParams(max_tokens=50, stop=["never-seen"])
    req = Request("r", [1], params, status=RequestStatus.RUNNING)
    proc.add("r", [1], params, ["r"])
    for t in tok.encode("hi there", add_special_tokens=False):
        proc.process([(req, SampledToken(t))])
    final = proc.finish("r", RequestStatus.FINISHED_ABORTED)
    assert final is not None and final.finished and final.samples[0].finish_reason == "abort"
    assert final.samples[0].text and final.samples[0].token_ids == []
    assert proc.finish("r", RequestStatus.FINISHED_ABORTED) is None and not proc.drop("r")
