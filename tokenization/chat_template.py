"""Chat templates as checkpoints ship them, rendered in a sandboxed Jinja environment.

Where a template comes from (the first found wins, as in transformers): an operator's override file
(`--chat-template FILE`), `chat_template.jinja` beside the tokenizer (what transformers 5's
`save_pretrained` writes; named extras in `additional_chat_templates/NAME.jinja`), `chat_template.json`
(`{"chat_template": ...}`, the processor layout), then `chat_template` in `tokenizer_config.json`, a
string or a list of `{"name", "template"}`. With named templates, "tool_use" renders requests that carry
tools and "default" the others, as transformers picks them.

Templates see what real ones use: `messages`, `tools`, `add_generation_prompt`, `bos_token`,
`eos_token`, `raise_exception`, `strftime_now`, the `tojson` filter with transformers' signature, the
`loopcontrols` extension and a `{% generation %}` block (rendered as its body), plus the request's
`chat_template_kwargs`. Every failure, from a syntax error to a type error inside the template, is a
`ChatTemplateError` naming the template's own message.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

log = logging.getLogger(__name__)

CHAT_TEMPLATE_JINJA = "chat_template.jinja"
CHAT_TEMPLATE_JSON = "chat_template.json"
NAMED_TEMPLATES_DIR = "additional_chat_templates"
TOOL_USE_TEMPLATE = "tool_use"

# Names the renderer sets; chat_template_kwargs may not replace them.
RESERVED_VARIABLES = frozenset({"messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "raise_exception", "strftime_now"})


class ChatTemplateError(ValueError):
    """A template that cannot be loaded or rendered; the message is safe to show the caller."""


@dataclass(frozen=True)
class TemplateSource:
    """A checkpoint's chat template text: the default one and any named ones ("tool_use", ...)."""

    default: str
    origin: str  # the file it came from (for logs)
    named: Mapping[str, str] = field(default_factory=dict)

    def for_request(self, has_tools: bool) -> str:
        if has_tools and TOOL_USE_TEMPLATE in self.named:
            return self.named[TOOL_USE_TEMPLATE]
        return self.default


def find_chat_template(model_dir: str | Path, override: str | Path | None = None) -> TemplateSource | None:
    """The template of `model_dir` (or the `override` file), in transformers' order; None if it has none.

    Raises ChatTemplateError for an override that cannot be read or a file that is not what its
    name says (a chat_template.json without a "chat_template" string, say).
    """
    if override is not None:
        path = Path(override)
        try:
            return TemplateSource(path.read_text(encoding="utf-8"), str(path))
        except OSError as e:
            raise ChatTemplateError(f"cannot read the chat template {path}: {e.strerror}") from None
    directory = Path(model_dir)
    jinja_file = directory / CHAT_TEMPLATE_JINJA
    if jinja_file.is_file():
        named = {p.stem: p.read_text(encoding="utf-8") for p in sorted((directory / NAMED_TEMPLATES_DIR).glob("*.jinja"))}
        return TemplateSource(jinja_file.read_text(encoding="utf-8"), str(jinja_file), named)
    json_file = directory / CHAT_TEMPLATE_JSON
    if json_file.is_file():
        return _from_config_value(_read_json(json_file).get("chat_template"), json_file)
    config_file = directory / "tokenizer_config.json"
    if config_file.is_file():
        value = _read_json(config_file).get("chat_template")
        return None if value is None else _from_config_value(value, config_file)
    return None


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise ChatTemplateError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(data, dict):
        raise ChatTemplateError(f"{path} must hold a JSON object")
    return data


def _from_config_value(value: Any, origin: Path) -> TemplateSource:
    """`chat_template` as configs hold it: a string, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return TemplateSource(value, str(origin))
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        named = {t["name"]: t["template"] for t in value}
        default = named.get("default", next(iter(named.values())))
        return TemplateSource(default, str(origin), {k: v for k, v in named.items() if k != "default"})
    raise ChatTemplateError(f"{origin}: chat_template must be a string or a list of {{name, template}} objects")


class _GenerationBlock(Extension):
    """`{% generation %}...{% endgeneration %}` (transformers marks assistant text with it): the body."""

    tags = {"generation"}

    def parse(self, parser):  # type: ignore[no-untyped-def]
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson`: json.dumps without HTML escaping (Jinja's own escapes < > &)."""
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise TemplateError(message)


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols, _GenerationBlock])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


class ChatTemplate:
    """One checkpoint's compiled template(s). Thread-safe: rendering mutates nothing."""

    def __init__(self, source: TemplateSource, bos_token: str | None = None, eos_token: str | None = None) -> None:
        self.source = source
        self.bos_token = bos_token or ""
        self.eos_token = eos_token or ""
        self._env = _environment()
        self._compiled = {text: self._compile(text) for text in {source.default, *source.named.values()}}

    def _compile(self, text: str) -> Any:
        try:
            return self._env.from_string(text)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template ({self.source.origin}) does not compile: {e}") from None

    def render(self, messages: list[dict[str, Any]], *, tools: list[dict[str, Any]] | None = None,
               add_generation_prompt: bool = True, kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text. Raises ChatTemplateError with the template's message (a `raise_exception`
        call, an undefined variable used wrongly, a type error) or for a reserved name in `kwargs`."""
        extra = dict(kwargs or {})
        clash = sorted(RESERVED_VARIABLES & extra.keys())
        if clash:
            raise ChatTemplateError(f"chat_template_kwargs may not set {clash[0]!r}")
        template = self._compiled[self.source.for_request(bool(tools))]
        try:
            return template.render(**extra, messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                                   bos_token=self.bos_token, eos_token=self.eos_token)
        except TemplateError as e:
            raise ChatTemplateError(f"chat template error: {e.message or type(e).__name__}") from None
        except (TypeError, ValueError, AttributeError, KeyError, IndexError, ArithmeticError, RecursionError) as e:
            raise ChatTemplateError(f"chat template error: {type(e).__name__}: {e}") from None

    def literal_text(self) -> str:
        """Every string the templates hold themselves (their text and string constants), joined: an added
        token that appears here is markup of the template."""
        pieces: list[str] = []
        for text in self._compiled:
            tree = self._env.parse(text)
            pieces += [n.data for n in tree.find_all(nodes.TemplateData)]
            pieces += [n.value for n in tree.find_all(nodes.Const) if isinstance(n.value, str)]
        return "\n".join(pieces)

    def renders_tools(self) -> bool:
        """Whether the template shows a request's tools to the model (a probe tool's name comes out)."""
        probe = "loraplex_probe_tool_7f3a"
        tools = [{"type": "function", "function": {"name": probe, "description": "probe",
                                                   "parameters": {"type": "object", "properties": {}}}}]
        try:
            text = self.render([{"role": "user", "content": "hi"}], tools=tools)
        except ChatTemplateError as e:
            log.warning("the chat template failed on a probe request with tools: %s", e)
            return False
        return probe in text
