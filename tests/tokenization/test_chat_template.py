"""Chat templates found where checkpoints keep them, rendered with the variables real templates use."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from demo.chat_styles import write_template
from tokenization.chat_template import ChatTemplate, ChatTemplateError, TemplateSource, find_chat_template
from tokenization.tokenizer import Tokenizer

SIMPLE = "{{ bos_token }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}"
TOOLS = "TOOLS {{ tools | map(attribute='function.name') | join(',') }} {{ messages[0].content }}"
USER = [{"role": "user", "content": "hi"}]


def _model_without_template(src: Path, out: Path) -> tuple[Path, dict]:
    out.mkdir(parents=True, exist_ok=True)
    shutil.copy(src / "tokenizer.json", out / "tokenizer.json")
    config = json.loads((src / "tokenizer_config.json").read_text())
    config.pop("chat_template")
    return out, config


@pytest.mark.parametrize("layout", ["tokenizer_config", "named", "jinja", "json"])
def test_each_layout_is_found(tokenizer_dirs, tmp_path, layout):
    out, config = _model_without_template(tokenizer_dirs["byte_bpe"], tmp_path / layout)
    write_template(out, config, SIMPLE, layout)
    tok = Tokenizer(out)
    assert tok.render_chat(USER) == "<|begin_of_text|>[user] hi\n"


def test_a_transformers_5_save_pretrained_checkpoint(tokenizer_dirs, tmp_path):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_file=str(tokenizer_dirs["byte_bpe"] / "tokenizer.json"),
                                 bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    hf.chat_template = SIMPLE
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert Tokenizer(tmp_path).render_chat(USER) == hf.apply_chat_template(USER, tokenize=False)


def test_precedence_is_jinja_then_json_then_config(tokenizer_dirs, tmp_path):
    out, config = _model_without_template(tokenizer_dirs["byte_bpe"], tmp_path)
    config["chat_template"] = "config"
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    assert find_chat_template(out).default == "config"
    (out / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert find_chat_template(out).default == "json"
    (out / "chat_template.jinja").write_text("jinja")
    assert find_chat_template(out).default == "jinja"
    override = tmp_path / "mine.jinja"
    override.write_text("override {{ messages[0].content }}")
    assert Tokenizer(out, chat_template=override).render_chat(USER) == "override hi"
    with pytest.raises(ChatTemplateError, match="cannot read"):
        Tokenizer(out, chat_template=tmp_path / "missing.jinja")


def test_named_templates_pick_tool_use_for_requests_with_tools(tokenizer_dirs, tmp_path):
    out, config = _model_without_template(tokenizer_dirs["byte_bpe"], tmp_path)
    config["chat_template"] = [{"name": "default", "template": SIMPLE}, {"name": "tool_use", "template": TOOLS}]
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer(out)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    assert tok.render_chat(USER) == "<|begin_of_text|>[user] hi\n"
    assert tok.render_chat(USER, tools=tools) == "TOOLS f hi"
    # transformers 5 keeps named extras in additional_chat_templates/
    (out / "chat_template.jinja").write_text(SIMPLE)
    (out / "additional_chat_templates").mkdir()
    (out / "additional_chat_templates" / "tool_use.jinja").write_text(TOOLS)
    assert Tokenizer(out).render_chat(USER, tools=tools) == "TOOLS f hi"


def test_template_variables_and_kwargs():
    text = ("{{ bos_token }}|{{ eos_token }}|{{ add_generation_prompt }}|{{ strftime_now('%Y') | length }}|"
            "{{ enable_thinking }}|{{ messages[0] | tojson }}{% for i in range(3) %}{% if i == 1 %}{% break %}"
            "{% endif %}{{ i }}{% endfor %}{% generation %}G{% endgeneration %}")
    template = ChatTemplate(TemplateSource(text, "test"), "<s>", "</s>")
    out = template.render([{"role": "user", "content": "é<x>"}], add_generation_prompt=False,
                          kwargs={"enable_thinking": False})
    assert out == '<s>|</s>|False|4|False|{"role": "user", "content": "é<x>"}0G'
    with pytest.raises(ChatTemplateError, match="may not set 'messages'"):
        template.render(USER, kwargs={"messages": []})


@pytest.mark.parametrize(("text", "message"), [
    ("{{ raise_exception('only user turns') }}", "only user turns"),
    ("{{ ''.__class__.__mro__[1].__subclasses__() }}", "chat template error"),
    ("{{ messages[0].content + 1 }}", "TypeError"),
    ("{{ messages[5]['content'].strip() }}", "chat template error"),
])
def test_template_failures_are_chat_template_errors(text, message):
    template = ChatTemplate(TemplateSource(text, "test"))
    with pytest.raises(ChatTemplateError, match=message):
        template.render(USER)


def test_a_broken_checkpoint_template_refuses_chat_but_loads(tokenizer_dirs, tmp_path):
    out, config = _model_without_template(tokenizer_dirs["byte_bpe"], tmp_path)
    write_template(out, config, "{% for m in messages %}", "jinja")
    tok = Tokenizer(out)
    assert tok.encode("hello")
    with pytest.raises(ChatTemplateError, match="does not compile"):
        tok.render_chat(USER)
    with pytest.raises(ChatTemplateError, match="does not compile"):
        Tokenizer(out, chat_template=out / "chat_template.jinja")
    (out / "chat_template.jinja").unlink()
    with pytest.raises(ChatTemplateError, match="no chat template"):
        Tokenizer(out).render_chat(USER)


@pytest.mark.parametrize("style", ["llama3.1", "qwen2.5", "mistral"])
def test_styles_render_tools_and_a_tool_result_turn(styled_tokenizer_dirs, style):
    tok = Tokenizer(styled_tokenizer_dirs[("byte_bpe", style)])
    assert tok.chat_template is not None and tok.chat_template.renders_tools()
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
                                               "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}]
    messages = [{"role": "user", "content": "weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "abcdefghi", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "tool_call_id": "abcdefghi", "content": "sunny"}]
    text = tok.render_chat(messages, tools=tools)
    assert "get_weather" in text and "Weather now" in text and "sunny" in text and '"city": "Paris"' in text
