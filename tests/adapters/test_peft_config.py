"""adapters.peft_config: target resolution agrees with PEFT's own matcher; bad fields are named."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest

from adapters.errors import AdapterError
from adapters.peft_config import PeftLoraConfig, base_module_names, module_path
from engine.config import LORA_TARGET_MODULES, ModelConfig

TARGET_CASES = {
    "suffix-list": dict(target_modules=["q_proj", "down_proj"]),
    "dotted-suffix": dict(target_modules=["self_attn.v_proj", "mlp.up_proj"]),
    "full-path": dict(target_modules=["model.layers.1.self_attn.o_proj"]),
    "regex": dict(target_modules=r".*layers\.0\.(self_attn|mlp)\.[a-z]+_proj"),
    "regex-with-exclude": dict(target_modules=r".*_proj", exclude_modules=r".*\.k_proj"),
    "layers-list": dict(target_modules=["q_proj", "gate_proj"], layers_to_transform=[0, 2]),
    "layers-int-and-pattern": dict(target_modules=["k_proj"], layers_to_transform=2, layers_pattern="layers"),
    "layers-foreign-pattern": dict(target_modules=["k_proj"], layers_to_transform=2, layers_pattern="h"),
    "exclude-list": dict(
        target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.1.self_attn.q_proj"]
    ),
}


@pytest.fixture(scope="module")
def three_layer_config(make_model: Callable[..., Path]) -> ModelConfig:
    return ModelConfig.from_pretrained(make_model("llama", num_hidden_layers=3))


@pytest.mark.parametrize("kwargs", TARGET_CASES.values(), ids=TARGET_CASES.keys())
def test_targets_agree_with_peft(three_layer_config, kwargs) -> None:
    from peft import LoraConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    peft_config = LoraConfig(r=4, **kwargs)
    expected = {
        name
        for name in base_module_names(three_layer_config)
        if bool(check_target_module_exists(peft_config, name))  # excluded modules are falsy in PEFT
    }
    ours = PeftLoraConfig.from_dict({"r": 4, **_jsonable(kwargs)})
    if not expected:
        with pytest.raises(AdapterError, match="targets no module of the base model"):
            ours.resolve_targets(three_layer_config)
        return
    resolved = ours.resolve_targets(three_layer_config)
    assert {module_path(*key) for key in resolved} == expected
    assert list(resolved) == sorted(resolved, key=lambda k: (k[0], LORA_TARGET_MODULES.index(k[1])))


def _jsonable(kwargs: dict) -> dict:
    return {k: list(v) if isinstance(v, tuple | set) else v for k, v in kwargs.items()}


def test_rank_and_alpha_patterns_follow_peft_get_pattern_key(three_layer_config) -> None:
    from peft.utils.other import get_pattern_key

    rank_pattern = {r"layers\.1\.self_attn\.q_proj": 2, "q_proj": 6, "down_proj": 3}
    alpha_pattern = {"mlp.down_proj": 1.5}
    config = PeftLoraConfig.from_dict(
        {
            "r": 8,
            "lora_alpha": 16,
            "use_rslora": False,
            "target_modules": ["q_proj", "down_proj", "up_proj"],
            "rank_pattern": rank_pattern,
            "alpha_pattern": alpha_pattern,
        }
    )
    for key in config.resolve_targets(three_layer_config):
        name = module_path(*key)
        rank = rank_pattern.get(get_pattern_key(rank_pattern.keys(), name), 8)
        alpha = alpha_pattern.get(get_pattern_key(alpha_pattern.keys(), name), 16)
        assert config.rank_for(key) == rank
        assert config.scaling_for(key) == pytest.approx(alpha / rank)
    assert config.rank_for((1, "q_proj")) == 2 and config.rank_for((0, "q_proj")) == 6


def test_rslora_scaling() -> None:
    config = PeftLoraConfig.from_dict(
        {"r": 16, "lora_alpha": 8, "use_rslora": True, "target_modules": ["q_proj"]}
    )
    assert config.scaling_for((0, "q_proj")) == pytest.approx(8 / math.sqrt(16))
    plain = PeftLoraConfig.from_dict({"r": 16, "lora_alpha": 8, "target_modules": ["q_proj"]})
    assert plain.scaling_for((0, "q_proj")) == pytest.approx(0.5)


def test_all_linear_means_the_seven_projections(three_layer_config) -> None:
    config = PeftLoraConfig.from_dict({"r": 4, "target_modules": "all-linear"})
    assert len(config.resolve_targets(three_layer_config)) == 3 * len(LORA_TARGET_MODULES)


def test_qwen3_norms_are_not_targets(make_model) -> None:
    qwen3 = ModelConfig.from_pretrained(make_model("qwen3"))
    with pytest.raises(AdapterError, match=r"targets model.layers.0.self_attn.q_norm, which is not one of"):
        PeftLoraConfig.from_dict({"r": 4, "target_modules": ["q_norm"]}).resolve_targets(qwen3)


FIELD_ERRORS = {
    "not-object": ([1, 2], r"expected a JSON object"),
    "missing-r": ({"target_modules": ["q_proj"]}, r"required field 'r' is missing"),
    "missing-targets": ({"r": 4}, r"required field 'target_modules' is missing"),
    "empty-targets": ({"r": 4, "target_modules": []}, r"target_modules is empty"),
    "bool-rank": ({"r": True, "target_modules": ["q_proj"]}, r"r must be a positive integer"),
    "nan-alpha": (
        {"r": 4, "lora_alpha": float("nan"), "target_modules": ["q_proj"]},
        r"lora_alpha must be a finite",
    ),
    "string-flag": (
        {"r": 4, "use_rslora": "yes", "target_modules": ["q_proj"]},
        r"use_rslora must be true or false",
    ),
    "bad-rank-pattern": (
        {"r": 4, "target_modules": ["q_proj"], "rank_pattern": {"q_proj": -1}},
        r"rank_pattern\['q_proj'\] must be a positive integer",
    ),
    "bad-layers": (
        {"r": 4, "target_modules": ["q_proj"], "layers_to_transform": ["0"]},
        r"layers_to_transform must be an integer or a list of integers",
    ),
    "layers-with-regex": (
        {"r": 4, "target_modules": ".*q_proj", "layers_to_transform": [0]},
        r"layers_to_transform cannot be used when target_modules is a regex",
    ),
    "invalid-regex": ({"r": 4, "target_modules": "(q_proj"}, r"target_modules is not a valid regex"),
    "redos-rank-pattern": (
        {"r": 4, "target_modules": ["q_proj"], "rank_pattern": {"(ab|a)*c": 2}},
        r"rank_pattern key regex .* nests a repetition",
    ),
    "layer-replication": (
        {"r": 4, "target_modules": ["q_proj"], "layer_replication": [[0, 1]]},
        r"layer_replication is not supported",
    ),
    "trainable-tokens": (
        {"r": 4, "target_modules": ["q_proj"], "trainable_token_indices": [1, 2]},
        r"trainable_token_indices \(embedding changes\) is not supported",
    ),
}


@pytest.mark.parametrize("raw, message", FIELD_ERRORS.values(), ids=FIELD_ERRORS.keys())
def test_bad_fields_are_named(raw, message) -> None:
    with pytest.raises(AdapterError, match=message):
        PeftLoraConfig.from_dict(raw)
