"""Reference adapters for the multi-LoRA engine tests: made, saved and run by peft itself."""

from __future__ import annotations

import copy
import random
from dataclasses import dataclass
from pathlib import Path

import torch

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class PeftReference:
    """A saved PEFT adapter directory and the peft model that runs it alone."""

    path: Path
    model: torch.nn.Module

    @torch.no_grad()
    def greedy(self, prompt: list[int], max_new_tokens: int, eos_ids) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy tokens and the log-softmax of every step's logits (V,) float32."""
        out = self.model.generate(
            input_ids=torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=list(eos_ids), pad_token_id=0,
            output_logits=True, return_dict_in_generate=True,
        )
        tokens = out.sequences[0, len(prompt):].tolist()
        return tokens, [torch.log_softmax(step[0].float(), dim=-1) for step in out.logits]

    @torch.no_grad()
    def prefill_logits(self, prompt: list[int]) -> torch.Tensor:
        return self.model(input_ids=torch.tensor([prompt])).logits[0].float()  # (len, V)


def load_hf_base(model_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def make_peft_adapter(base: torch.nn.Module, out_dir: Path, seed: int, scale: float = 0.1,
                      **lora_kwargs) -> PeftReference:
    """get_peft_model on a copy of `base`, every LoRA factor filled with seeded noise, saved as safetensors.

    PEFT initialises lora_B to zero, which would make every comparison trivially true; the noise avoids it.
    """
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(copy.deepcopy(base), LoraConfig(**lora_kwargs))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    model.save_pretrained(out_dir, safe_serialization=True)
    return PeftReference(Path(out_dir), model.eval())


def random_prompts(vocab: int, lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, vocab - 10) for _ in range(n)] for n in lengths]
