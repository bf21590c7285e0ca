"""The OpenAI wire format: request bodies checked field by field into what the engine runs, and the response
objects and stream chunks sent back. No HTTP and no engine here.

Every problem with a request is an `APIError` that names the field; unknown fields are refused, as OpenAI
does. Fields cudflash cannot honour (logprobs, penalties, logit_bias, ...) are accepted only at their neutral
values. Extensions, as vLLM spells them: `top_k`, `ignore_eos`, `stop_token_ids`, and for chat
`chat_template_kwargs`, `add_generation_prompt`, `continue_final_message`, `documents`.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from typing import Any, Callable

MAX_N = 16  # choices per request
MAX_PROMPTS = 64  # prompts in one completions request


class APIError(Exception):
    """An error answered with an OpenAI error object."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def bad(param: str | None, message: str) -> APIError:
    return APIError(400, f"{param}: {message}" if param else message, param)


def parse_json_body(raw: bytes) -> dict:
    def no_constants(name: str):
        raise ValueError(f"{name} is not valid JSON")

    try:
        body = json.loads(raw.decode("utf-8"), parse_constant=no_constants)
    except UnicodeDecodeError:
        raise bad(None, "the request body is not UTF-8") from None
    except RecursionError:
        raise bad(None, "the request body is nested too deeply") from None
    except ValueError as e:  # JSONDecodeError, NaN / Infinity, integers too long to convert
        raise bad(None, f"the request body is not valid JSON ({e})") from None
    if not isinstance(body, dict):
        raise bad(None, "the request body must be a JSON object")
    try:  # \ud800-style escapes decode to lone surrogates, which no tokenizer can take
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        raise bad(None, "the request body holds a lone UTF-16 surrogate (not valid Unicode text)") from None
    return body


# ---- field checkers: each returns the value (or the default for null / absent) or raises naming the field
def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)


def _int(name: str, v: Any, lo: int, hi: int | None = None) -> int:
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(name, f"expected an integer {span}, got {json.dumps(v)[:40]}")
    return v


def _number(name: str, v: Any, lo: float, hi: float | None = None) -> float:
    if not _is_number(v) or v < lo or (hi is not None and v > hi):
        span = f"between {lo} and {hi}" if hi is not None else f">= {lo}"
        raise bad(name, f"expected a number {span}, got {json.dumps(v)[:40]}")
    return float(v)


def _bool(name: str, v: Any) -> bool:
    if not isinstance(v, bool):
        raise bad(name, f"expected true or false, got {json.dumps(v)[:40]}")
    return v


def _stop(name: str, v: Any) -> list[str]:
    stops = [v] if isinstance(v, str) else v
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise bad(name, "expected a non-empty string or a list of non-empty strings")
    return stops


def _token_ids(name: str, v: Any) -> list[int]:
    if not isinstance(v, list) or not all(_is_int(i) and i >= 0 for i in v):
        raise bad(name, "expected a list of non-negative integer token ids")
    return v


@dataclass(slots=True)
class Sampling:
    """The OpenAI sampling fields of one request, before they become SamplingParams (per prompt and choice)."""

    max_tokens: int | None = None  # None: the protocol's default (completions 16, chat the rest of the context)
    temperature: float | None = None  # None: the server's default
    top_p: float | None = None
    top_k: int | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False


@dataclass(slots=True)
class ParsedRequest:
    endpoint: str  # "chat" | "completions"
    sampling: Sampling
    n: int = 1
    stream: bool = False
    include_usage: bool = False
    model: str | None = None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions
    messages: list | None = None  # chat (checked again by cudflash.chat)
    tools: list | None = None
    documents: list | None = None
    chat_template_kwargs: dict = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False


Handler = Callable[[ParsedRequest, str, Any], None]  # called for each non-null field of a body


def _top_p(name: str, v: Any) -> float:
    if _number(name, v, 0.0, 1.0) == 0.0:
        raise bad(name, "must be > 0")
    return float(v)


def _sampling(attr: str, check: Callable[[str, Any], Any]) -> Handler:
    def set_field(req: ParsedRequest, name: str, v: Any) -> None:
        setattr(req.sampling, attr, check(name, v))
    return set_field


SAMPLING_FIELDS: dict[str, Handler] = {
    "max_tokens": _sampling("max_tokens", lambda name, v: _int(name, v, 1)),
    "temperature": _sampling("temperature", lambda name, v: _number(name, v, 0.0)),
    "top_p": _sampling("top_p", _top_p),
    "top_k": _sampling("top_k", lambda name, v: 0 if v == -1 else _int(name, v, 0)),  # -1: off, as vLLM has it
    "seed": _sampling("seed", lambda name, v: _int(name, v, 0, 2**64 - 1)),
    "stop": _sampling("stop", _stop),
    "stop_token_ids": _sampling("stop_token_ids", _token_ids),
    "ignore_eos": _sampling("ignore_eos", _bool),
}


def _flag(attr: str) -> Handler:
    def set_flag(req: ParsedRequest, name: str, v: Any) -> None:
        setattr(req, attr, _bool(name, v))
    return set_flag


def _only(*allowed: Any) -> Handler:
    """A field cudflash accepts only at its neutral value(s)."""
    def check(req: ParsedRequest, name: str, v: Any) -> None:
        if not any(v == a and isinstance(v, bool) == isinstance(a, bool) for a in allowed):
            raise bad(name, f"is not supported (only {' or '.join(json.dumps(a) for a in allowed)})")
    return check


def _typed(kind: type) -> Handler:
    def check(req: ParsedRequest, name: str, v: Any) -> None:
        if not isinstance(v, kind):
            raise bad(name, f"expected {'a string' if kind is str else 'an object'}")
    return check


def _model(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, str):
        raise bad(name, "expected a string")
    req.model = v


def _n(req: ParsedRequest, name: str, v: Any) -> None:
    req.n = _int(name, v, 1, MAX_N)


def _stream_options(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, dict) or set(v) - {"include_usage", "continuous_usage_stats"}:
        raise bad(name, 'expected an object with "include_usage"')
    req.include_usage = _bool(f"{name}.include_usage", v.get("include_usage", False))


COMMON_FIELDS: dict[str, Handler] = {
    **SAMPLING_FIELDS, "model": _model, "n": _n, "stream": _flag("stream"),
    "stream_options": _stream_options, "user": _typed(str), "metadata": _typed(dict), "service_tier": _typed(str),
    "presence_penalty": _only(0), "frequency_penalty": _only(0), "repetition_penalty": _only(1),
    "logit_bias": _only({}),
}


def _parse(body: dict, endpoint: str, own: dict[str, Handler]) -> ParsedRequest:
    req = ParsedRequest(endpoint, Sampling())
    handlers = {**COMMON_FIELDS, **own}
    for name in body:
        if name not in handlers:
            raise bad(name, "unknown field")
    for name, v in body.items():
        if v is not None:  # null means "the default" for every optional field
            handlers[name](req, name, v)
    if body.get("stream_options") is not None and not req.stream:
        raise bad("stream_options", "is only allowed with stream: true")
    return req


# ---- /v1/completions
def _prompt(req: ParsedRequest, name: str, v: Any) -> None:
    if isinstance(v, str):
        prompts = [v]
    elif isinstance(v, list) and v and all(_is_int(i) for i in v):
        prompts = [v]  # one prompt of token ids
    elif isinstance(v, list) and v and all(isinstance(p, str) or (isinstance(p, list) and p) for p in v):
        prompts = v  # a batch of prompts, text or token ids
    else:
        raise bad(name, "expected a string, a list of token ids, or a list of such prompts")
    if len(prompts) > MAX_PROMPTS:
        raise bad(name, f"at most {MAX_PROMPTS} prompts in one request")
    for i, p in enumerate(prompts):
        if isinstance(p, str):
            if not p:
                raise bad(name, "prompts must not be empty")
        else:
            _token_ids(f"{name}[{i}]" if len(prompts) > 1 else name, p)
    req.prompts = prompts


def _best_of(req: ParsedRequest, name: str, v: Any) -> None:
    _int(name, v, 1)  # compared with n once the whole body is read


def _unsupported(req: ParsedRequest, name: str, v: Any) -> None:
    raise bad(name, "is not supported (only null)")


COMPLETION_FIELDS: dict[str, Handler] = {
    "prompt": _prompt, "echo": _only(False), "best_of": _best_of, "logprobs": _unsupported, "suffix": _unsupported,
}


def parse_completion(body: dict) -> ParsedRequest:
    if body.get("prompt") is None:
        raise bad("prompt", "missing")
    req = _parse(body, "completions", COMPLETION_FIELDS)
    if req.sampling.max_tokens is None:
        req.sampling.max_tokens = 16  # OpenAI's default for completions
    if body.get("best_of") not in (None, req.n):
        raise bad("best_of", "is not supported (only equal to n)")
    return req


# ---- /v1/chat/completions
def _messages(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, list) or not v:
        raise bad(name, "expected a non-empty list of messages")
    req.messages = [_openai_message(m, f"{name}[{i}]") for i, m in enumerate(v)]


def _openai_message(m: Any, at: str) -> Any:
    """OpenAI sends tool-call arguments as a JSON string; templates expect the object (as transformers and vLLM
    pass it). Everything else is checked by cudflash.chat.validate_messages."""
    if not isinstance(m, dict) or not isinstance(m.get("tool_calls"), list):
        return m
    calls = []
    for j, call in enumerate(m["tool_calls"]):
        fn = call.get("function") if isinstance(call, dict) else None
        if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
            where = f"{at}.tool_calls[{j}].function.arguments"
            try:
                args = json.loads(fn["arguments"])
            except (ValueError, RecursionError):
                raise bad(where, "is not valid JSON") from None
            if not isinstance(args, dict):  # templates iterate it by name, as transformers passes it
                raise bad(where, f"must be a JSON object (the arguments by name), got JSON {_json_kind(args)}")
            call = {**call, "function": {**fn, "arguments": args}}
        calls.append(call)
    return {**m, "tool_calls": calls}


def _json_kind(v: Any) -> str:
    kinds = ((bool, "true or false"), (str, "a string"), (list, "an array"), (dict, "an object"), (int, "a number"),
             (float, "a number"))
    return "null" if v is None else next(k for t, k in kinds if isinstance(v, t))


def _tools(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(t, dict) for t in v):
        raise bad(name, "expected a list of tool objects")
    req.tools = v


def _tool_choice(req: ParsedRequest, name: str, v: Any) -> None:
    if v not in ("none", "auto"):
        raise bad(name, 'is not supported (only "none" or "auto": cudflash does not force tool calls)')


def _response_format(req: ParsedRequest, name: str, v: Any) -> None:
    if v != {"type": "text"}:
        raise bad(name, 'is not supported (only {"type": "text"})')


def _kwargs(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, dict):
        raise bad(name, "expected an object")
    req.chat_template_kwargs = v


def _documents(req: ParsedRequest, name: str, v: Any) -> None:
    if not isinstance(v, list) or not all(isinstance(d, dict) for d in v):
        raise bad(name, "expected a list of objects")
    req.documents = v


CHAT_FIELDS: dict[str, Handler] = {
    "messages": _messages, "max_completion_tokens": SAMPLING_FIELDS["max_tokens"], "tools": _tools,
    "tool_choice": _tool_choice, "response_format": _response_format, "chat_template_kwargs": _kwargs,
    "documents": _documents,
    "add_generation_prompt": _flag("add_generation_prompt"),
    "continue_final_message": _flag("continue_final_message"),
    "logprobs": _only(False), "top_logprobs": _only(0), "store": _only(False), "modalities": _only(["text"]),
    "parallel_tool_calls": lambda req, name, v: _bool(name, v),
}


def parse_chat(body: dict) -> ParsedRequest:
    if body.get("messages") is None:
        raise bad("messages", "missing")
    req = _parse(body, "chat", CHAT_FIELDS)
    if body.get("max_completion_tokens") is not None:  # OpenAI's newer name wins over max_tokens
        req.sampling.max_tokens = body["max_completion_tokens"]
    if body.get("tool_choice") == "none":
        req.tools = None  # the model is not offered the tools
    if req.add_generation_prompt and req.continue_final_message:
        req.add_generation_prompt = False  # continuing the last message replaces the new turn's header
    return req


# ---- responses
def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}


def chat_choice(index: int, text: str, finish_reason: str | None) -> dict:
    return {"index": index, "message": {"role": "assistant", "content": text}, "logprobs": None,
            "finish_reason": finish_reason}


def chat_delta(index: int, delta: dict, finish_reason: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}


def envelope(endpoint: str, request_id: str, created: int, model: str, choices: list[dict], *,
             chunk: bool, usage_obj: dict | None = None, with_usage: bool = True) -> dict:
    obj = "text_completion" if endpoint == "completions" else ("chat.completion.chunk" if chunk else "chat.completion")
    out = {"id": request_id, "object": obj, "created": created, "model": model, "choices": choices}
    if with_usage:
        out["usage"] = usage_obj
    return out


def sse(obj: dict | str) -> bytes:
    data = obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
