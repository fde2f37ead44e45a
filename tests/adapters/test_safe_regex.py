"""adapters.safe_regex: PEFT's documented patterns compile; backtracking bombs are refused by name."""

from __future__ import annotations

import pytest

from adapters.errors import AdapterError
from adapters.safe_regex import MAX_PATTERN_CHARS, compile_bounded_regex


@pytest.mark.parametrize(
    "pattern",
    [
        r".*\.(q|v)_proj",
        r"model.layers.0.self_attn.q_proj",
        r".*layers\.\d+\.(self_attn|mlp)\..*",
        r"[qkv]_proj",
        r"(.*\.)?(q_proj)$",
        r"^(?!.*k_proj).*_proj$",
    ],
)
def test_usual_patterns_compile(pattern) -> None:
    assert compile_bounded_regex(pattern, "target_modules").pattern == pattern


@pytest.mark.parametrize(
    "pattern, message",
    [
        (r"(a+)+b", "nests a repetition or alternation inside a repetition"),
        (r"(x|xy)*z", "nests a repetition or alternation inside a repetition"),
        (r"(?:layers\.\d+\.)+q_proj", "nests a repetition or alternation inside a repetition"),
        (r"(?=(a*)*)b", "nests a repetition or alternation inside a repetition"),
        (r".*.*.*.*q", "has more than 3 repetitions"),
        ("[", "is not a valid regex"),
        ("a" * (MAX_PATTERN_CHARS + 1), f"longer than {MAX_PATTERN_CHARS} characters"),
    ],
)
def test_dangerous_or_broken_patterns_are_refused(pattern, message) -> None:
    with pytest.raises(
        AdapterError, match=r"^adapter_config.json: exclude_modules .*" + message.replace("(", r"\(")
    ):
        compile_bounded_regex(pattern, "exclude_modules")


def test_non_string_pattern() -> None:
    with pytest.raises(AdapterError, match="exclude_modules must be a string pattern, got int"):
        compile_bounded_regex(3, "exclude_modules")  # type: ignore[arg-type]
