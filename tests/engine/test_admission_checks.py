"""What can be checked before a step is checked at add_request or adapter load; what slips through fails
only its own request (an adapter that cannot be written into a slot), never the batch."""

from __future__ import annotations

import json

import pytest
from safetensors.torch import load_file, save_file

from adapters.errors import AdapterError
from engine import LLM, SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from wire.errors import RequestError
from wire.sampling import MAX_SEED, InvalidSamplingParams

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def engine(llama_dir):
    eng = LLMEngine(EngineConfig(model=str(llama_dir), num_kv_blocks=64, block_size=4, dtype="float32"))
    yield eng
    eng.shutdown()


@pytest.mark.parametrize(("field", "params"), [
    ("logit_bias", SamplingParams(logit_bias={5: 1.0, 1024: 2.0})),
    ("stop_token_ids", SamplingParams(stop_token_ids=[3, 99999])),
])
def test_token_ids_outside_the_vocabulary_are_refused_by_name(engine, field, params):
    with pytest.raises(InvalidSamplingParams, match=f"{field} names token id") as err:
        engine.add_request("r", [5, 6, 7], params)
    assert err.value.param == field
    assert not engine.has_unfinished_requests()


def test_a_seed_the_generator_refuses_never_reaches_a_step(engine):
    params = SamplingParams(max_tokens=2)
    object.__setattr__(params, "seed", 2**64)  # past SamplingParams' own check: the engine checks again
    with pytest.raises(InvalidSamplingParams, match="seed") as err:
        engine.add_request("r", [5, 6, 7], params)
    assert err.value.param == "seed" and not engine.has_unfinished_requests()


def test_the_largest_seed_serves_n_samples(engine):
    engine.add_request("big", [5, 6, 7], SamplingParams(n=3, max_tokens=3, temperature=1.0, seed=MAX_SEED))
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert not isinstance(out, RequestError), out
    engine.scheduler.check_integrity()


@pytest.fixture(scope="module")
def adapters(llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("admission-adapters")
    base = load_hf_base(llama_dir)
    good = make_peft_adapter(base, root / "good", seed=4, r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    big = root / "bf16-inf"  # finite in float32 (the checkpoint's dtype), inf in bfloat16
    big.mkdir()
    (big / "adapter_config.json").write_text((good.path / "adapter_config.json").read_text())
    tensors = load_file(good.path / "adapter_model.safetensors")
    tensors[KEY][1, 2] = 3.39e38
    save_file(tensors, big / "adapter_model.safetensors")
    return good.path, big


def test_adapters_are_checked_in_the_dtype_the_engine_computes_in(llama_dir, adapters):
    good, big = adapters
    assert json.loads((llama_dir / "config.json").read_text()).get("torch_dtype", "float32") == "float32"
    fp32 = LLM(llama_dir, num_kv_blocks=16, max_loras=2, max_lora_rank=8, dtype="float32")
    fp32.load_adapter("big", big)  # fits float32
    fp32.close()
    bf16 = LLM(llama_dir, num_kv_blocks=16, max_loras=2, max_lora_rank=8, dtype="bfloat16")
    with pytest.raises(AdapterError, match="which is inf in bfloat16"):
        bf16.load_adapter("big", big)
    assert bf16.engine.lora.host.registered() == {}
    bf16.close()


def test_an_adapter_that_cannot_enter_a_slot_fails_only_its_request(llama_dir, adapters):
    good, _ = adapters
    llm = LLM(llama_dir, num_kv_blocks=64, block_size=4, max_loras=2, max_lora_rank=8, dtype="float32")
    base_params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone = llm.generate([[9, 8, 7, 6, 5]], base_params)[0].outputs[0].token_ids
    ref = llm.load_adapter("tenant-bot", good)
    # The host copy turns bad after validation (memory corruption, a bug): the slot write refuses it.
    llm.engine.lora.host.get(ref).weights[(0, "q_proj")].lora_b[0, 0] = float("inf")
    outs = llm.generate([[9, 8, 7, 6, 5], [1, 2, 3]], [base_params, SamplingParams(max_tokens=4)],
                        adapters=[None, "tenant-bot"])
    assert outs[0].error is None and outs[0].outputs[0].token_ids == alone
    assert outs[1].error == "the adapter cannot be loaded into this engine"
    assert outs[1].outputs[0].finish_reason == "error"
    assert llm.engine.lora.resident_adapters() == []
    llm.engine.scheduler.check_integrity()
    llm.close()


def test_a_schema_nested_too_deep_is_refused_at_submission(engine):
    schema: dict = {"type": "string"}
    for _ in range(900):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(InvalidSamplingParams, match="nests deeper than") as err:
        engine.add_request("deep", [5, 6, 7], SamplingParams(json_schema=schema))
    assert err.value.param == "response_format" and not engine.has_unfinished_requests()
    with pytest.raises(InvalidSamplingParams, match="nested too deeply"):
        engine.add_request("deep-text", [5, 6, 7], SamplingParams(json_schema="[" * 100_000 + "]" * 100_000))
    assert not engine.has_unfinished_requests()
