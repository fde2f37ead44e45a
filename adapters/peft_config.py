"""adapter_config.json of a PEFT LoRA adapter: parsed, checked, and resolved against a base model.

Target resolution follows PEFT 0.21 exactly (peft.tuners.tuners_utils.check_target_module_exists and
peft.utils.other.get_pattern_key), applied to the module names of an HF Llama-family model
(`model.layers.<i>.self_attn.q_proj`, ...), so an adapter means here what it means under PEFT.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from adapters.errors import AdapterError
from adapters.safe_regex import compile_bounded_regex
from wire.checkpoint import LORA_TARGET_MODULES, ModelConfig

ModuleKey = tuple[int, str]  # (layer index, projection name such as "q_proj")

ATTENTION_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")
EMBEDDING_MODULES = ("model.embed_tokens", "lm_head")
ALL_LINEAR = "all-linear"  # PEFT's shorthand: every linear layer but the output head

# Config fields that turn on a feature loraplex does not serve: (field, what it is).
_UNSUPPORTED_FEATURES = (
    ("use_dora", "DoRA (use_dora) is not supported"),
    ("modules_to_save", "modules_to_save (fully trained extra modules) is not supported"),
    ("lora_bias", "lora_bias (a bias on lora_B) is not supported"),
    ("layer_replication", "layer_replication is not supported"),
    ("target_parameters", "target_parameters (LoRA on raw parameters) is not supported"),
    ("trainable_token_indices", "trainable_token_indices (embedding changes) is not supported"),
    ("alora_invocation_tokens", "activated LoRA (alora_invocation_tokens) is not supported"),
    ("use_qalora", "QA-LoRA (use_qalora) is not supported"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora) is not supported"),
)


def module_path(layer: int, module: str) -> str:
    """HF module name of a projection: module_path(0, "q_proj") == "model.layers.0.self_attn.q_proj"."""
    parent = "self_attn" if module in ATTENTION_PROJECTIONS else "mlp"
    return f"model.layers.{layer}.{parent}.{module}"


def base_module_names(model_config: ModelConfig) -> tuple[str, ...]:
    """Every module name an HF Llama-family model of this shape has (what PEFT matches targets against)."""
    names = ["model", "model.embed_tokens", "model.layers"]
    for layer in range(model_config.num_layers):
        prefix = f"model.layers.{layer}"
        names += [
            prefix,
            f"{prefix}.self_attn",
            f"{prefix}.mlp",
            f"{prefix}.mlp.act_fn",
            f"{prefix}.input_layernorm",
            f"{prefix}.post_attention_layernorm",
        ]
        if model_config.qk_norm:
            names += [f"{prefix}.self_attn.q_norm", f"{prefix}.self_attn.k_norm"]
        names += [module_path(layer, module) for module in LORA_TARGET_MODULES]
    names += ["model.norm", "model.rotary_emb", "lm_head"]
    return tuple(names)


@dataclass(frozen=True)
class PeftLoraConfig:
    """The LoRA fields of adapter_config.json that decide what the adapter computes. Validated."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str  # a list of name suffixes, or one regex (fullmatch), as in PEFT
    use_rslora: bool = False
    fan_in_fan_out: bool = False
    layers_to_transform: tuple[int, ...] | None = None
    layers_pattern: tuple[str, ...] | None = None
    exclude_modules: tuple[str, ...] | str | None = None
    rank_pattern: Mapping[str, int] = field(default_factory=dict)
    alpha_pattern: Mapping[str, float] = field(default_factory=dict)
    base_model_name_or_path: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise AdapterError(f"adapter_config.json: r must be a positive integer, got {self.r!r}")
        if not _is_finite_number(self.lora_alpha):
            raise AdapterError(
                f"adapter_config.json: lora_alpha must be a finite number, got {self.lora_alpha!r}"
            )
        for key, rank in self.rank_pattern.items():
            if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
                raise AdapterError(
                    f"adapter_config.json: rank_pattern[{key!r}] must be a positive integer, got {rank!r}"
                )
        for key, alpha in self.alpha_pattern.items():
            if not _is_finite_number(alpha):
                raise AdapterError(
                    f"adapter_config.json: alpha_pattern[{key!r}] must be a finite number, got {alpha!r}"
                )
        if isinstance(self.target_modules, str) and self.layers_to_transform is not None:
            raise AdapterError(
                "adapter_config.json: layers_to_transform cannot be used when target_modules is a regex string"
            )
        object.__setattr__(self, "rank_pattern", MappingProxyType(dict(self.rank_pattern)))
        object.__setattr__(self, "alpha_pattern", MappingProxyType(dict(self.alpha_pattern)))
        # Compile every tenant-supplied pattern now, so a bad one fails here with its field named.
        if isinstance(self.target_modules, str) and self.target_modules != ALL_LINEAR:
            compile_bounded_regex(self.target_modules, "target_modules")
        if isinstance(self.exclude_modules, str):
            compile_bounded_regex(self.exclude_modules, "exclude_modules")
        for name, patterns in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            for key in patterns:
                compile_bounded_regex(key, f"{name} key")
        for pattern in self.layers_pattern or ():
            compile_bounded_regex(pattern, "layers_pattern")

    @classmethod
    def from_dict(cls, raw: Any) -> PeftLoraConfig:
        """Parse a loaded adapter_config.json; raise AdapterError for anything loraplex does not serve."""
        if not isinstance(raw, dict):
            raise AdapterError("adapter_config.json: expected a JSON object")
        peft_type = raw.get("peft_type")
        if peft_type is not None and str(peft_type).upper() != "LORA":
            raise AdapterError(f"adapter_config.json: peft_type {peft_type!r} is not supported (only LORA)")
        for key, problem in _UNSUPPORTED_FEATURES:
            if raw.get(key):
                raise AdapterError(f"adapter_config.json: {problem}")
        bias = raw.get("bias", "none")
        if bias != "none":
            raise AdapterError(f"adapter_config.json: bias {bias!r} is not supported (only 'none')")
        if "r" not in raw or "target_modules" not in raw or raw["target_modules"] is None:
            missing = "r" if "r" not in raw else "target_modules"
            raise AdapterError(f"adapter_config.json: required field {missing!r} is missing")
        base = raw.get("base_model_name_or_path")
        return cls(
            r=raw["r"],
            lora_alpha=raw.get("lora_alpha", 8),
            target_modules=_target_modules(raw["target_modules"]),
            use_rslora=_flag(raw, "use_rslora"),
            fan_in_fan_out=_flag(raw, "fan_in_fan_out"),
            layers_to_transform=_layers_to_transform(raw.get("layers_to_transform")),
            layers_pattern=_string_list(raw.get("layers_pattern"), "layers_pattern"),
            exclude_modules=_exclude_modules(raw.get("exclude_modules")),
            rank_pattern=_pattern_dict(raw.get("rank_pattern"), "rank_pattern"),
            alpha_pattern=_pattern_dict(raw.get("alpha_pattern"), "alpha_pattern"),
            base_model_name_or_path=str(base) if base else None,
        )

    def resolve_targets(self, model_config: ModelConfig) -> tuple[ModuleKey, ...]:
        """The (layer, projection) pairs this adapter adapts on `model_config`, sorted by layer then module.

        Raises AdapterError when a target names an embedding/lm_head, a module loraplex does not serve,
        or nothing of the base model. This operation reads only the config.
        """
        names = base_module_names(model_config)
        if self.target_modules == ALL_LINEAR:
            matched = [
                n for n in names if n.rsplit(".", 1)[-1] in LORA_TARGET_MODULES and not self._is_excluded(n)
            ]
        elif isinstance(self.target_modules, str):
            matched = [n for n in names if self._is_targeted(n)]
            self._check_matched(matched, f"target_modules regex {self.target_modules!r}")
            if not matched:
                raise AdapterError(
                    f"adapter_config.json: target_modules regex {self.target_modules!r} matches no projection "
                    f"of the base model ({', '.join(LORA_TARGET_MODULES)})"
                )
        else:
            for target in self.target_modules:
                hits = [n for n in names if n == target or n.endswith(f".{target}")]
                if not hits:
                    raise AdapterError(
                        f"adapter_config.json: unknown target module {target!r}; loraplex serves LoRA on "
                        f"{', '.join(LORA_TARGET_MODULES)} of a Llama-family model"
                    )
                self._check_matched(hits, f"target module {target!r}")
            matched = [n for n in names if self._is_targeted(n)]
        by_path = {
            module_path(layer, m): (layer, m)
            for layer in range(model_config.num_layers)
            for m in LORA_TARGET_MODULES
        }
        targets = sorted(
            (by_path[n] for n in matched if n in by_path),
            key=lambda k: (k[0], LORA_TARGET_MODULES.index(k[1])),
        )
        if not targets:
            raise AdapterError(
                "adapter_config.json: the adapter targets no module of the base model "
                "(check target_modules, layers_to_transform and exclude_modules)"
            )
        return tuple(targets)

    def rank_for(self, key: ModuleKey) -> int:
        """LoRA rank of one module: the first rank_pattern key that matches its name, else r (PEFT's rule)."""
        pattern = _first_pattern_key(self.rank_pattern, module_path(*key))
        return self.rank_pattern[pattern] if pattern is not None else self.r

    def scaling_for(self, key: ModuleKey) -> float:
        """alpha / sqrt(rank) with use_rslora, else alpha / rank; alpha from alpha_pattern like rank_for."""
        pattern = _first_pattern_key(self.alpha_pattern, module_path(*key))
        alpha = float(self.alpha_pattern[pattern] if pattern is not None else self.lora_alpha)
        rank = self.rank_for(key)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def _is_excluded(self, name: str) -> bool:
        if isinstance(self.exclude_modules, str):
            return re.fullmatch(self.exclude_modules, name) is not None
        if self.exclude_modules:
            return name in self.exclude_modules or any(name.endswith(f".{e}") for e in self.exclude_modules)
        return False

    def _is_targeted(self, name: str) -> bool:
        if self._is_excluded(name):
            return False
        if isinstance(self.target_modules, str):
            return re.fullmatch(self.target_modules, name) is not None
        if name in self.target_modules:
            return True
        if not any(name.endswith(f".{t}") for t in self.target_modules):
            return False
        if self.layers_to_transform is None:
            return True
        layer = self._layer_index(name)
        return layer is not None and layer in self.layers_to_transform

    def _layer_index(self, name: str) -> int | None:
        if not self.layers_pattern:
            match = re.match(r".*?\.[^.]*\.(?P<idx>\d+)\.", name)
        else:
            match = None
            for pattern in self.layers_pattern:
                match = re.match(rf"(?:^|.*?\.){pattern}\.(?P<idx>\d+)\.", name)
                if match is not None:
                    break
        return int(match.group("idx")) if match else None

    def _check_matched(self, matched: list[str], what: str) -> None:
        for name in matched:
            if self._is_excluded(name):
                continue
            if name in EMBEDDING_MODULES:
                raise AdapterError(
                    f"adapter_config.json: {what} targets {name} (LoRA on embeddings or lm_head "
                    "is not supported)"
                )
            if name.rsplit(".", 1)[-1] not in LORA_TARGET_MODULES:
                raise AdapterError(
                    f"adapter_config.json: {what} targets {name}, which is not one of "
                    f"{', '.join(LORA_TARGET_MODULES)}"
                )


def _first_pattern_key(patterns: Mapping[str, Any], name: str) -> str | None:
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return None


def _is_finite_number(value: Any) -> bool:
    if not isinstance(value, int | float) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float (JSON allows any number of digits)
        return False


def _flag(raw: dict[str, Any], key: str) -> bool:
    value = raw.get(key, False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise AdapterError(f"adapter_config.json: {key} must be true or false, got {value!r}")
    return value


def _target_modules(value: Any) -> tuple[str, ...] | str:
    if isinstance(value, str):
        return value
    names = _string_list(value, "target_modules")
    if not names:
        raise AdapterError("adapter_config.json: target_modules is empty")
    return names


def _exclude_modules(value: Any) -> tuple[str, ...] | str | None:
    return value if isinstance(value, str) else _string_list(value, "exclude_modules")


def _string_list(value: Any, key: str) -> tuple[str, ...] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise AdapterError(f"adapter_config.json: {key} must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _layers_to_transform(value: Any) -> tuple[int, ...] | None:
    if value is None or value == []:
        return None
    values = [value] if isinstance(value, int) else value
    if not isinstance(values, list) or not all(
        isinstance(v, int) and not isinstance(v, bool) for v in values
    ):
        raise AdapterError(
            f"adapter_config.json: layers_to_transform must be an integer or a list of integers, got {value!r}"
        )
    return tuple(values)


def _pattern_dict(value: Any, key: str) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise AdapterError(
            f"adapter_config.json: {key} must be an object mapping patterns to values, got {value!r}"
        )
    return dict(value)
