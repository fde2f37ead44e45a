"""Adapter weights and scalings must be finite in the compute dtype, not only as float64 (torch-free check)."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from adapters.errors import AdapterError
from adapters.peft_format import validate_peft_adapter
from engine.config import ModelConfig
from tests.adapters.test_peft_format import edit_config, edit_weights

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"


@pytest.fixture(scope="module")
def saved_adapter(hf_base_models, tmp_path_factory):
    """One adapter saved by peft (made once: peft is the slow part); each test edits its own copy."""
    from peft import LoraConfig, get_peft_model

    _, base = hf_base_models("llama")
    model = get_peft_model(copy.deepcopy(base), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
    out = tmp_path_factory.mktemp("dtype-limits") / "adapter"
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture()
def adapter(saved_adapter, tmp_path):
    return Path(shutil.copytree(saved_adapter, tmp_path / "adapter"))


def config_as(llama_dir, dtype: str) -> ModelConfig:
    return replace(ModelConfig.from_pretrained(llama_dir), torch_dtype=dtype)


@pytest.mark.parametrize("alpha", [1e300, 2e39, 10**400])
def test_a_scaling_beyond_float32_is_refused(adapter, llama_dir, alpha) -> None:
    """lora_alpha 1e300 is a finite float64, but alpha / r overflows the float32 scaling buffer."""
    if isinstance(alpha, int):  # a JSON integer with 401 digits: too large for any float
        path = adapter / "adapter_config.json"
        path.write_text(json.dumps(json.loads(path.read_text())).replace('"lora_alpha": 8', f'"lora_alpha": {alpha}'))
        match = "lora_alpha must be a finite number"
    else:
        edit_config(adapter, lora_alpha=alpha)
        match = r"the scaling of model.layers.0.self_attn.q_proj \(lora_alpha / r\) is .* beyond the range of float32"
    with pytest.raises(AdapterError, match=match):
        validate_peft_adapter(adapter, ModelConfig.from_pretrained(llama_dir), name="a")


def test_rank_stabilized_and_pattern_scalings_are_checked_too(adapter, llama_dir) -> None:
    edit_config(adapter, lora_alpha=8, use_rslora=True, alpha_pattern={"v_proj": 1e38})
    validate_peft_adapter(adapter, ModelConfig.from_pretrained(llama_dir), name="a")  # 1e38 / 2: fits float32
    with pytest.raises(AdapterError, match=r"v_proj \(lora_alpha / sqrt\(r\)\) is 5e\+37, beyond the range of float16"):
        validate_peft_adapter(adapter, config_as(llama_dir, "float16"), name="a")
    edit_config(adapter, alpha_pattern={"v_proj": 1e300})
    with pytest.raises(AdapterError, match="beyond the range of float32"):
        validate_peft_adapter(adapter, ModelConfig.from_pretrained(llama_dir), name="a")


@pytest.mark.parametrize(("value", "stored", "dtype", "refused"), [
    (70000.0, torch.float32, "float16", True),  # 70000 is inf in float16
    (70000.0, torch.float32, "float32", False),
    (70000.0, torch.float32, "bfloat16", False),
    (65504.0, torch.float32, "float16", False),  # float16's largest finite value
    (3.39e38, torch.float32, "bfloat16", True),  # finite in float32, inf in bfloat16
    (3.39e38, torch.float32, "float32", False),
    (1e39, torch.float64, "float32", True),  # finite in float64, inf in float32
])
def test_weights_must_be_finite_in_the_compute_dtype(adapter, llama_dir, value, stored, dtype, refused) -> None:
    def poison(tensors):
        tensors[KEY] = tensors[KEY].to(stored)
        tensors[KEY][3, 1] = value

    edit_weights(adapter, poison)
    config = config_as(llama_dir, dtype)
    if not refused:
        validate_peft_adapter(adapter, config, name="a")
        return
    message = "contains NaN or Inf" if value > 3.5e38 else f"which is inf in {dtype}"
    with pytest.raises(AdapterError, match=rf"^tensor {KEY} .*{message}"):
        validate_peft_adapter(adapter, config, name="a")
