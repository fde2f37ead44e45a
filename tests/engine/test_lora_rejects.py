"""Every adapter the engine cannot serve is refused with its own message, and leaves nothing loaded."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.errors import AdapterError
from engine import LLM, SamplingParams
from tests.engine.lora_peft import ALL_PROJECTIONS, load_hf_base, make_peft_adapter

pytest.importorskip("peft")

WEIGHTS = "adapter_model.safetensors"
CONFIG = "adapter_config.json"


@pytest.fixture(scope="module")
def setup(make_model, tmp_path_factory):
    model_dir = make_model("llama")
    base = load_hf_base(model_dir)
    root = tmp_path_factory.mktemp("lora-rejects")
    good = make_peft_adapter(base, root / "good", seed=1, r=8, lora_alpha=16, target_modules=ALL_PROJECTIONS)

    def peft_dir(name, **kw):
        return make_peft_adapter(base, root / name, seed=2, **kw).path

    def edited(name, edit_tensors=None, edit_config=None):
        out = root / name
        shutil.copytree(good.path, out)
        if edit_tensors:
            tensors = load_file(out / WEIGHTS)
            edit_tensors(tensors)
            save_file(tensors, out / WEIGHTS)
        if edit_config:
            cfg = json.loads((out / CONFIG).read_text())
            edit_config(cfg)
            (out / CONFIG).write_text(json.dumps(cfg))
        return out

    first_a = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"

    def nan(t):
        t[first_a][0, 0] = float("nan")

    def wrong_shape(t):
        t[first_a] = torch.zeros(8, 48)

    def pickle_only(d):
        (d / WEIGHTS).rename(d / "adapter_model.bin")
        return d

    rejected = {
        "rank": (peft_dir("rank", r=32, lora_alpha=32, target_modules=["q_proj"]), "max_lora_rank 16"),
        "dora": (peft_dir("dora", r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj"]), "DoRA"),
        "modules_to_save": (peft_dir("mts", r=4, lora_alpha=8, target_modules=["q_proj"],
                                     modules_to_save=["lm_head"]), "modules_to_save"),
        "embedding": (peft_dir("emb", r=4, lora_alpha=8, target_modules=["embed_tokens", "q_proj"]),
                      "embed"),
        "nan": (edited("nan", edit_tensors=nan), "NaN or Inf"),
        "shape": (edited("shape", edit_tensors=wrong_shape), "shape (8, 48)"),
        "layer": (edited("layer", edit_config=lambda c: c.update(layers_to_transform=[7])), "layer"),
        "pickle": (pickle_only(edited("pickle")), "pickle"),
        "no-config": (edited("no-config", edit_config=None), "adapter_config.json is missing"),
        "not-a-dir": (root / "missing", "not a directory"),
    }
    (rejected["no-config"][0] / CONFIG).unlink()
    return model_dir, good, rejected


def test_each_rejected_kind_has_its_own_message_and_loads_nothing(setup):
    model_dir, good, rejected = setup
    llm = LLM(model_dir, num_kv_blocks=16, max_loras=2, max_lora_rank=16)
    engine = llm.engine
    messages = {}
    for kind, (path, expected) in rejected.items():
        before = engine.stats()
        with pytest.raises(AdapterError) as err:
            llm.load_adapter(kind, path)
        assert expected in str(err.value), (kind, str(err.value))
        messages[kind] = str(err.value)
        assert engine.lora.host.registered() == {} and engine.lora.host.num_resident() == 0
        assert engine.stats() == before
        with pytest.raises(ValueError, match=f"adapter '{kind}' is not loaded"):
            engine.add_request(f"req-{kind}", [5, 6, 7], SamplingParams(max_tokens=2), adapter=kind)
    assert len(set(messages.values())) == len(messages)
    assert not engine.has_unfinished_requests()


def test_failed_replacement_keeps_the_loaded_version(setup):
    model_dir, good, rejected = setup
    llm = LLM(model_dir, num_kv_blocks=16, max_loras=2, max_lora_rank=16)
    ref = llm.load_adapter("tenant-bot", good.path)
    with pytest.raises(AdapterError, match="NaN"):
        llm.load_adapter("tenant-bot", rejected["nan"][0])
    with pytest.raises(AdapterError, match="content digest"):
        llm.load_adapter("other", good.path, sha256="0" * 64)
    assert llm.engine.lora.host.registered() == {"tenant-bot": ref}
    assert llm.load_adapter("same", good.path, sha256=ref.sha256).sha256 == ref.sha256
    out = llm.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=3, temperature=0.0), adapters=["tenant-bot"])
    assert out[0].outputs[0].finish_reason in ("stop", "length")
    with pytest.raises(ValueError, match="'ghost' is not loaded"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=["ghost"])
    with pytest.raises(ValueError, match="one adapter"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), adapters=["tenant-bot", None])
    assert not llm.engine.has_unfinished_requests()
    llm.engine.scheduler.check_integrity()
