"""References for the quantization tests: dequantized checkpoints, transformers on given weights, and a GPTQ
packer that writes 4-bit checkpoints the way AutoGPTQ / GPTQModel lay them out (written here, independently
of loraplex's reader, so a reader bug cannot cancel out)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def write_checkpoint(src: Path, state_dict: dict[str, torch.Tensor], out: Path,
                     config_update: dict | None = None) -> Path:
    """A copy of the checkpoint directory `src` (config, tokenizer, generation config) with these weights."""
    out.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and not f.name.startswith("model"):
            shutil.copy(f, out / f.name)
    config = json.loads((src / "config.json").read_text())
    config.pop("quantization_config", None)
    config.update(config_update or {})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file({k: v.contiguous() for k, v in state_dict.items()}, str(out / "model.safetensors"))
    return out


def hf_with_weights(model_dir: Path, state_dict: dict[str, torch.Tensor]) -> torch.nn.Module:
    """transformers' model of `model_dir` (fp32) with every weight replaced by `state_dict`'s."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    result = model.load_state_dict(state_dict, strict=False)
    assert not result.unexpected_keys, result.unexpected_keys
    tied = model.config.tie_word_embeddings
    assert set(result.missing_keys) <= ({"lm_head.weight"} if tied else set()), result.missing_keys
    return model


def with_int8_inputs(model: torch.nn.Module) -> torch.nn.Module:
    """`model` (in place) with the input of every quantized projection (the *_proj layers, and lm_head unless
    tied) rounded per row to int8 and back, as W8A8 reads it: x -> round(x * 127 / max|x|) * max|x| / 127
    (written here, independently of kernels.quant.round_rows_int8). The hook sits on the nn.Linear itself,
    so under peft the LoRA path still reads the unrounded input, as loraplex's does."""

    def rounded(_module: torch.nn.Module, args: tuple) -> tuple:
        x = args[0].float()
        amax = x.abs().amax(dim=-1, keepdim=True)
        q = torch.where(amax > 0, torch.round(x * (127.0 / amax)), torch.zeros_like(x))
        return (q * (amax / 127),)

    tied = model.config.tie_word_embeddings
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and (name.endswith("_proj") or (name == "lm_head" and not tied)):
            module.register_forward_pre_hook(rounded)
    return model


def write_gptq_checkpoint(src: Path, out: Path, *, group_size: int = 32, sym: bool = False,
                          checkpoint_format: str = "gptq", permuted_g_idx: bool = False,
                          quantization_config: dict | None = None) -> dict[str, torch.Tensor]:
    """Quantize every projection of the fp32 checkpoint `src` to 4 bits with GPTQ's rounding (round to
    nearest, min-max per group; no Hessian updates, which change the values, not the layout) and write
    `out` in GPTQ's safetensors layout (other tensors in fp16, like real GPTQ checkpoints).

    Returns the HF-named fp32 weights the checkpoint means: W[n, k] = scale[g, n] * (q[k, n] - z[g, n]).
    `quantization_config` entries override the written config's (to make unsupported variants).
    """
    tensors, reference = {}, {}
    for name, w in load_file(str(src / "model.safetensors")).items():
        if not name.endswith("_proj.weight"):
            tensors[name] = w.half()
            reference[name] = w.half().float()
            continue
        prefix = name.removesuffix("weight")
        packed, dequantized = _gptq_linear(w.float(), group_size, sym, checkpoint_format, permuted_g_idx)
        tensors.update({prefix + part: t for part, t in packed.items()})
        reference[name] = dequantized
    qc = {"quant_method": "gptq", "bits": 4, "group_size": group_size, "desc_act": permuted_g_idx, "sym": sym,
          "checkpoint_format": checkpoint_format, "lm_head": False, **(quantization_config or {})}
    write_checkpoint(src, tensors, out, {"torch_dtype": "float16", "quantization_config": qc})
    return reference


def _gptq_linear(w: torch.Tensor, group_size: int, sym: bool, checkpoint_format: str,
                 permuted_g_idx: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    n, k = w.shape
    group = group_size if group_size > 0 else k
    wt = w.T.reshape(k // group, group, n)  # (G, gs, N): GPTQ works on W.T, groups along in_features
    if sym:
        scale = (2 * wt.abs().amax(1) / 15).clamp(min=1e-8).half()
        zero = torch.full(scale.shape, 8, dtype=torch.int64)
    else:
        lo, hi = wt.amin(1).clamp(max=0), wt.amax(1).clamp(min=0)
        scale = ((hi - lo) / 15).clamp(min=1e-8).half()
        zero = torch.round(-lo / scale.float()).clamp(0, 15).long()
    q = (torch.round(wt / scale.float()[:, None]) + zero[:, None]).clamp(0, 15).long()  # (G, gs, N)
    dequantized = (scale.float()[:, None] * (q - zero[:, None])).reshape(k, n).T.contiguous()
    stored_zero = (zero - 1 if checkpoint_format == "gptq" else zero) & 15  # v1 stores z - 1
    g_idx = torch.arange(k, dtype=torch.int32) // group
    if permuted_g_idx:  # act-order: inputs quantized out of k order
        g_idx = g_idx[torch.randperm(k, generator=torch.Generator().manual_seed(0))]
    packed = {
        "qweight": _pack(q.reshape(k // 8, 8, n), dim=1),  # (K / 8, N)
        "qzeros": _pack(stored_zero.reshape(k // group, n // 8, 8), dim=2),  # (G, N / 8)
        "scales": scale.contiguous(),  # (G, N) fp16
        "g_idx": g_idx,
    }
    return packed, dequantized


def _pack(values: torch.Tensor, dim: int) -> torch.Tensor:
    """Eight 4-bit values along `dim` into one int32, value j at bits 4j (two's complement wrap)."""
    shifts = (torch.arange(8, dtype=torch.int64) * 4).view([-1 if d == dim else 1 for d in range(values.dim())])
    word = (values.long() << shifts).sum(dim)
    return torch.where(word >= 2**31, word - 2**32, word).to(torch.int32).contiguous()
