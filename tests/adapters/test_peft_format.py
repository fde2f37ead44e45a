"""adapters.peft_format against adapters written by peft itself: every accepted feature, every rejection."""

from __future__ import annotations

import hashlib
import json
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from adapters.adapter_files import adapter_digest
from adapters.errors import AdapterError
from adapters.lora_adapter import load_peft_adapter
from adapters.peft_config import module_path
from adapters.peft_format import base_model_matches, validate_peft_adapter
from engine.config import LORA_TARGET_MODULES, ModelConfig

ALL_SEVEN = list(LORA_TARGET_MODULES)


def peft_lora_layers(peft_model: torch.nn.Module) -> dict[tuple[int, str], torch.nn.Module]:
    """(layer, projection) -> peft's LoRA Linear, read from the peft model itself."""
    from peft.tuners.lora import Linear as LoraLinear

    found = {}
    for name, module in peft_model.named_modules():
        if isinstance(module, LoraLinear):
            parts = name.split(".")
            found[(int(parts[parts.index("layers") + 1]), parts[-1])] = module
    return found


def assert_matches_peft(adapter, peft_model: torch.nn.Module) -> None:
    layers = peft_lora_layers(peft_model)
    assert set(adapter.weights) == set(layers)
    for key, lora in layers.items():
        ours = adapter.weights[key]
        torch.testing.assert_close(ours.lora_a, lora.lora_A["default"].weight, rtol=0, atol=0)
        torch.testing.assert_close(ours.lora_b, lora.lora_B["default"].weight, rtol=0, atol=0)
        assert ours.scaling == pytest.approx(lora.scaling["default"], rel=1e-12)
        assert ours.lora_a.dtype == torch.float32 and ours.lora_b.dtype == torch.float32
        # The adapter's contract y = base(x) + scaling * x A^T B^T, checked against peft's own forward.
        x = torch.randn(3, ours.lora_a.shape[1], generator=torch.Generator().manual_seed(1))  # (tokens, in)
        with torch.no_grad():
            expected = lora(x) - lora.base_layer(x)
        torch.testing.assert_close(ours.scaling * (x @ ours.lora_a.T) @ ours.lora_b.T, expected)


ACCEPTED_CONFIGS = {
    "all-seven-rslora": dict(r=8, lora_alpha=16, target_modules=ALL_SEVEN, use_rslora=True),
    "qv-plain-scaling": dict(r=4, lora_alpha=32, target_modules=["q_proj", "v_proj"]),
    "regex-string": dict(r=4, lora_alpha=8, target_modules=r".*\.(q|v|down)_proj"),
    "all-linear": dict(r=2, lora_alpha=4, target_modules="all-linear"),
    "layers-to-transform": dict(r=8, target_modules=["q_proj", "o_proj"], layers_to_transform=[1]),
    "layers-pattern-int": dict(
        r=8, target_modules=["k_proj"], layers_to_transform=0, layers_pattern="layers"
    ),
    "rank-and-alpha-pattern": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "down_proj", "up_proj"],
        use_rslora=True,
        rank_pattern={"q_proj": 4, r"layers\.1\.mlp\.up_proj": 2},
        alpha_pattern={"down_proj": 3},
    ),
    "exclude-modules": dict(
        r=4, target_modules=["q_proj", "v_proj"], exclude_modules=["model.layers.0.self_attn.v_proj"]
    ),
}


@pytest.mark.parametrize("kwargs", ACCEPTED_CONFIGS.values(), ids=ACCEPTED_CONFIGS.keys())
def test_factors_and_scaling_equal_peft_model(make_peft_adapter, kwargs) -> None:
    adapter_dir, peft_model = make_peft_adapter(**kwargs)
    model_config = ModelConfig.from_pretrained(peft_model.peft_config["default"].base_model_name_or_path)
    adapter = load_peft_adapter(adapter_dir, model_config, name="tenant-bot")
    assert_matches_peft(adapter, peft_model)


@pytest.mark.parametrize("family", ["qwen3", "mistral"])
def test_other_families_with_their_own_shapes(make_peft_adapter, hf_base_models, family) -> None:
    adapter_dir, peft_model = make_peft_adapter(family, r=4, target_modules=ALL_SEVEN)
    model_config = ModelConfig.from_pretrained(hf_base_models(family)[0])
    adapter = load_peft_adapter(adapter_dir, model_config, name="a")
    assert_matches_peft(adapter, peft_model)
    q_in, q_out = model_config.lora_module_shapes()["q_proj"]
    assert adapter.module(0, "q_proj").lora_b.shape == (q_out, 4)
    assert adapter.module(0, "q_proj").lora_a.shape == (4, q_in)


def test_manifest_describes_the_adapter(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(
        r=8, target_modules=["q_proj", "gate_proj"], rank_pattern={"gate_proj": 2}
    )
    config = ModelConfig.from_pretrained(llama_dir)
    adapter = load_peft_adapter(adapter_dir, config, name="support-bot", max_lora_rank=8)
    weights = (adapter_dir / "adapter_model.safetensors").read_bytes()
    config_bytes = (adapter_dir / "adapter_config.json").read_bytes()
    m = adapter.manifest
    assert m.weights_sha256 == hashlib.sha256(weights).hexdigest()
    assert adapter.sha256 == adapter_digest(config_bytes, m.weights_sha256)
    assert adapter.identity == ("support-bot", adapter.sha256)
    assert adapter.rank == 8 and m.module_ranks[(0, "gate_proj")] == 2
    assert adapter.target_modules == ("q_proj", "gate_proj") and m.layers == (0, 1)
    assert adapter.size_bytes == len(weights)
    assert m.num_parameters == sum(
        t.numel() for t in load_file(adapter_dir / "adapter_model.safetensors").values()
    )
    assert adapter.base_model_name_or_path == str(llama_dir)
    assert adapter.module(0, "k_proj") is None
    assert validate_peft_adapter(adapter_dir, config, name="support-bot", max_lora_rank=8) == m


def test_config_only_change_is_a_new_version(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, lora_alpha=8, target_modules=["q_proj"])
    config = ModelConfig.from_pretrained(llama_dir)
    before = validate_peft_adapter(adapter_dir, config, name="a")
    edit_config(adapter_dir, lora_alpha=16)
    after = validate_peft_adapter(adapter_dir, config, name="a")
    assert after.weights_sha256 == before.weights_sha256
    assert after.sha256 != before.sha256
    assert after.module_scalings[(0, "q_proj")] == 2 * before.module_scalings[(0, "q_proj")]


def test_fan_in_fan_out_follows_peft(make_peft_adapter, hf_base_models, llama_dir) -> None:
    """PEFT stores LoRA factors in nn.Linear layout whatever fan_in_fan_out says (it only transposes the
    merged delta of Conv1D layers, and resets the flag for Linear targets); loading one must match PEFT."""
    import copy

    from peft import PeftModel

    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj", "down_proj"])
    edit_config(adapter_dir, fan_in_fan_out=True)
    reloaded = PeftModel.from_pretrained(copy.deepcopy(hf_base_models("llama")[1]), adapter_dir).eval()
    adapter = load_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")
    assert_matches_peft(adapter, reloaded)


def test_half_precision_weights_become_float32(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["v_proj"])
    weights_file = adapter_dir / "adapter_model.safetensors"
    bf16 = {k: v.to(torch.bfloat16) for k, v in load_file(weights_file).items()}
    save_file(bf16, weights_file)
    adapter = load_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")
    expected = bf16["base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight"].float()
    assert adapter.module(1, "v_proj").lora_b.dtype == torch.float32
    torch.testing.assert_close(adapter.module(1, "v_proj").lora_b, expected, rtol=0, atol=0)


def test_base_model_names_compare_by_path_basename_and_served_name() -> None:
    assert base_model_matches("/models/Llama-3-8B/", ["meta-llama/Llama-3-8B"])
    assert base_model_matches("meta-llama/Llama-3-8B", ["/srv/weights/llama-3-8b"])
    assert base_model_matches("Llama-3-8B", ["served-name", "Llama-3-8B"])
    assert not base_model_matches("meta-llama/Llama-2-7b", ["/models/Llama-3-8B", "llama3"])
    assert not base_model_matches("", ["x"])


def test_base_model_check(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    config = ModelConfig.from_pretrained(llama_dir)
    load_peft_adapter(adapter_dir, config, name="a", accepted_base_models=["demo", str(llama_dir)])
    load_peft_adapter(adapter_dir, config, name="a", accepted_base_models=[f"/elsewhere/{llama_dir.name}"])
    with pytest.raises(AdapterError, match=r"trained for base model .* but this server serves 'demo-llama'"):
        load_peft_adapter(adapter_dir, config, name="a", accepted_base_models=["demo-llama"])
    edit_config(adapter_dir, base_model_name_or_path=None)
    load_peft_adapter(adapter_dir, config, name="a", accepted_base_models=["demo-llama"])


# ---------------------------------------------------------------------------------------------- rejections


def edit_config(adapter_dir: Path, **changes) -> None:
    path = adapter_dir / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(adapter_dir: Path, edit) -> None:
    path = adapter_dir / "adapter_model.safetensors"
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


class _TouchOnUnpickle:
    """Unpickling this creates a file: proof that a loader unpickled it."""

    def __init__(self, sentinel: Path) -> None:
        self.sentinel = sentinel

    def __reduce__(self):
        return (Path.touch, (self.sentinel,))


def test_pickle_weights_are_never_opened(make_peft_adapter, llama_dir, tmp_path) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    (adapter_dir / "adapter_model.safetensors").unlink()
    sentinel = tmp_path / "unpickled"
    (adapter_dir / "adapter_model.bin").write_bytes(pickle.dumps(_TouchOnUnpickle(sentinel)))
    with pytest.raises(
        AdapterError, match=r"^adapter_model.bin is a pickle file, which loraplex never loads"
    ):
        load_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")
    assert not sentinel.exists()


def test_missing_files(make_peft_adapter, llama_dir, tmp_path) -> None:
    config = ModelConfig.from_pretrained(llama_dir)
    with pytest.raises(AdapterError, match="not a directory"):
        load_peft_adapter(tmp_path / "nope", config, name="a")
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    (adapter_dir / "adapter_config.json").unlink()
    with pytest.raises(AdapterError, match=r"^adapter_config.json is missing"):
        load_peft_adapter(adapter_dir, config, name="a")
    (adapter_dir / "adapter_model.safetensors").unlink()
    with pytest.raises(AdapterError, match=r"^adapter_model.safetensors is missing"):
        load_peft_adapter(adapter_dir, config, name="a")


PEFT_MADE_REJECTIONS = {
    "modules-to-save": (
        dict(target_modules=["q_proj"], modules_to_save=["lm_head"]),
        r"modules_to_save \(fully trained extra modules\) is not supported",
    ),
    "dora": (dict(target_modules=["q_proj"], use_dora=True), r"DoRA \(use_dora\) is not supported"),
    "bias-all": (dict(target_modules=["q_proj"], bias="all"), r"bias 'all' is not supported"),
    "bias-lora-only": (
        dict(target_modules=["q_proj"], bias="lora_only"),
        r"bias 'lora_only' is not supported",
    ),
    "embedding-target": (
        dict(target_modules=["q_proj", "embed_tokens"]),
        r"target module 'embed_tokens' targets model.embed_tokens \(LoRA on embeddings",
    ),
}


@pytest.mark.parametrize("kwargs, message", PEFT_MADE_REJECTIONS.values(), ids=PEFT_MADE_REJECTIONS.keys())
def test_rejects_unsupported_peft_features(make_peft_adapter, llama_dir, kwargs, message) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, **kwargs)
    with pytest.raises(AdapterError, match=message):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")


CONFIG_EDIT_REJECTIONS = {
    "unknown-target": (dict(target_modules=["c_attn"]), r"unknown target module 'c_attn'"),
    "lm-head-target": (dict(target_modules=["q_proj", "lm_head"]), r"targets lm_head \(LoRA on embeddings"),
    "norm-target": (dict(target_modules="model.norm"), r"targets model.norm, which is not one of"),
    "regex-matches-nothing": (
        dict(target_modules=r".*\.c_attn"),
        r"regex '.*\\\\.c_attn' matches no projection",
    ),
    "redos-regex": (dict(target_modules=r"(.*q)+_proj"), r"target_modules regex .* nests a repetition"),
    "lora-bias": (dict(lora_bias=True), r"lora_bias \(a bias on lora_B\) is not supported"),
    "peft-type": (dict(peft_type="IA3"), r"peft_type 'IA3' is not supported"),
    "bad-rank": (dict(r=0), r"r must be a positive integer, got 0"),
}


@pytest.mark.parametrize(
    "changes, message", CONFIG_EDIT_REJECTIONS.values(), ids=CONFIG_EDIT_REJECTIONS.keys()
)
def test_rejects_bad_configs(make_peft_adapter, llama_dir, changes, message) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    edit_config(adapter_dir, **changes)
    with pytest.raises(AdapterError, match=message):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")


def test_rejects_invalid_json_and_invalid_safetensors(make_peft_adapter, llama_dir) -> None:
    config = ModelConfig.from_pretrained(llama_dir)
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    (adapter_dir / "adapter_model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{not json")
    with pytest.raises(AdapterError, match=r"^adapter_model.safetensors is not a valid safetensors file"):
        validate_peft_adapter(adapter_dir, config, name="a")
    (adapter_dir / "adapter_config.json").write_text("{r: 4")
    with pytest.raises(AdapterError, match=r"^adapter_config.json: invalid JSON"):
        validate_peft_adapter(adapter_dir, config, name="a")


def test_rejects_shapes_that_do_not_fit_the_base_model(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter("qwen3", r=4, target_modules=["q_proj"])  # qwen3 q_proj: 64 -> 128
    with pytest.raises(
        AdapterError,
        match=(
            r"^tensor base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight has shape \(128, 4\), "
            r"but the base model needs \(64, 4\)$"
        ),
    ):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")


def test_rejects_rank_above_max_lora_rank(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj", "v_proj"], rank_pattern={"v_proj": 16})
    with pytest.raises(
        AdapterError,
        match=(
            r"adapter rank 16 \(at model.layers.0.self_attn.v_proj\) is above this server's max_lora_rank 8"
        ),
    ):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a", max_lora_rank=8)


@pytest.mark.parametrize("bad_value", [float("nan"), float("inf")])
def test_rejects_nan_and_inf_naming_the_tensor(make_peft_adapter, llama_dir, bad_value) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj", "up_proj"])
    key = "base_model.model.model.layers.1.mlp.up_proj.lora_A.weight"

    def poison(tensors):
        tensors[key][2, 5] = bad_value

    edit_weights(adapter_dir, poison)
    with pytest.raises(AdapterError, match=rf"^tensor {key} contains NaN or Inf values$"):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")


KEY_EDIT_REJECTIONS = {
    "missing-lora-b": (
        lambda t: t.pop("base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight"),
        r"weight base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight is missing "
        r"\(model.layers.1.self_attn.q_proj needs both lora_A and lora_B\)",
    ),
    "unmapped-key": (
        lambda t: t.update({"base_model.model.model.rotary.lora_A.weight": torch.zeros(4, 4)}),
        r"weight key 'base_model.model.model.rotary.lora_A.weight' does not map to a LoRA module",
    ),
    "wrong-parent": (
        lambda t: t.update({"base_model.model.model.layers.0.mlp.q_proj.lora_A.weight": torch.zeros(4, 4)}),
        r"does not map to a LoRA projection",
    ),
    "layer-out-of-range": (
        lambda t: t.update(
            {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(4, 64)}
        ),
        r"is for layer 7, but the base model has 2 layers",
    ),
    "untargeted-module": (
        lambda t: t.update(
            {"base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": torch.zeros(4, 64)}
        ),
        r"is for model.layers.0.self_attn.k_proj, which adapter_config.json does not target",
    ),
    "embedding-weights": (
        lambda t: t.update({"base_model.model.model.embed_tokens.lora_embedding_A": torch.zeros(4, 8)}),
        r"adapts an embedding or lm_head",
    ),
    "integer-dtype": (
        lambda t: t.update(
            {
                "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(
                    4, 64, dtype=torch.int32
                )
            }
        ),
        r"has dtype I32; expected a float dtype",
    ),
}


@pytest.mark.parametrize("edit, message", KEY_EDIT_REJECTIONS.values(), ids=KEY_EDIT_REJECTIONS.keys())
def test_rejects_bad_weight_keys(make_peft_adapter, llama_dir, edit, message) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    edit_weights(adapter_dir, edit)
    with pytest.raises(AdapterError, match=message):
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")


def test_adapter_trained_on_fewer_layers_is_missing_weights(make_peft_adapter, make_model) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["o_proj"])
    deeper = ModelConfig.from_pretrained(make_model("llama", num_hidden_layers=3))
    with pytest.raises(
        AdapterError, match=rf"weight base_model.model.{module_path(2, 'o_proj')}.lora_A.weight is missing"
    ):
        validate_peft_adapter(adapter_dir, deeper, name="a")


def test_every_rejection_is_one_line(make_peft_adapter, llama_dir) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    edit_config(adapter_dir, target_modules=["qkv_proj"])
    with pytest.raises(AdapterError) as info:
        validate_peft_adapter(adapter_dir, ModelConfig.from_pretrained(llama_dir), name="a")
    assert "\n" not in str(info.value)
