"""Chat templates in the style of real checkpoints', tool rendering included, for the tiny test models.

Each style is what a family's template does with messages and tools, written for the demo
tokenizers: the Llama 3.1 template (tools as JSON in the first user turn, calls as
`{"name": ..., "parameters": ...}`, results in an `ipython` turn), Qwen2.5's ChatML with Hermes tool
calls (`<tool_call>` blocks, Qwen3's `enable_thinking`), and Mistral v0.3's (`[AVAILABLE_TOOLS]`,
`[TOOL_CALLS] [...]`, `[TOOL_RESULTS]`, nine-character call ids). `with_chat_style` copies a trained
tokenizer and adds the style's markup tokens (special, or plain added tokens like Qwen's `<tool_call>`)
and its template, BOS and EOS, without retraining: the rest of the vocabulary keeps its ids.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

TemplateLayout = Literal["tokenizer_config", "jinja", "json", "named"]

LLAMA31_TEMPLATE = """{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\\n\\n" }}
{%- if tools is not none %}{{- "Environment: ipython\\n" }}{%- endif %}
{{- "Cutting Knowledge Date: December 2023\\n" }}
{{- "Today Date: " + date_string + "\\n\\n" }}
{{- system_message }}
{{- "<|eot_id|>" }}
{%- if tools is not none %}
    {%- if messages | length == 0 %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
    {%- endif %}
    {%- set first_user_message = messages[0]['content'] | trim %}
    {%- set messages = messages[1:] %}
    {{- '<|start_header_id|>user<|end_header_id|>\\n\\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\\n\\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\\n\\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\\n\\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}
{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls | length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}
        {{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson + '}' }}
        {{- "<|eot_id|>" }}
    {%- else %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\\n\\n" }}
        {%- if message.content is mapping %}{{- message.content | tojson }}{%- else %}{{- message.content }}{%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}
{%- endif %}
"""

QWEN25_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n" }}
    {{- "You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within " }}
    {{- '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0]['role'] == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
{%- else %}
    {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' + tool_call.arguments | tojson + '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.index0 == 0 or messages[loop.index0 - 1].role != "tool" %}{{- '<|im_start|>user' }}{%- endif %}
        {{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != "tool" %}{{- '<|im_end|>\\n' }}{%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""

MISTRAL_TEMPLATE = """{%- if messages[0]["role"] == "system" %}
    {%- set system_message = messages[0]["content"] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set user_messages = loop_messages | selectattr("role", "equalto", "user") | list %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if message["role"] == "user" %}
        {%- if tools is not none and message == user_messages[-1] %}
            {{- "[AVAILABLE_TOOLS] [" }}
            {%- for tool in tools %}
                {{- '{"type": "function", "function": ' + tool.function | tojson + '}' }}
                {%- if not loop.last %}{{- ", " }}{%- endif %}
            {%- endfor %}
            {{- "][/AVAILABLE_TOOLS]" }}
        {%- endif %}
        {%- if loop.last and system_message is defined %}
            {{- "[INST] " + system_message + "\\n\\n" + message["content"] + "[/INST]" }}
        {%- else %}
            {{- "[INST] " + message["content"] + "[/INST]" }}
        {%- endif %}
    {%- elif message.tool_calls is defined and message.tool_calls is not none %}
        {{- "[TOOL_CALLS] [" }}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.id is not defined or tool_call.id | length != 9 %}
                {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
            {%- endif %}
            {%- set out = tool_call.function | tojson %}
            {{- out[:-1] + ', "id": "' + tool_call.id + '"}' }}
            {%- if not loop.last %}{{- ", " }}{%- else %}{{- "]" + eos_token }}{%- endif %}
        {%- endfor %}
    {%- elif message["role"] == "assistant" %}
        {{- " " + message["content"] | trim + eos_token }}
    {%- elif message["role"] == "tool" %}
        {%- if message.tool_call_id is not defined or message.tool_call_id | length != 9 %}
            {{- raise_exception("Tool call IDs should be alphanumeric strings with length 9!") }}
        {%- endif %}
        {{- '[TOOL_RESULTS] {"content": ' + message.content | tojson + ', "call_id": "' + message.tool_call_id + '"}[/TOOL_RESULTS]' }}
    {%- else %}
        {{- raise_exception("Only user, assistant and tool roles are supported, with an optional first system message!") }}
    {%- endif %}
{%- endfor %}
"""


@dataclass(frozen=True)
class ChatStyle:
    template: str
    special_tokens: tuple[str, ...] = ()  # added as special tokens (control tokens, no text when skipped)
    text_tokens: tuple[str, ...] = ()  # added as ordinary added tokens (Qwen's <tool_call>)
    bos_token: str | None = "<|begin_of_text|>"
    eos_token: str = "<|eot_id|>"


CHAT_STYLES: dict[str, ChatStyle] = {
    "llama3.1": ChatStyle(LLAMA31_TEMPLATE, special_tokens=("<|python_tag|>", "<|eom_id|>")),
    "qwen2.5": ChatStyle(QWEN25_TEMPLATE, special_tokens=("<|im_start|>", "<|im_end|>"),
                         text_tokens=("<tool_call>", "</tool_call>"), bos_token=None, eos_token="<|im_end|>"),
    "mistral": ChatStyle(MISTRAL_TEMPLATE, special_tokens=(
        "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
        "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), bos_token="<s>", eos_token="</s>"),
}


def with_chat_style(tokenizer_dir: str | Path, out_dir: str | Path, style: str,
                    layout: TemplateLayout = "tokenizer_config") -> Path:
    """Copy the tokenizer in `tokenizer_dir` to `out_dir` with `style`'s tokens, template, BOS and EOS.

    layout: where the template goes, as checkpoints of different ages keep it: "tokenizer_config" (a
    string in tokenizer_config.json), "jinja" (chat_template.jinja, what transformers 5 writes), "json"
    (chat_template.json) or "named" (tokenizer_config.json's list of {name, template}).
    """
    from tokenizers import AddedToken, Tokenizer

    chat = CHAT_STYLES[style]
    src, out = Path(tokenizer_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer.from_file(str(src / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chat.special_tokens])
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in chat.text_tokens])
    tok.save(str(out / "tokenizer.json"))
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.update(bos_token=chat.bos_token, eos_token=chat.eos_token)
    config.pop("chat_template", None)
    write_template(out, config, chat.template, layout)
    return out


def write_template(out: Path, config: dict, template: str, layout: TemplateLayout) -> None:
    """Write tokenizer_config.json (`config`) with `template` kept the way `layout` says."""
    if layout == "tokenizer_config":
        config["chat_template"] = template
    elif layout == "named":
        config["chat_template"] = [{"name": "default", "template": template}]
    elif layout == "jinja":
        (out / "chat_template.jinja").write_text(template)
    elif layout == "json":
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2))
    else:
        raise ValueError(f"unknown template layout {layout!r}")
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
