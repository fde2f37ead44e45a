"""Checkpoint loading: logits against transformers for every supported family; clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from engine import LLM, CheckpointError

transformers = pytest.importorskip("transformers")

PROMPT_LEN = 300  # beyond the llama family's original_max_position_embeddings (256): exercises rope scaling


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3"])
def test_prefill_logits_match_transformers(make_model, family):
    model_dir = make_model(family)
    llm = LLM(model_dir, num_kv_blocks=64, block_size=16)
    ids = torch.randint(0, llm.engine.model_config.vocab_size, (PROMPT_LEN,), generator=torch.Generator().manual_seed(1)).tolist()
    ours = llm.engine.runner.prefill_logits(ids)
    ref = hf_logits(model_dir, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_sharded_checkpoint_matches_transformers(make_model):
    model_dir = make_model("qwen2", shards=3)
    assert (model_dir / "model.safetensors.index.json").is_file()
    llm = LLM(model_dir, num_kv_blocks=32)
    ids = list(range(5, 120))
    assert (llm.engine.runner.prefill_logits(ids) - hf_logits(model_dir, ids)).abs().max().item() <= 1e-4


def test_sliding_window_matches_transformers(make_model):
    model_dir = make_model("mistral", extra={"sliding_window": 16})
    llm = LLM(model_dir, num_kv_blocks=32, block_size=4)
    ids = list(range(3, 70))
    assert (llm.engine.runner.prefill_logits(ids) - hf_logits(model_dir, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_runs_close_to_fp32(llama_dir, dtype):
    ids = list(range(10, 60))
    ref = LLM(llama_dir, num_kv_blocks=16).engine.runner.prefill_logits(ids)
    half = LLM(llama_dir, num_kv_blocks=16, dtype=dtype).engine.runner.prefill_logits(ids)
    assert half.dtype == torch.float32
    assert (half - ref).abs().max().item() < 0.1


def _broken(tmp_path: Path, src: Path, edit) -> Path:
    dst = tmp_path / "ckpt"
    shutil.copytree(src, dst)
    edit(dst)
    return dst


def _edit_config(**changes):
    def edit(d: Path) -> None:
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
    return edit


def _drop_tensor(name: str):
    def edit(d: Path) -> None:
        from safetensors.torch import load_file, save_file
        sd = load_file(d / "model.safetensors")
        del sd[name]
        save_file(sd, d / "model.safetensors")
    return edit


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: (d / "config.json").unlink(), "config.json is missing"),
        (lambda d: (d / "config.json").write_text("{not json"), "invalid JSON"),
        (_edit_config(architectures=["GPT2LMHeadModel"]), "unsupported architecture 'GPT2LMHeadModel'"),
        (_edit_config(hidden_size=96), "has shape"),
        (_edit_config(num_key_value_heads=3), "not a multiple of num_key_value_heads"),
        (_drop_tensor("model.layers.1.mlp.down_proj.weight"), "missing tensor model.layers.1.mlp.down_proj.weight"),
        (lambda d: (d / "model.safetensors").write_bytes(b"garbage"), "not a readable safetensors file"),
        (lambda d: (d / "model.safetensors").rename(d / "pytorch_model.bin"), "only safetensors weights"),
        (lambda d: (d / "tokenizer.json").unlink(), "tokenizer.json is missing"),
        (_edit_config(rope_scaling={"rope_type": "yarn", "factor": 4.0}), "unsupported rope_type 'yarn'"),
    ],
)
def test_malformed_checkpoint_gives_one_clear_line(tmp_path, llama_dir, edit, message):
    bad = _broken(tmp_path, llama_dir, edit)
    with pytest.raises(CheckpointError) as err:
        LLM(bad, num_kv_blocks=8)
    text = str(err.value)
    assert message in text
    assert "\n" not in text


def test_not_a_directory(tmp_path):
    with pytest.raises(CheckpointError, match="not a directory"):
        LLM(tmp_path / "nope")
