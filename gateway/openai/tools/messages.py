"""OpenAI chat messages → the messages and tools a chat template reads (transformers' conventions).

- system, user, assistant as they are; developer as system (templates know no developer role);
  content as a string (text parts joined); `name` kept.
- assistant `tool_calls`: `{"id", "type": "function", "function": {"name", "arguments"}}` with the
  arguments as an object (the JSON string parsed: templates `tojson` them); content may be null.
- tool: `{"role": "tool", "content", "tool_call_id", "name"}` (the name of the call it answers, which
  some templates print). Call ids are shown as the format wants them (Mistral's nine characters).

A template that does not render tools gets them described in the system message, earlier calls written
into the assistant's text in the model's call format, and tool results as user turns in
`<tool_response>` tags, so such a model still sees the whole conversation.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.http.errors import invalid_request
from gateway.http.json_body import has_lone_surrogate
from gateway.openai.tools.plan import ToolPlan
from tokenization.tool_formats import ToolCalling, describe_tools


def content_text(content: Any) -> str | None:
    """A message's content as text: a string, or the text parts of a list joined; None stays None."""
    if content is None or isinstance(content, str):
        return content
    return "".join(part.get("text", "") for part in content)


def template_messages(messages: Sequence[Mapping[str, Any]], calling: ToolCalling,
                      plan: ToolPlan | None) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) for the template. `messages` are OpenAI's (dicts with their fields; absent or
    None fields left out). Raises ApiError(400) naming the message field that cannot be rendered."""
    fmt = calling.format
    names: dict[str, str] = {}
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": content_text(m.get("content"))}
        if m.get("name") is not None:
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            calls = []
            for j, call in enumerate(m["tool_calls"]):
                function = call["function"]
                names[call["id"]] = function["name"]
                calls.append({"id": fmt.template_call_id(call["id"]), "type": "function",
                              "function": {"name": function["name"],
                                           "arguments": _arguments(function["arguments"], i, j)}})
            msg["tool_calls"] = calls
        elif role == "tool":
            if not m.get("tool_call_id"):
                raise invalid_request(f"messages[{i}].tool_call_id is required for a tool message.",
                                      param=f"messages[{i}].tool_call_id", code="missing_required_parameter")
            msg["tool_call_id"] = fmt.template_call_id(m["tool_call_id"])
            if "name" not in msg and m["tool_call_id"] in names:
                msg["name"] = names[m["tool_call_id"]]
            if msg["content"] is None:
                msg["content"] = ""
        elif msg["content"] is None:
            raise invalid_request(f"messages[{i}].content must be set for a {m['role']} message.",
                                  param=f"messages[{i}].content", code="missing_required_parameter")
        out.append(msg)
    tools = [t.template_json() for t in plan.tools] if plan is not None else None
    if calling.template_renders_tools:
        return out, tools
    return _without_tool_markup(out, calling, tools), None


def _arguments(text: Any, i: int, j: int) -> Any:
    param = f"messages[{i}].tool_calls[{j}].function.arguments"
    try:
        value = json.loads(text)
    except (TypeError, ValueError, RecursionError):
        raise invalid_request(f"Invalid '{param}': the arguments must be a JSON string.", param=param,
                              code="invalid_value") from None
    if has_lone_surrogate(value):  # "\ud800" inside the arguments' own JSON: no character, nothing to render
        raise invalid_request(f"Invalid '{param}': the arguments hold a lone UTF-16 surrogate.", param=param,
                              code="invalid_unicode")
    return value


def _without_tool_markup(messages: list[dict[str, Any]], calling: ToolCalling,
                         tools: list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """The conversation for a template without tool markup: tools in the system message, calls and
    results as text."""
    fmt = calling.format
    out: list[dict[str, Any]] = []
    for msg in messages:
        if "tool_calls" in msg:
            calls = fmt.render_calls([(c["function"]["name"], json.dumps(c["function"]["arguments"], ensure_ascii=False))
                                      for c in msg["tool_calls"]])
            text = ((msg["content"] or "") + "\n" + calls).lstrip("\n")
            out.append({"role": "assistant", "content": text})
        elif msg["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{msg['content']}\n</tool_response>"})
        else:
            out.append(msg)
    if tools:
        description = describe_tools(fmt, tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": (out[0]["content"] or "") + "\n\n" + description}
        else:
            out.insert(0, {"role": "system", "content": description})
    return out
