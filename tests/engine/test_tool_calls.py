"""Tool-call grammars in the engine: with adapters, in mixed batches with other constraints and none, n > 1,
and each format on one model (the format is the request's); the guard checks what it lets out."""

from __future__ import annotations

import json

import jsonschema
import pytest

from demo.checkpoint import make_checkpoint
from engine import LLM, SamplingParams
from grammar import GrammarSpec
from grammar.tool_calls import ToolCallGuard, ToolCallsSpec, ToolEntry
from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter
from tokenization.tool_formats import FORMATS
from tokenization.tool_parser import parse_tool_calls
from wire.sampling import ConstrainedTool, ToolCallConstraint

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
COUNT = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}}, "required": ["n"],
         "additionalProperties": False}
TOOLS = (ConstrainedTool(0, "get_weather", WEATHER), ConstrainedTool(1, "count", COUNT))
SCHEMAS = {"get_weather": WEATHER, "count": COUNT}


@pytest.fixture(scope="module")
def model_with_adapters(styled_tokenizer_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("tool-engine")
    model = make_checkpoint(root / "model", "llama", tokenizer_dir=styled_tokenizer_dirs[("sentencepiece", "mistral")])
    base = load_hf_base(model)
    adapters = {f"a{i}": make_peft_adapter(base, root / f"a{i}", seed=i + 1, r=8, lora_alpha=16,
                                           target_modules=ALL_PROJECTIONS).path for i in range(2)}
    return model, adapters


def _params(fmt: str, mode: str, parallel: bool, seed: int, n: int = 1, **extra) -> SamplingParams:
    return SamplingParams(max_tokens=300, temperature=1.0, seed=seed, n=n, skip_special_tokens=False,
                          tool_calls=ToolCallConstraint(fmt, TOOLS, mode, parallel), **extra)


def test_a_mixed_batch_with_adapters(model_with_adapters):
    model, adapters = model_with_adapters
    llm = LLM(str(model), num_kv_blocks=512, max_loras=2, max_lora_rank=8)
    for name, path in adapters.items():
        llm.load_adapter(name, path)
    prompt = {"prompt_token_ids": llm.tokenizer.encode_chat([{"role": "user", "content": "weather?"}])}
    rows = [  # (params, adapter): every format on the same model, other constraints and none in between
        (_params("mistral", "required", True, 0, n=3), "a0"),
        (_params("hermes", "required", False, 1), "a1"),
        (_params("llama3_json", "required", False, 2), None),
        (SamplingParams(max_tokens=20, temperature=1.0, seed=3, ignore_eos=True), "a0"),
        (_params("mistral", "required", False, 4, n=2), None),
        (SamplingParams(max_tokens=200, temperature=1.0, seed=5, json_schema=COUNT), "a1"),
        (_params("mistral", "auto", True, 6, logit_bias={llm.tokenizer.token_id("[TOOL_CALLS]"): 100}), "a1"),
    ]
    outs = llm.generate([prompt] * len(rows), [p for p, _ in rows], adapters=[a for _, a in rows])
    for (params, _), out in zip(rows, outs, strict=True):
        assert len(out.outputs) == params.n
        for sample in out.outputs:
            assert sample.finish_reason == ("stop" if params.has_grammar else "length"), sample
            if params.tool_calls is None:
                if params.json_schema is not None:
                    jsonschema.validate(json.loads(sample.text), COUNT)
                continue
            text = sample.text.removesuffix("</s>").removesuffix("<|eot_id|>")
            calls = parse_tool_calls(FORMATS[params.tool_calls.format], text).calls
            assert calls and (params.tool_calls.parallel or len(calls) == 1), text
            for call in calls:
                jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert llm.engine.structured.guard_stats.failed == 0 and llm.engine.structured.guard_stats.checked >= 9
    llm.engine.scheduler.check_integrity()
    llm.close()


def test_refused_tool_schemas_name_the_tool(model_with_adapters):
    model, _ = model_with_adapters
    llm = LLM(str(model), num_kv_blocks=64)
    bad = ToolCallConstraint("hermes", (ConstrainedTool(3, "f", {"type": "object", "properties": {
        "x": {"type": "integer", "minimum": 5, "maximum": 1}}}),), "required")
    with pytest.raises(ValueError, match=r"tools\[3\]\.function\.parameters") as info:
        llm.engine.add_request("r", {"prompt_token_ids": [5, 6]}, SamplingParams(tool_calls=bad))
    assert getattr(info.value, "param", None) == "tools[3].function.parameters"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        llm.engine.add_request("r2", {"prompt_token_ids": [5, 6]},
                               SamplingParams(tool_calls=ToolCallConstraint("nope", TOOLS, "required")))
    llm.close()


def test_the_guard_refuses_what_the_spec_does_not_allow():
    def guard(mode: str, parallel: bool, answer: dict | None = None) -> ToolCallGuard:
        spec = ToolCallsSpec("hermes", (ToolEntry(0, "get_weather", WEATHER), ToolEntry(1, "count", COUNT)), mode,
                             parallel, answer, {})
        return ToolCallGuard(GrammarSpec.tool_calls(spec.to_json()))

    def call(name: str, args: str) -> str:
        return FORMATS["hermes"].render_calls([(name, args)])

    ok = call("count", '{"n": 3}')
    assert guard("required", False).check(ok) is None
    assert "no tool call" in guard("required", False).check("just text")
    assert "2 calls" in guard("required", False).check(ok + "\n" + ok)
    assert guard("required", True).check(ok + "\n" + ok) is None
    assert "not allowed" in guard("required", True).check(call("rm", "{}"))
    assert "fail the schema" in guard("required", True).check(call("count", '{"n": 12}'))
    assert guard("auto", True).check("free text") is None
    assert "the answer" in guard("auto", True, COUNT).check('{"n": "x"}')
    assert guard("auto", True, COUNT).check('{"n": 1}') is None
