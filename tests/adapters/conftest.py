"""Fixtures for the adapter tests: real PEFT adapters saved by peft itself on the tiny test checkpoints."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch


@pytest.fixture(scope="session")
def hf_base_models(make_model: Callable[..., Path]) -> Callable[[str], tuple[Path, torch.nn.Module]]:
    """hf_base_models(family) -> (checkpoint dir, transformers model), loaded once per family."""
    from transformers import AutoModelForCausalLM

    loaded: dict[str, tuple[Path, torch.nn.Module]] = {}

    def get(family: str) -> tuple[Path, torch.nn.Module]:
        if family not in loaded:
            model_dir = make_model(family)
            loaded[family] = (model_dir, AutoModelForCausalLM.from_pretrained(model_dir).eval())
        return loaded[family]

    return get


@pytest.fixture()
def make_peft_adapter(
    tmp_path: Path, hf_base_models: Callable[[str], tuple[Path, torch.nn.Module]]
) -> Callable[..., tuple[Path, torch.nn.Module]]:
    """make_peft_adapter(family="llama", seed=0, **LoraConfig kwargs) -> (adapter dir, peft model).

    The LoRA factors are filled with seeded random values (PEFT initialises lora_B to zeros, which would
    make every comparison of B trivially true), then saved with save_pretrained(safe_serialization=True).
    """
    from peft import LoraConfig, get_peft_model

    counter = iter(range(1_000_000))

    def make(family: str = "llama", seed: int = 0, **lora_kwargs) -> tuple[Path, torch.nn.Module]:
        _, base = hf_base_models(family)
        peft_model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs))
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in peft_model.named_parameters():
                if "lora_" in name:
                    param.copy_(torch.randn(param.shape, generator=generator) * 0.1)
        out = tmp_path / f"adapter-{next(counter)}"
        peft_model.save_pretrained(out, safe_serialization=True)
        return out, peft_model.eval()

    return make
