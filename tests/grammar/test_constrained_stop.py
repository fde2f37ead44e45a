"""A stop string the caller set ends a constrained output where it appears, as in vLLM and OpenAI: the
text is cut there, finish_reason is "stop" and stop_reason names the string (so a caller can tell it
from an output the grammar completed, whose stop_reason is None). It is the caller's cut, not a grammar
bug: the guard neither checks nor counts it. See docs/grammar.md."""

from __future__ import annotations

import json

import jsonschema
import pytest

from engine import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {"note": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["note", "n"], "additionalProperties": False}


@pytest.fixture(scope="module")
def llm(make_model):
    return LLM(make_model("llama", "byte_bpe"), num_kv_blocks=256, block_size=16, max_num_seqs=16,
               max_num_batched_tokens=1024)


def _run(llm, **extra):
    params = [SamplingParams(max_tokens=80, temperature=1.0, seed=s, json_schema=SCHEMA, **extra) for s in range(6)]
    return [out.outputs[0] for out in llm.generate(["x"] * len(params), params)]


def test_a_stop_string_cuts_a_constrained_output_and_says_so(llm):
    stats = llm.engine.structured.guard_stats
    checked, failed = stats.checked, stats.failed
    cut = _run(llm, stop=[":"])
    for o in cut:  # compact JSON: the first ":" follows the first key (the grammar picks which key)
        assert o.text in ('{"n"', '{"note"') and (o.finish_reason, o.stop_reason) == ("stop", ":"), o
    for o, short in zip(_run(llm, stop=[":"], include_stop_str_in_output=True), cut, strict=True):
        assert (o.text, o.finish_reason, o.stop_reason) == (short.text + ":", "stop", ":")
    assert (stats.checked, stats.failed) == (checked, failed)  # the caller's cut: not checked, not a failure


def test_without_a_stop_string_hit_the_output_is_complete_and_valid(llm):
    stats = llm.engine.structured.guard_stats
    checked = stats.checked
    outs = _run(llm, stop=["never appears \u2603"])
    stopped = [o for o in outs if o.finish_reason == "stop"]
    assert stopped
    for o in stopped:
        assert o.stop_reason is None  # the grammar completed it
        jsonschema.validate(json.loads(o.text), SCHEMA)
    assert stats.checked - checked == len(stopped)
