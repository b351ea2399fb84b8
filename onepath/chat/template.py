"""A checkpoint's chat template, rendered with Jinja as transformers' apply_chat_template renders it.

Where it is read (transformers' order): `chat_template.jinja` beside the tokenizer and any
`additional_chat_templates/NAME.jinja`; without those, tokenizer_config.json's `chat_template`, a
string or a list of {"name", "template"}. Of several, `tool_use` serves a call with tools, else `default`.

The environment is transformers': Jinja's immutable sandbox (no object internals, no mutating the
caller's data), trim_blocks and lstrip_blocks, {% break %} / {% continue %}, the {% generation %}
block (its body), the globals raise_exception, strftime_now, dict and namespace (no underscore names),
and tojson as json.dumps (ensure_ascii off; indent, separators, sort_keys). A template sees messages,
tools (JSON schemas; a plain function becomes one, chat/schema.py), documents, add_generation_prompt,
the tokenizer's special tokens (bos_token, eos_token, ...) and every extra keyword (enable_thinking,
date_string, ...). The inputs are copied to plain JSON data first, None-valued message keys dropped,
and reasoning given as `thinking` or `reasoning` is also passed as `reasoning_content`.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from onepath.chat.schema import tool_schema

TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"
TOKENIZER_CONFIG = "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # the first is the one templates read


class ChatTemplateError(ValueError):
    """A template that does not compile, refuses a conversation, or uses what the sandbox forbids."""


@dataclass(frozen=True)
class ChatTemplate:
    templates: dict[str, str]                 # name -> Jinja source; a single template is "default"
    source: str                               # where it was read, for messages
    special_tokens: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ... as text

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> ChatTemplate | None:
        """The template a checkpoint directory ships, or None when it has none."""
        path = Path(path)
        config = read_tokenizer_config(path)
        files = ([path / TEMPLATE_FILE] if (path / TEMPLATE_FILE).is_file() else []) + \
            sorted((path / TEMPLATE_DIR).glob("*.jinja"))
        if files:
            templates = {("default" if f.name == TEMPLATE_FILE and f.parent == path else f.stem): f.read_text("utf-8")
                         for f in files}
            where = ", ".join(str(f.relative_to(path)) for f in files)
            return cls(templates, f"{path} ({where})", special_tokens(config))
        if config.get("chat_template") is None:
            return None
        return cls(named_templates(config["chat_template"], path / TOKENIZER_CONFIG),
                   f"{path / TOKENIZER_CONFIG}", special_tokens(config))

    @classmethod
    def from_file(cls, file: str | Path, special: dict[str, str] | None = None) -> ChatTemplate:
        """A template file: Jinja text, or a JSON file with a `chat_template` (a tokenizer_config.json)."""
        file = Path(file)
        if not file.is_file():
            raise FileNotFoundError(f"chat template {file} does not exist: give a .jinja file, a "
                                    "tokenizer_config.json with a chat_template, auto or none")
        if file.suffix == ".json":
            config = read_json(file)
            if config.get("chat_template") is None:
                raise ChatTemplateError(f"{file} has no chat_template: give a file that holds one, or a .jinja file")
            return cls(named_templates(config["chat_template"], file), str(file),
                       {**special_tokens(config), **(special or {})})
        return cls({"default": file.read_text("utf-8")}, str(file), dict(special or {}))

    def source_for(self, tools=None, name: str | None = None) -> str:
        """The Jinja text that serves a call: `name`, else tool_use with tools, else default."""
        if name is not None:
            if name not in self.templates:
                raise ChatTemplateError(f"chat template {name!r} is not in {self.source}: it has "
                                        f"{', '.join(sorted(self.templates))}")
            return self.templates[name]
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ChatTemplateError(f"{self.source} holds several chat templates ({', '.join(sorted(self.templates))}) "
                                "and none is named default: pick one by name")

    def check(self) -> ChatTemplate:
        """Compile every template now, so a broken one fails at start rather than at its first use."""
        for name, text in self.templates.items():
            try:
                compiled(text)
            except ChatTemplateError as e:
                raise ChatTemplateError(f"chat template {name!r} of {self.source}: {e}") from None
        return self

    def render(self, messages: list[dict], tools: list | None = None, add_generation_prompt: bool = False,
               documents: list[dict] | None = None, name: str | None = None, **kwargs) -> str:
        """The conversation as the model reads it. kwargs reach the template as variables and win over the
        special tokens of the same name."""
        if not messages:
            raise ChatTemplateError("cannot render an empty conversation: give at least one message")
        try:
            template = compiled(self.source_for(tools, name))
        except ChatTemplateError as e:
            raise ChatTemplateError(f"chat template {self.source}: {e}") from None
        schemas = None if tools is None else [tool_schema(t) for t in tools]
        variables = plain({**self.special_tokens, **kwargs})
        try:
            return template.render(messages=with_reasoning(plain(messages_without_none(messages))),
                                   tools=plain(schemas), documents=plain(documents),
                                   add_generation_prompt=add_generation_prompt, **variables)
        except jinja2.exceptions.SecurityError as e:
            raise ChatTemplateError(f"chat template {self.source} does what the sandbox forbids ({e}): "
                                    "onepath renders templates as transformers does; fix the template") from None
        except jinja2.exceptions.TemplateError as e:  # raise_exception(...) and undefined values
            raise ChatTemplateError(f"chat template {self.source} refused the conversation: {e}") from None
        except (TypeError, AttributeError, KeyError, IndexError) as e:
            raise ChatTemplateError(f"chat template {self.source} failed on the conversation ({type(e).__name__}: "
                                    f"{e}): check the messages' fields against what the template reads") from None


def read_tokenizer_config(path: Path) -> dict:
    file = path / TOKENIZER_CONFIG
    return read_json(file) if file.is_file() else {}


def read_json(file: Path) -> dict:
    try:
        raw = json.loads(file.read_text("utf-8"))
    except json.JSONDecodeError as e:
        raise ChatTemplateError(f"{file} is not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ChatTemplateError(f"{file} holds a {type(raw).__name__}, not a JSON object")
    return raw


def named_templates(value, where) -> dict[str, str]:
    """tokenizer_config's chat_template: one template, or a list of {"name", "template"}."""
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ChatTemplateError(f"{where}: chat_template must be a string or a list of {{'name', 'template'}} "
                            f"entries, got {type(value).__name__}")


def special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens as text (tokenizer_config gives a string or an AddedToken dict)."""
    out = {}
    for key in SPECIAL_TOKENS:
        value = config.get(key)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def messages_without_none(messages: list[dict]) -> list[dict]:
    """A message's keys whose value is None are dropped: templates test for a missing key, not for None."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ChatTemplateError(f"message {i} is a {type(message).__name__}, not a dict with role and content")
        out.append({k: v for k, v in message.items() if v is not None})
    return out


def with_reasoning(messages: list[dict]) -> list[dict]:
    """Reasoning given under any of REASONING_FIELDS is passed as reasoning_content and thinking too."""
    out = []
    for message in messages:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        out.append(message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning})
    return out


def plain(value):
    """A copy made of JSON types only (what the sandbox may safely hand a template); anything else
    becomes the text <TypeName>."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for base in (bool, str, int, float):  # subclasses (enums, numpy scalars) lose their methods
        if isinstance(value, base):
            return base(value)
    if isinstance(value, dict):
        return {plain(k): plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(plain(v) for v in value)
    if callable(getattr(value, "item", None)) and getattr(value, "ndim", None) == 0:
        return plain(value.item())
    return f"<{type(value).__name__}>"


class Generation(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: marks the assistant's text for a training mask; renders its body."""
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


class Namespace(jinja2.utils.Namespace):
    """namespace(...) without underscore-named attributes (they could reach Python internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            Namespace.check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        Namespace.check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a namespace attribute may not start with '_': {name!r}")


class DictMaker:
    """dict(...) and dict.fromkeys(...) for templates, without the type object itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # Jinja's own tojson escapes HTML characters; templates expect plain json.dumps
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format):
    return datetime.now().strftime(format)


@lru_cache(maxsize=64)
def compiled(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, dict=DictMaker(),
                       namespace=Namespace)
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateSyntaxError as e:
        raise ChatTemplateError(f"does not compile (line {e.lineno}: {e.message}); it may use a "
                                "Jinja extension or syntax transformers' renderer lacks too: fix the template or "
                                "give another (data.chat_template PATH)") from None
