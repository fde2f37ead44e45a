"""`loraplex serve`'s chat flags: --chat-template (LORAPLEX_CHAT_TEMPLATE), --tool-call-parser
(LORAPLEX_TOOL_CALL_PARSER) and --allow-special-tokens-in-content, the flag winning over the variable."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.cli.main import build_parser
from gateway.state import GatewayConfig


def test_chat_flags_read_the_environment_and_flags_win(tmp_path):
    env = {"LORAPLEX_CHAT_TEMPLATE": "/t/chat.jinja", "LORAPLEX_TOOL_CALL_PARSER": "mistral",
           "LORAPLEX_ALLOW_SPECIAL_TOKENS_IN_CONTENT": "1"}
    args = build_parser(env).parse_args(["serve"])
    assert (args.chat_template, args.tool_call_parser, args.allow_special_tokens_in_content) == (
        Path("/t/chat.jinja"), "mistral", True)
    args = build_parser(env).parse_args(["serve", "--chat-template", "mine.jinja", "--tool-call-parser", "hermes"])
    assert (args.chat_template, args.tool_call_parser) == (Path("mine.jinja"), "hermes")
    plain = build_parser({}).parse_args(["serve"])
    assert (plain.chat_template, plain.tool_call_parser, plain.allow_special_tokens_in_content) == (None, None, False)
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--tool-call-parser", "functionary"])


def test_the_gateway_config_refuses_an_unknown_parser(tmp_path):
    with pytest.raises(ValueError, match="unknown tool call parser"):
        GatewayConfig(served_model_name="m", adapter_root=tmp_path, tool_call_parser="nope")
    assert GatewayConfig(served_model_name="m", adapter_root=tmp_path, tool_call_parser="llama3_json")
