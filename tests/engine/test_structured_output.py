"""Structured output through the engine: every finished output validates; others are unaffected."""

from __future__ import annotations

import json
import re
from pathlib import Path

import jsonschema
import pytest

from engine import LLM, SamplingParams

SCHEMAS: dict[str, dict] = json.loads((Path(__file__).parents[1] / "grammar" / "schemas.json").read_text())
FORMATS = jsonschema.FormatChecker()


@pytest.fixture(scope="module", params=["byte_bpe", "sentencepiece"])
def llm(request, make_model):
    return LLM(make_model("llama", request.param), num_kv_blocks=2048, block_size=16, max_num_seqs=128,
               max_num_batched_tokens=4096)


def test_every_stopped_output_validates_against_its_schema(llm):
    names = sorted(SCHEMAS)
    prompts, params = [], []
    for name in names:
        for seed in range(10):
            prompts.append(f"give me {name} as JSON")
            params.append(SamplingParams(max_tokens=160, temperature=1.0, seed=seed, json_schema=SCHEMAS[name]))
    outs = llm.generate(prompts, params)
    stopped = {name: 0 for name in names}
    for out, name in zip(outs, [n for n in names for _ in range(10)], strict=True):
        o = out.outputs[0]
        assert o.finish_reason in ("stop", "length")
        if o.finish_reason == "stop":
            stopped[name] += 1
            jsonschema.validate(json.loads(o.text), SCHEMAS[name], format_checker=FORMATS)
    # the check is not vacuous: most schemas finish within the budget for most seeds
    assert sum(stopped.values()) >= 0.6 * len(outs), stopped


def test_regex_choice_and_json_object_are_honoured(llm):
    pattern = r"[a-z]{2,6}-[0-9]{3}"  # NOTE: \d is Unicode-aware in the Rust regex engine
    params = ([SamplingParams(max_tokens=30, temperature=1.0, seed=s, regex=pattern) for s in range(8)]
              + [SamplingParams(max_tokens=30, temperature=1.0, seed=s, choice=["red", "green", "blue"])
                 for s in range(8)]
              + [SamplingParams(max_tokens=400, temperature=1.0, seed=s, json_object=True) for s in range(8)])
    outs = llm.generate(["x"] * len(params), params)
    for out, p in zip(outs, params, strict=True):
        o = out.outputs[0]
        if p.regex:
            assert o.finish_reason == "stop" and re.fullmatch(pattern, o.text), o.text
        elif p.choice:
            assert o.finish_reason == "stop" and o.text in p.choice
        elif o.finish_reason == "stop":
            assert isinstance(json.loads(o.text), dict)
    assert sum(o.outputs[0].finish_reason == "stop" for o in outs[16:]) >= 4


def test_unconstrained_rows_are_unaffected_by_constrained_neighbours(llm):
    plain = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["hello world", "the model"], plain)
    constrained = [SamplingParams(max_tokens=40, temperature=1.0, seed=i, json_schema=SCHEMAS["nested_object"])
                   for i in range(4)]
    mixed = llm.generate(["hello world", "a", "the model", "b", "c", "d"],
                         [plain, constrained[0], plain, *constrained[1:]])
    assert mixed[0].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert mixed[2].outputs[0].token_ids == alone[1].outputs[0].token_ids


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(json_schema={"type": "object", "properties": {"a": {"type": "strng"}}}), "strng"),
        (SamplingParams(json_schema={"type": "object", "patternPropertiez": {}}), "patternPropertiez"),
        (SamplingParams(json_schema={"$ref": "#/$defs/missing"}), "missing"),
        (SamplingParams(json_schema="{not json"), "json"),
        (SamplingParams(regex="(unclosed"), "regex"),
    ],
)
def test_unsupported_or_invalid_specs_fail_at_submission(llm, params, message):
    with pytest.raises(ValueError, match=re.compile(re.escape(message), re.IGNORECASE)):
        llm.generate("x", params)
    assert not llm.engine.has_unfinished_requests()
    out = llm.generate("x", SamplingParams(max_tokens=3, choice=["ok"]))[0].outputs[0]
    assert out.text == "ok"


# ----- the output guard -----------------------------------------------------------------------------

STRICT = {"type": "object", "properties": {"must": {"type": "integer"}}, "required": ["must"],
          "additionalProperties": False}


@pytest.fixture
def loose_grammar(monkeypatch):
    """Plant a grammar bug: every json_schema compiles to "any JSON object" while its guard keeps the
    requested schema."""
    import grammar.compiler
    from grammar import NormalizedSchema, NormalizeReport

    monkeypatch.setattr(grammar.compiler, "normalize_schema",
                        lambda schema, *args, **kwargs: NormalizedSchema({"type": "object"}, NormalizeReport()))


def _run_loose(llm, seeds=range(12)):
    params = [SamplingParams(max_tokens=60, temperature=1.0, seed=s, json_schema={**STRICT, "title": f"t{s}"})
              for s in seeds]
    return llm.generate(["x"] * len(params), params)


def test_guard_counts_and_names_a_planted_grammar_bug(llm, loose_grammar):
    from engine.structured_output import GUARD_ERROR

    manager = llm.engine.structured
    before = manager.guard_stats.failed
    engine = llm.engine
    updates_seen: list = []
    original = engine.scheduler.update

    def spy(plan, output):
        updates = original(plan, output)
        updates_seen.extend(u for u in updates if u[0].status.finished)
        return updates

    engine.scheduler.update = spy
    try:
        _run_loose(llm)
    finally:
        engine.scheduler.update = original
    stopped = [u for u in updates_seen if u[0].status.finish_reason == "stop"]
    failures = manager.guard(stopped)
    assert failures and all(reason == GUARD_ERROR for _, reason in failures)
    assert manager.guard_stats.failed - before >= len(failures)


def test_planted_grammar_bug_finishes_with_an_error_never_stop(llm, loose_grammar):
    manager = llm.engine.structured
    before = manager.guard_stats.failed
    outs = _run_loose(llm)
    errors = 0
    for out in outs:
        o = out.outputs[0]
        if o.finish_reason == "stop":
            jsonschema.validate(json.loads(o.text), STRICT)  # a "stop" output is always valid
        elif o.finish_reason == "error":
            errors += 1
            assert out.error and "schema" in out.error
    assert errors >= 1
    assert manager.guard_stats.failed - before == errors


def test_guard_passes_valid_outputs(llm):
    manager = llm.engine.structured
    checked, failed = manager.guard_stats.checked, manager.guard_stats.failed
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["n"], "additionalProperties": False}
    engine = llm.engine
    seen: list = []
    original = engine.scheduler.update
    engine.scheduler.update = lambda plan, output: [u for u in original(plan, output) if not seen.append(u)]
    try:
        llm.generate(["x"] * 4, [SamplingParams(max_tokens=20, temperature=1.0, seed=s, json_schema=schema)
                                 for s in range(4)])
    finally:
        engine.scheduler.update = original
    assert manager.guard([u for u in seen if u[0].status.finish_reason == "stop"]) == []
    assert manager.guard_stats.checked > checked and manager.guard_stats.failed == failed
