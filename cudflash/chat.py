"""Chat templates as Hugging Face renders them, and the messages they take.

Where a model folder keeps its template (the first found wins, as in transformers): `chat_template.jinja`
(named extras in `additional_chat_templates/*.jinja`), then `chat_template.json` {"chat_template": ...}, then
`tokenizer_config.json` "chat_template" (a string, or a list of {"name", "template"}). With several named
templates, "tool_use" is used when tools are given and "default" otherwise.

Rendering follows transformers' `apply_chat_template`: a sandboxed, immutable jinja2 environment with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and the `{% generation %}` tag, the globals
`raise_exception` and `strftime_now`, a `tojson` filter that keeps non-ASCII text and takes `indent`,
`separators` and `sort_keys`; the special tokens of tokenizer_config.json (`bos_token`, `eos_token`, ...)
as variables; `messages`, `tools`, `documents`, `add_generation_prompt` and any extra keyword (such as
`enable_thinking`) passed through. The rendered text already holds whatever special tokens the model
wants, so it is tokenized without adding any.
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from cudflash.errors import ConfigError, RequestError

# Variables the renderer sets itself; chat_template_kwargs may not replace them.
RESERVED_KWARGS = ("messages", "tools", "documents", "add_generation_prompt")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


@dataclass(slots=True)
class ChatTemplate:
    source: str  # the file it came from, for messages
    templates: dict[str, str]  # name -> jinja source; a single template is named "default"
    special_tokens: dict[str, Any] = field(default_factory=dict)  # bos_token, eos_token, ... as strings

    def select(self, tools: list | None) -> str:
        if len(self.templates) == 1:
            return next(iter(self.templates.values()))
        if tools is not None and "tool_use" in self.templates:
            return self.templates["tool_use"]
        if "default" in self.templates:
            return self.templates["default"]
        raise ConfigError(f"{self.source}: several chat templates ({', '.join(self.templates)}) and none is "
                          "named 'default'")

    def render(self, messages: list[dict], tools: list[dict] | None = None, documents: list[dict] | None = None,
               add_generation_prompt: bool = True, continue_final_message: bool = False,
               template_kwargs: dict[str, Any] | None = None) -> str:
        """The prompt text for `messages` (already checked by `validate_messages`); `template_kwargs` are extra
        template variables such as `enable_thinking`."""
        kwargs = template_kwargs or {}
        reserved = [k for k in RESERVED_KWARGS if k in kwargs]
        if reserved:
            raise RequestError(f"chat_template_kwargs may not set {', '.join(reserved)}")
        if add_generation_prompt and continue_final_message:
            raise RequestError("add_generation_prompt and continue_final_message cannot both be true")
        try:
            template = _compile(self.select(tools))
        except ConfigError as e:
            raise ConfigError(f"{self.source}: {e}") from None
        variables = {**self.special_tokens, **kwargs}
        if continue_final_message:
            messages = _tag_final_message(messages)
        try:
            text = template.render(messages=messages, tools=tools, documents=documents,
                                   add_generation_prompt=add_generation_prompt, **variables)
        except Exception as e:  # raise_exception(), undefined names, type errors inside the template
            raise RequestError(f"chat template of {self.source} failed: {_one_line(e)}") from None
        return _cut_at_tag(text) if continue_final_message else text


# continue_final_message: the last message's content gets this tag, and the rendered text is cut where it lands, so
# the model continues that message instead of starting a new turn.
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final_message(messages: list[dict]) -> list[dict]:
    last = messages[-1]
    if not isinstance(last.get("content"), str):
        raise RequestError("continue_final_message needs a last message with text content")
    return messages[:-1] + [{**last, "content": last["content"] + _CONTINUE_TAG}]


def _cut_at_tag(text: str) -> str:
    at = text.rfind(_CONTINUE_TAG.strip())
    if at == -1:
        raise RequestError("continue_final_message: the chat template does not keep the last message's text")
    # A template that strips the message also strips the tag's space: then strip what preceded it too.
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if len(msg) <= 300 else msg[:297] + "..."


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # jinja2's own tojson escapes HTML characters and takes only `indent`; templates are written against this one.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@functools.cache
def _environment():
    """The sandboxed environment, built on first use (jinja2 is an optional dependency)."""
    try:
        import jinja2
        from jinja2.ext import Extension
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise RequestError("chat templates need jinja2 (`pip install cudflash[text]`)") from None

    class GenerationTag(Extension):
        """`{% generation %}...{% endgeneration %}` marks assistant text for training masks; here it only renders
        its body."""

        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@functools.lru_cache(maxsize=32)
def _compile(source: str):
    try:
        return _environment().from_string(source)
    except RequestError:
        raise
    except Exception as e:  # a syntax error in the model's template
        raise ConfigError(f"chat template does not compile: {_one_line(e)}") from None


# ---- loading
def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ConfigError(f"{path}: cannot read ({_one_line(e)})") from None


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"{path}: cannot read ({_one_line(e)})") from None


def _named_templates(value: Any, path: Path) -> dict[str, str]:
    if isinstance(value, str):
        return {"default": value}
    if isinstance(value, list) and value and all(
            isinstance(t, dict) and isinstance(t.get("name"), str) and isinstance(t.get("template"), str)
            for t in value):
        return {t["name"]: t["template"] for t in value}
    raise ConfigError(f"{path}: 'chat_template' should be a string or a list of {{name, template}} objects")


# The named special tokens a template sees as variables (transformers' SPECIAL_TOKENS_ATTRIBUTES).
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens of tokenizer_config.json (strings or serialized AddedTokens) as strings, with the
    named entries of an `extra_special_tokens` object."""
    def text(v: Any) -> str | None:
        if isinstance(v, str):
            return v
        if isinstance(v, dict) and isinstance(v.get("content"), str):
            return v["content"]
        return None

    named = {k: config.get(k) for k in SPECIAL_TOKEN_NAMES}
    extra = config.get("extra_special_tokens")
    if isinstance(extra, dict):
        named.update(extra)
    return {k: text(v) for k, v in named.items() if isinstance(k, str) and text(v) is not None}


def load_chat_template(model_dir: str | Path) -> ChatTemplate | None:
    """The model folder's chat template, or None when it has none."""
    model_dir = Path(model_dir)
    config_path = model_dir / "tokenizer_config.json"
    config = _read_json(config_path) if config_path.is_file() else {}
    if not isinstance(config, dict):
        raise ConfigError(f"{config_path}: expected a JSON object")
    special = _special_tokens(config)
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        templates = {"default": _read_text(jinja_file)}
        extra_dir = model_dir / "additional_chat_templates"
        if extra_dir.is_dir():
            templates.update({p.stem: _read_text(p) for p in sorted(extra_dir.glob("*.jinja"))})
        return ChatTemplate(str(jinja_file), templates, special)
    json_file = model_dir / "chat_template.json"
    if json_file.is_file():
        data = _read_json(json_file)
        if isinstance(data, dict) and "chat_template" in data:
            return ChatTemplate(str(json_file), _named_templates(data["chat_template"], json_file), special)
    if config.get("chat_template") is not None:
        return ChatTemplate(str(config_path), _named_templates(config["chat_template"], config_path), special)
    return None


# ---- messages
def validate_messages(messages: Any, where: str = "messages") -> list[dict]:
    """Check one conversation and return it with text-part lists joined into strings (what every template
    takes). Roles are any non-empty string (the template decides which it accepts); other keys are kept."""
    if not isinstance(messages, (list, tuple)) or not messages:
        raise RequestError(f"{where}: expected a non-empty list of message objects")
    out = []
    for i, m in enumerate(messages):
        at = f"{where}[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{at}: expected an object with 'role' and 'content', got {type(m).__name__}")
        role = m.get("role")
        if not isinstance(role, str) or not role:
            raise RequestError(f"{at}.role: expected a non-empty string")
        # As transformers does: keys whose value is null are dropped (templates handle a missing key, not None),
        # and reasoning given under any of its names is seen under all of them.
        msg = {k: v for k, v in m.items() if v is not None}
        reasoning = next((msg[k] for k in REASONING_FIELDS if k in msg), None)
        if reasoning is not None:
            msg = {"thinking": reasoning, **msg, "reasoning_content": reasoning}
        tool_calls = m.get("tool_calls")
        if tool_calls is not None:
            _check_tool_calls(tool_calls, f"{at}.tool_calls")
        content = m.get("content")
        if content is None:
            if role != "assistant" or not tool_calls:
                raise RequestError(f"{at}.content: missing (only an assistant message with tool_calls may omit it)")
        else:
            msg["content"] = _content_text(content, f"{at}.content")
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise RequestError(f"{at}.{key}: expected a string")
        out.append(msg)
    return out


def _content_text(content: Any, at: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError(f"{at}: expected a string or a list of text parts, got {type(content).__name__}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or not isinstance(part.get("type"), str):
            raise RequestError(f"{at}[{j}]: expected an object with a 'type'")
        if part["type"] != "text":
            raise RequestError(f"{at}[{j}].type: only text parts are supported, got {part['type']!r}")
        if not isinstance(part.get("text"), str):
            raise RequestError(f"{at}[{j}].text: expected a string")
        texts.append(part["text"])
    return "\n".join(texts)


def _check_tool_calls(tool_calls: Any, at: str) -> None:
    if not isinstance(tool_calls, list):
        raise RequestError(f"{at}: expected a list")
    for j, call in enumerate(tool_calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{at}[{j}]: expected an object with 'function': {{'name', 'arguments'}}")
        if not isinstance(fn.get("arguments", {}), (str, dict)):
            raise RequestError(f"{at}[{j}].function.arguments: expected a JSON string or an object")


def validate_tools(tools: Any, where: str = "tools") -> list[dict] | None:
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise RequestError(f"{where}: expected a list of tool objects")
    return tools


def chat_prompt_ids(model_dir: str | Path, template: ChatTemplate | None, tokenizer: Any, messages: Any,
                    tools: Any = None, chat_template_kwargs: Any = None, documents: list[dict] | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    where: str = "messages") -> list[int]:
    """One conversation rendered by the model's chat template, as prompt token ids (LLM.apply_chat_template, and the
    CLI before the model loads)."""
    if tokenizer is None:
        raise RequestError(f"chat needs a tokenizer: {model_dir} has no tokenizer.json (or `pip install tokenizers` "
                           "is missing)")
    if template is None:
        raise ConfigError(f"{model_dir}: the model has no chat template (no 'chat_template' in tokenizer_config.json, "
                          "no chat_template.jinja); give plain prompts instead")
    kwargs = chat_template_kwargs or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise RequestError("chat_template_kwargs: expected an object with string keys")
    text = template.render(validate_messages(messages, where), validate_tools(tools), documents, add_generation_prompt,
                           continue_final_message, kwargs)
    return tokenizer.encode(text, special_tokens=False)  # the template wrote the special tokens; none are added
