"""Checkpoints in each chat-template layout serve chat through the official openai client, streamed and not.

One engine, one gateway per layout (only the gateway renders templates): a model saved by transformers 5's
`save_pretrained` (chat_template.jinja), one with chat_template.json, one with tokenizer_config.json's named
list, and one whose template is replaced by `--chat-template FILE`. The same template in every layout gives
the same prompt and, greedily, the same answer.
"""

from __future__ import annotations

import json
import shutil

import openai
import pytest

from demo.chat_styles import QWEN25_TEMPLATE, write_template
from demo.checkpoint import make_checkpoint
from engine.async_llm import AsyncLLM
from engine.config import EngineConfig
from tests.gateway.chat_stack import MODEL, ChatStack

LAYOUTS = ("save_pretrained", "json", "named", "override")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the cache"}]


@pytest.fixture(scope="module")
def layout_stacks(styled_tokenizer_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("layouts")
    styled = styled_tokenizer_dirs[("byte_bpe", "qwen2.5")]
    model = make_checkpoint(root / "model", "llama", tokenizer_dir=styled)
    llm = AsyncLLM.from_config(EngineConfig(model=str(model), num_kv_blocks=256, block_size=16, max_num_seqs=16))
    stacks = {}
    for layout in LAYOUTS:
        d = root / layout
        d.mkdir()
        config = json.loads((styled / "tokenizer_config.json").read_text())
        config.pop("chat_template")
        if layout == "save_pretrained":
            from transformers import PreTrainedTokenizerFast

            hf = PreTrainedTokenizerFast(tokenizer_file=str(styled / "tokenizer.json"), eos_token="<|im_end|>")
            hf.chat_template = QWEN25_TEMPLATE
            hf.save_pretrained(d)
            assert (d / "chat_template.jinja").is_file()
            stacks[layout] = ChatStack.start(d, root / f"data-{layout}", llm=llm)
            continue
        shutil.copy(styled / "tokenizer.json", d / "tokenizer.json")
        if layout == "override":
            write_template(d, config, "{{ messages[0]['content'] }}", "tokenizer_config")  # replaced below
            override = root / "qwen.jinja"
            override.write_text(QWEN25_TEMPLATE)
            stacks[layout] = ChatStack.start(d, root / f"data-{layout}", llm=llm, chat_template=override)
        else:
            write_template(d, config, QWEN25_TEMPLATE, layout)
            stacks[layout] = ChatStack.start(d, root / f"data-{layout}", llm=llm)
    yield stacks
    for stack in stacks.values():
        stack.stop()
    llm.shutdown()


def test_every_layout_serves_the_same_chat(layout_stacks):
    answers = {}
    for layout, stack in layout_stacks.items():
        client = stack.client()
        kwargs = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
        whole = client.chat.completions.create(**kwargs)
        chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert streamed == whole.choices[0].message.content, layout
        answers[layout] = (whole.usage.prompt_tokens, whole.choices[0].message.content, chunks[-1].usage.prompt_tokens)
    assert len(set(answers.values())) == 1, answers


def test_every_layout_renders_tools(layout_stacks):
    tools = [{"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"enum": [1, 2]}}, "required": ["n"], "additionalProperties": False}}}]
    for layout, stack in layout_stacks.items():
        resp = stack.client().chat.completions.create(model=MODEL, messages=MESSAGES, tools=tools, seed=0,
                                                      tool_choice="required", parallel_tool_calls=False, max_tokens=60)
        call = resp.choices[0].message.tool_calls[0]
        assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "ping", layout
        assert json.loads(call.function.arguments)["n"] in (1, 2)


def test_chat_template_kwargs_reach_the_template(layout_stacks):
    client = layout_stacks["save_pretrained"].client()
    base = dict(model=MODEL, messages=MESSAGES, max_tokens=1, temperature=0)
    plain = client.chat.completions.create(**base)
    thinking_off = client.chat.completions.create(**base, extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert thinking_off.usage.prompt_tokens > plain.usage.prompt_tokens  # the empty <think></think> block
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(**base, extra_body={"chat_template_kwargs": {"messages": []}})
    assert info.value.body["param"] == "chat_template_kwargs"
