"""Per-request sampling parameters (vLLM-compatible names): the one sampling spec from HTTP body to sampler.

The gateway builds a `SamplingParams` from the OpenAI body, the worker protocol carries it (`to_json` /
`from_json`, strict: unknown fields and wrong types are refused), and the engine samples with it. Its
types and bounds are checked here, once, in `__post_init__`; nothing downstream re-validates them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Any

MAX_N = 16  # samples per request
MAX_TEMPERATURE = 2.0
MAX_LOGPROBS = 20  # top-N logprobs per sampled token
MAX_LOGIT_BIAS = 1024  # biased tokens per request
MAX_CONSTRAINED_TOOLS = 128
MAX_STOP_TOKEN_IDS = 1024
# Seeds are what torch.Generator.manual_seed takes as one unsigned 64-bit value; larger or negative ones
# are refused here, before any engine step (a seed the generator refuses would fail inside the step).
MAX_SEED = 2**64 - 1
TOOL_MODES = ("auto", "required")


class InvalidSamplingParams(ValueError):
    """A sampling field has a wrong type or value. `param` is the field's name; the message names it too."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ConstrainedTool:
    """A tool a call may name: its place among the request's tools (refusals name `tools[index]`), its
    name, and the JSON schema of its arguments object."""

    index: int
    name: str
    parameters: dict


@dataclass(frozen=True)
class ToolCallConstraint:
    """The tool calls a request may produce, decoded under a grammar from the first token.

    format: the call format of the served model (tokenization/tool_formats.py: hermes, llama3_json,
    mistral); the worker refuses one it does not know. mode: "required" (calls only; a named tool_choice
    is required with one tool) or "auto" (free text until the format's trigger, then calls). parallel:
    more than one call allowed.
    """

    format: str
    tools: tuple[ConstrainedTool, ...]
    mode: str = "auto"
    parallel: bool = True

    def __post_init__(self) -> None:
        ok = (isinstance(self.format, str) and self.format and self.mode in TOOL_MODES
              and isinstance(self.parallel, bool) and isinstance(self.tools, tuple)
              and 0 < len(self.tools) <= MAX_CONSTRAINED_TOOLS
              and all(isinstance(t, ConstrainedTool) and isinstance(t.name, str) and t.name
                      and isinstance(t.parameters, dict) and isinstance(t.index, int) and not isinstance(t.index, bool)
                      for t in self.tools))
        if not ok:
            raise InvalidSamplingParams("tool_calls", f"tool_calls must name a format, a mode in {TOOL_MODES} and "
                                                      f"1..{MAX_CONSTRAINED_TOOLS} tools with object schemas")

    def to_json(self) -> dict[str, Any]:
        return {"format": self.format, "mode": self.mode, "parallel": self.parallel,
                "tools": [{"index": t.index, "name": t.name, "parameters": t.parameters} for t in self.tools]}

    @classmethod
    def from_json(cls, data: Any) -> ToolCallConstraint:
        try:
            tools = tuple(ConstrainedTool(t["index"], t["name"], t["parameters"]) for t in data["tools"])
            return cls(data["format"], tools, data.get("mode", "auto"), data.get("parallel", True))
        except (KeyError, TypeError) as e:
            raise InvalidSamplingParams("tool_calls", f"tool_calls is malformed ({type(e).__name__})") from None


@dataclass(frozen=True)
class SamplingParams:
    """How to pick tokens and when to stop. Validated on construction: InvalidSamplingParams (a ValueError)
    names the field. Sequences (stop, stop_token_ids, choice) are stored as tuples; numbers as given
    (floats as float).

    Structured output: at most one of json_schema (a dict or JSON string), json_object (any JSON
    object), regex, choice. A constrained request ends with "stop" when its grammar is complete, or
    "length" if max_tokens comes first. `tool_calls` constrains the calls a model makes (see
    ToolCallConstraint); in auto mode json_schema / json_object constrain the answer that is not a call.

    logit_bias: (token id, bias in [-100, 100]) pairs added to the logits before any grammar mask (so a
    bias never allows what the grammar forbids); given as pairs or as OpenAI's {id: bias} map.
    """

    n: int = 1
    max_tokens: int = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # top-N logprobs per sampled token (0 = only the sampled token's)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    tool_calls: ToolCallConstraint | None = None
    logit_bias: tuple[tuple[int, float], ...] = ()

    def __post_init__(self) -> None:
        for name, kind in _KINDS.items():
            value = getattr(self, name)
            checked = _CHECKERS[kind](name, value)
            if checked is not value:
                object.__setattr__(self, name, checked)
        p = self
        checks = [
            (1 <= p.n <= MAX_N, "n", f"must be in [1, {MAX_N}]"),
            (p.max_tokens >= 1, "max_tokens", "must be >= 1"),
            (0 <= p.min_tokens <= p.max_tokens, "min_tokens", "must be in [0, max_tokens]"),
            (0.0 <= p.temperature <= MAX_TEMPERATURE, "temperature", f"must be in [0, {MAX_TEMPERATURE:g}]"),
            (0.0 < p.top_p <= 1.0, "top_p", "must be in (0, 1]"),
            (p.top_k >= -1, "top_k", "must be -1, 0 (disabled) or positive"),
            (0.0 <= p.min_p <= 1.0, "min_p", "must be in [0, 1]"),
            (p.repetition_penalty > 0.0, "repetition_penalty", "must be > 0"),
            (-2.0 <= p.presence_penalty <= 2.0, "presence_penalty", "must be in [-2, 2]"),
            (-2.0 <= p.frequency_penalty <= 2.0, "frequency_penalty", "must be in [-2, 2]"),
            (p.logprobs is None or 0 <= p.logprobs <= MAX_LOGPROBS, "logprobs", f"must be in [0, {MAX_LOGPROBS}]"),
            (all(p.stop), "stop", "stop strings must be non-empty"),
            (p.seed is None or 0 <= p.seed <= MAX_SEED, "seed", "must be in [0, 2**64 - 1]"),
            (all(t >= 0 for t in p.stop_token_ids), "stop_token_ids", "token ids must be >= 0"),
            (len(p.stop_token_ids) <= MAX_STOP_TOKEN_IDS, "stop_token_ids", f"may list at most {MAX_STOP_TOKEN_IDS} ids"),
            (p.choice is None or (len(p.choice) > 0 and all(p.choice)), "choice",
             "must list at least one non-empty option"),
        ]
        for ok, name, why in checks:
            if not ok:
                raise InvalidSamplingParams(name, f"{name} {why}, got {_short(getattr(self, name))}")
        constraints = [p.json_schema is not None or p.json_object, p.regex is not None, p.choice is not None]
        if sum(constraints) > 1:
            raise InvalidSamplingParams("json_schema", "at most one of json_schema/json_object, regex and "
                                                       "choice may be set")
        if p.tool_calls is not None and (p.regex is not None or p.choice is not None):
            raise InvalidSamplingParams("tool_calls", "tool_calls combine with json_schema or json_object only")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def has_grammar(self) -> bool:
        return (self.json_schema is not None or self.json_object or self.regex is not None or self.choice is not None
                or self.tool_calls is not None)

    @property
    def needs_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0

    def to_json(self) -> dict[str, Any]:
        """Every field, JSON-ready (tuples become lists)."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if isinstance(value, ToolCallConstraint):
                value = value.to_json()
            out[f.name] = [list(v) if isinstance(v, tuple) else v for v in value] if isinstance(value, tuple) else value
        return out

    @classmethod
    def from_json(cls, data: Any) -> SamplingParams:
        """The inverse of `to_json`. Raises InvalidSamplingParams for an unknown field, a wrong type or
        a value out of bounds (missing fields take their defaults)."""
        if not isinstance(data, dict):
            raise InvalidSamplingParams("sampling", "sampling must be an object of SamplingParams fields")
        unknown = sorted(set(data) - _KINDS.keys())
        if unknown:
            raise InvalidSamplingParams(str(unknown[0]), f"unknown sampling field(s) {unknown}")
        return cls(**data)


# ----- field types ------------------------------------------------------------------------------------


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _wrong(name: str, expected: str, value: Any) -> InvalidSamplingParams:
    return InvalidSamplingParams(name, f"{name} must be {expected}, got {type(value).__name__}")


def _int(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int):
        raise _wrong(name, "an integer", value)
    return value


def _optional_int(name: str, value: Any) -> Any:
    return None if value is None else _int(name, value)


def _float(name: str, value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _wrong(name, "a number", value)
    if not math.isfinite(value):
        raise InvalidSamplingParams(name, f"{name} must be a finite number, got {value!r}")
    return value if type(value) is float else float(value)


def _bool(name: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise _wrong(name, "a boolean", value)
    return value


def _optional_str(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, str):
        raise _wrong(name, "a string", value)
    return value


def _strings(name: str, value: Any) -> Any:
    if isinstance(value, str):
        return (value,)
    if value is None and name == "stop":
        return ()
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) for v in value):
        raise _wrong(name, "a list of strings", value)
    return value if isinstance(value, tuple) else tuple(value)


def _optional_strings(name: str, value: Any) -> Any:
    return None if value is None else _strings(name, value)


def _ints(name: str, value: Any) -> Any:
    if not isinstance(value, list | tuple) or any(isinstance(v, bool) or not isinstance(v, int) for v in value):
        raise _wrong(name, "a list of integers", value)
    return value if isinstance(value, tuple) else tuple(value)


def _schema(name: str, value: Any) -> Any:
    if value is not None and not isinstance(value, dict | str):
        raise _wrong(name, "a JSON schema (an object or its JSON text)", value)
    return value


def _tool_calls(name: str, value: Any) -> Any:
    if value is None or isinstance(value, ToolCallConstraint):
        return value
    if isinstance(value, dict):
        return ToolCallConstraint.from_json(value)
    raise _wrong(name, "a ToolCallConstraint", value)


def _logit_bias(name: str, value: Any) -> Any:
    if isinstance(value, dict):
        value = list(value.items())
    if not isinstance(value, list | tuple):
        raise _wrong(name, "a map of token ids to biases", value)
    if len(value) > MAX_LOGIT_BIAS:
        raise InvalidSamplingParams(name, f"{name} may bias at most {MAX_LOGIT_BIAS} tokens, got {len(value)}")
    pairs = []
    for item in value:
        if not isinstance(item, list | tuple) or len(item) != 2:
            raise _wrong(name, "(token id, bias) pairs", value)
        token, bias = item
        if isinstance(token, str) and token.isdigit():
            token = int(token)
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise InvalidSamplingParams(name, f"{name} keys must be token ids >= 0, got {_short(token)}")
        bias = _float(name, bias)
        if not -100.0 <= bias <= 100.0:
            raise InvalidSamplingParams(name, f"{name} values must be in [-100, 100], got {bias!r}")
        pairs.append((token, bias))
    out = tuple(sorted(dict(pairs).items()))
    return value if value == out else out


_CHECKERS = {"int": _int, "int?": _optional_int, "float": _float, "bool": _bool, "str?": _optional_str,
             "strs": _strings, "strs?": _optional_strings, "ints": _ints, "schema": _schema,
             "tools?": _tool_calls, "bias": _logit_bias}
_KINDS: dict[str, str] = {
    "n": "int", "max_tokens": "int", "min_tokens": "int", "temperature": "float", "top_p": "float",
    "top_k": "int", "min_p": "float", "seed": "int?", "repetition_penalty": "float",
    "presence_penalty": "float", "frequency_penalty": "float", "stop": "strs", "stop_token_ids": "ints",
    "ignore_eos": "bool", "logprobs": "int?", "skip_special_tokens": "bool", "include_stop_str_in_output": "bool",
    "json_schema": "schema", "json_object": "bool", "regex": "str?", "choice": "strs?", "tool_calls": "tools?",
    "logit_bias": "bias",
}
assert set(_KINDS) == {f.name for f in fields(SamplingParams)}, "every SamplingParams field has a checked type"
