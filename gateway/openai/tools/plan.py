"""A request's tools and tool_choice, checked once: what the template shows and what the grammar allows.

OpenAI's rules, each refused with a 400 naming its param: function names of 1-64 letters, digits, "_"
and "-", unique; `parameters` a JSON schema object whose type (if given) is "object"; `tool_choice` one
of none, auto, required or {"type": "function", "function": {"name": ...}} naming a listed tool, and
only with tools. Whether a schema can be enforced is the grammar's to say (the worker refuses it with
the same param). tool_choice defaults to "auto" with tools, "none" without; parallel_tool_calls to true.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from gateway.http.errors import ApiError, invalid_request

ToolMode = Literal["none", "auto", "required"]
_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
MAX_TOOLS = 128


@dataclass(frozen=True)
class ToolDef:
    name: str
    parameters: dict  # a JSON schema of an object
    description: str | None = None
    strict: bool | None = None

    def template_json(self) -> dict[str, Any]:
        """The tool as chat templates read it (OpenAI's shape)."""
        function: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(frozen=True)
class ToolPlan:
    """tools: every tool of the request (the template shows them all). mode: none (no calls), auto (text
    or calls) or required (calls only). allowed: the tools a call may name (a named tool_choice: one).
    parallel: more than one call allowed."""

    tools: tuple[ToolDef, ...]
    mode: ToolMode
    allowed: tuple[ToolDef, ...]
    parallel: bool

    @property
    def constrains(self) -> bool:
        return self.mode != "none"


def plan_tools(tools: Sequence[Mapping[str, Any]] | None, tool_choice: Any,
               parallel_tool_calls: bool | None) -> ToolPlan | None:
    """The request's ToolPlan, or None for a request without tools. Raises ApiError(400)."""
    if not tools:
        if tool_choice is not None and tool_choice != "none":
            raise invalid_request("tool_choice is only allowed when tools are specified.", param="tool_choice")
        if tools is not None:
            raise invalid_request("tools must hold at least one tool when given.", param="tools")
        return None
    if len(tools) > MAX_TOOLS:
        raise invalid_request(f"At most {MAX_TOOLS} tools are allowed, got {len(tools)}.", param="tools")
    defs = tuple(_tool(i, t) for i, t in enumerate(tools))
    seen: dict[str, int] = {}
    for i, d in enumerate(defs):
        if d.name in seen:
            raise invalid_request(f"Tool names must be unique: '{d.name}' is both tools[{seen[d.name]}] and "
                                  f"tools[{i}].", param=f"tools[{i}].function.name", code="invalid_value")
        seen[d.name] = i
    mode, allowed = _choice(tool_choice, defs)
    return ToolPlan(defs, mode, allowed, True if parallel_tool_calls is None else parallel_tool_calls)


def _tool(i: int, tool: Mapping[str, Any]) -> ToolDef:
    function = tool.get("function")
    if tool.get("type") != "function" or not isinstance(function, Mapping):
        raise invalid_request(f"tools[{i}] must be {{\"type\": \"function\", \"function\": {{...}}}}.",
                              param=f"tools[{i}]", code="invalid_type")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise invalid_request(f"Invalid 'tools[{i}].function.name': {name!r} must be 1-64 letters, digits, "
                              "underscores or dashes.", param=f"tools[{i}].function.name", code="invalid_value")
    parameters = function.get("parameters")
    param = f"tools[{i}].function.parameters"
    if parameters is None:
        parameters = {"type": "object", "properties": {}}
    if not isinstance(parameters, Mapping) or parameters.get("type", "object") != "object":
        raise invalid_request(f"Invalid '{param}': the parameters of a function must be a JSON schema of an "
                              "object.", param=param, code="invalid_value")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise invalid_request(f"Invalid type for 'tools[{i}].function.description': expected a string.",
                              param=f"tools[{i}].function.description", code="invalid_type")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise invalid_request(f"Invalid type for 'tools[{i}].function.strict': expected a boolean.",
                              param=f"tools[{i}].function.strict", code="invalid_type")
    return ToolDef(name, dict(parameters), description, strict)


def _choice(tool_choice: Any, defs: tuple[ToolDef, ...]) -> tuple[ToolMode, tuple[ToolDef, ...]]:
    if tool_choice is None or tool_choice == "auto":
        return "auto", defs
    if tool_choice == "none":
        return "none", ()
    if tool_choice == "required":
        return "required", defs
    if isinstance(tool_choice, Mapping) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, Mapping) else None
        named = [d for d in defs if d.name == name]
        if not named:
            raise _bad_choice(f"tool_choice names the function {name!r}, which is not among the tools.")
        return "required", (named[0],)
    raise _bad_choice("tool_choice must be 'none', 'auto', 'required' or "
                      "{\"type\": \"function\", \"function\": {\"name\": ...}}.")


def _bad_choice(message: str) -> ApiError:
    return invalid_request(message, param="tool_choice", code="invalid_value")
