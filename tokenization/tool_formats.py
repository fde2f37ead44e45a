"""How a model family writes tool calls, and which family a chat template belongs to.

A `ToolCallFormat` is the text around the calls: what opens them in free text (`trigger`), the
canonical text before the first call, between two calls and after the last one, and the JSON of one
call (`{"name": ..., "<arguments_key>": {...}}`). The same description drives the grammar that
constrains calls (grammar/tool_calls.py), the parser that reads them back (tokenization/tool_parser.py)
and the rendering of calls into a prompt for a template that has no tool markup of its own.

Formats (vLLM's parser names):
- hermes: Hermes 2 Pro, Qwen2.5, Qwen3 — `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`,
  one block per call, text before them allowed.
- llama3_json: Llama 3.1-3.3 — `{"name": ..., "parameters": {...}}` as the whole answer (calls joined by
  "; "), or after `<|python_tag|>`.
- mistral: Mistral v0.3, Nemo, Small — `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`; call ids
  in the prompt must be nine alphanumeric characters.

`detect_tool_format` reads the template's markup; a template with none of them gets `DEFAULT_FORMAT`
(hermes), and one that does not render tools at all gets the tools described in a system message
(`describe_tools`), with a warning at start-up.
"""

from __future__ import annotations

import hashlib
import json
import logging
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ToolCallFormat:
    """The text of a family's tool calls. Whitespace in `open`/`separator`/`close` is canonical (what the
    grammar writes); the parser accepts any whitespace between their other characters' runs."""

    name: str
    trigger: str  # opens calls in free text; a special token or plain text
    open: str  # canonical text before the first call
    separator: str  # between two calls
    close: str  # after the last call
    arguments_key: str = "arguments"
    calls_at_start: bool = False  # the answer may also open with a call's "{" and no trigger
    call_id_length: int | None = None  # ids a template insists on (Mistral: 9 alphanumerics)

    def __post_init__(self) -> None:
        if not self.trigger or (self.open and not self.open.startswith(self.trigger)):
            raise ValueError(f"tool format {self.name}: open must start with the trigger")

    @property
    def open_atoms(self) -> tuple[str, ...]:
        return tuple(self.open.split())

    @property
    def separator_atoms(self) -> tuple[str, ...]:
        return tuple(self.separator.split())

    @property
    def close_atoms(self) -> tuple[str, ...]:
        return tuple(self.close.split())

    def call_prefix(self, name: str) -> str:
        """The canonical text of a call up to its arguments: `{"name": "NAME", "arguments": `."""
        return '{"name": ' + json.dumps(name, ensure_ascii=False) + ', "' + self.arguments_key + '": '

    def render_calls(self, calls: Sequence[tuple[str, str]]) -> str:
        """(name, arguments JSON text) calls as the model writes them."""
        body = self.separator.join(self.call_prefix(name) + arguments + "}" for name, arguments in calls)
        return (self.open or "") + body + self.close

    def template_call_id(self, call_id: str) -> str:
        """The id a template is shown for `call_id` (unchanged unless the family insists on a length)."""
        n = self.call_id_length
        if n is None:
            return call_id
        alnum = "".join(ch for ch in call_id if ch in _ALNUM)
        if len(alnum) >= n:
            return alnum[-n:]
        digest = int.from_bytes(hashlib.sha256(call_id.encode()).digest()[:8], "big")
        out = ""
        for _ in range(n):
            digest, r = divmod(digest, len(_ALNUM))
            out += _ALNUM[r]
        return out


_ALNUM = string.ascii_letters + string.digits

FORMATS: dict[str, ToolCallFormat] = {
    "hermes": ToolCallFormat("hermes", trigger="<tool_call>", open="<tool_call>\n",
                             separator="\n</tool_call>\n<tool_call>\n", close="\n</tool_call>"),
    "llama3_json": ToolCallFormat("llama3_json", trigger="<|python_tag|>", open="", separator="; ", close="",
                                  arguments_key="parameters", calls_at_start=True),
    "mistral": ToolCallFormat("mistral", trigger="[TOOL_CALLS]", open="[TOOL_CALLS] [", separator=", ", close="]",
                              call_id_length=9),
}
DEFAULT_FORMAT = "hermes"


def tool_format(name: str) -> ToolCallFormat:
    """The format called `name`. Raises ValueError listing the known ones."""
    try:
        return FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {sorted(FORMATS)}") from None


@dataclass(frozen=True)
class ToolCalling:
    """How one served model does tools: its format, and whether its template shows tools to the model
    (when not, `describe_tools` writes them into the system message)."""

    format: ToolCallFormat
    template_renders_tools: bool
    detected: bool  # the format came from the template (not the default, nor an operator's choice)


def detect_tool_format(template_text: str) -> ToolCallFormat | None:
    """The family whose markup the template's literal text holds, or None."""
    if "[TOOL_CALLS]" in template_text:
        return FORMATS["mistral"]
    if "<tool_call>" in template_text:
        return FORMATS["hermes"]
    if "<|python_tag|>" in template_text or ('"parameters"' in template_text and "<|start_header_id|>" in template_text):
        return FORMATS["llama3_json"]
    return None


def resolve_tool_calling(template_text: str | None, renders_tools: bool, override: str | None = None) -> ToolCalling:
    """The served model's tool calling: the operator's `--tool-call-parser` if given, else the format the
    template's markup shows, else the default (with a warning). Raises ValueError for an unknown name."""
    if override is not None:
        fmt, detected = tool_format(override), False
    else:
        found = detect_tool_format(template_text or "")
        fmt, detected = (found, True) if found is not None else (FORMATS[DEFAULT_FORMAT], False)
        if found is None and renders_tools:
            log.warning("the chat template renders tools in no known call format; tool calls use %s "
                        "(choose another with --tool-call-parser)", DEFAULT_FORMAT)
    if not renders_tools:
        log.warning("the chat template does not render tools; requests with tools get them described in "
                    "the system message and calls in the %s format", fmt.name)
    return ToolCalling(fmt, renders_tools, detected)


def describe_tools(fmt: ToolCallFormat, tools: Sequence[Mapping[str, Any]]) -> str:
    """A system-message text that shows `tools` and the call format (for templates without tool markup)."""
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    example = fmt.render_calls([("<function-name>", "<args-json-object>")]).replace('"<function-name>"',
                                                                                      "<function-name>")
    return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
            f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
            "</tools>\n\nFor each function call, return a json object with the function name and arguments "
            f"like this:\n{example}")
