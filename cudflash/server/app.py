"""The HTTP layer: OpenAI-compatible routes (starlette) over the engine loop.

A request is parsed and checked (protocol.py), rendered / tokenized off the event loop, split into one engine
request per prompt and choice, submitted, and answered once every engine request is admitted: as server-sent
events (streaming) or one JSON object. A client that goes away aborts its engine requests at once, whether it
was streaming or waiting for a whole response.
"""
from __future__ import annotations

import asyncio
import json
import secrets
import sys
import time
import traceback
import uuid
from collections import deque
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from cudflash.engine.llm_engine import LLM
from cudflash.errors import CudflashError
from cudflash.sampling_params import SamplingParams
from cudflash.server import protocol
from cudflash.server.engine_loop import Admitted, Delta, Done, EngineLoop, Failed, Overloaded, RequestHandle
from cudflash.server.metrics import CONTENT_TYPE, render_metrics
from cudflash.server.protocol import APIError, ParsedRequest

MAX_BODY_BYTES = 16 * 2**20
# Request fields a cudflash error message may be about, most specific first (for the error's "param").
_PARAMS = ("max_tokens", "stop_token_ids", "stop", "temperature", "top_p", "top_k", "seed", "ignore_eos",
           "prompt", "messages")


def _param_of(message: str, default: str | None) -> str | None:
    return next((p for p in _PARAMS if p in message), default)


@dataclass(slots=True)
class SamplingDefaults:
    """What a request that leaves a sampling field out gets: the model's generation_config.json values where it
    has them (as vLLM does), else OpenAI's (temperature 1, top_p 1)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0

    @classmethod
    def from_model(cls, model_dir: str | Path) -> SamplingDefaults:
        path = Path(model_dir) / "generation_config.json"
        try:
            cfg = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
        except (OSError, ValueError, RecursionError):
            cfg = {}
        d = cls()
        if not isinstance(cfg, dict):
            return d
        number = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)  # noqa: E731
        if number(cfg.get("temperature")) and cfg["temperature"] >= 0:
            d.temperature = float(cfg["temperature"])
        if number(cfg.get("top_p")) and 0 < cfg["top_p"] <= 1:
            d.top_p = float(cfg["top_p"])
        if isinstance(cfg.get("top_k"), int) and not isinstance(cfg["top_k"], bool) and cfg["top_k"] >= 0:
            d.top_k = cfg["top_k"]
        return d


# ---- disconnects and streaming
class ClientGone(Exception):
    pass


async def _wait_for_disconnect(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _unless_disconnected(receive, work):
    """Await `work`; raise ClientGone (cancelling it) as soon as the client disconnects."""
    task, gone = asyncio.ensure_future(work), asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()
    if not task.done() or task.cancelled():
        raise ClientGone()
    return task.result()


class EventStream:
    """A server-sent-events response that stops (and calls `on_close`) the moment the client disconnects,
    not only when the next chunk fails to send."""

    def __init__(self, chunks: AsyncIterator[bytes], on_close: Callable[[], None]):
        self.chunks, self.on_close = chunks, on_close

    async def __call__(self, scope, receive, send) -> None:
        async def pump() -> None:
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream; charset=utf-8"),
                                    (b"cache-control", b"no-cache"), (b"x-accel-buffering", b"no")]})
            async for chunk in self.chunks:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        task, gone = asyncio.ensure_future(pump()), asyncio.ensure_future(_wait_for_disconnect(receive))
        try:
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in (task, gone):
                t.cancel()
            for t in (task, gone):
                try:
                    await t
                except (asyncio.CancelledError, OSError):
                    pass  # cancelled, or the connection died mid-send
                except Exception:
                    traceback.print_exc(file=sys.stderr)
            await self.chunks.aclose()
            self.on_close()


class _Events:
    """The events of one HTTP request's handles, with those that arrived while waiting for admission replayed
    first."""

    def __init__(self, queue: asyncio.Queue):
        self.queue, self.early = queue, deque()

    async def get(self) -> tuple[int, object]:
        return self.early.popleft() if self.early else await self.queue.get()


# ---- the server
class OpenAIServer:
    def __init__(self, llm: LLM, model_name: str, max_queued: int):
        self.llm, self.model_name = llm, model_name
        self.engine = EngineLoop(llm, max_queued)
        self.defaults = SamplingDefaults.from_model(llm.target_cfg.path)
        self.created = int(time.time())

    # ---- routes
    async def health(self, request: Request) -> Response:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", type="server_error")
        return JSONResponse({"status": "ok"})

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{
            "id": self.model_name, "object": "model", "created": self.created, "owned_by": "cudflash",
            "max_model_len": self.llm.max_model_len}]})

    async def metrics(self, request: Request) -> Response:
        return Response(render_metrics(self.engine.stats, self.llm.speculative), media_type=CONTENT_TYPE)

    async def chat_completions(self, request: Request) -> Response:
        req = protocol.parse_chat(await _read_body(request))
        self._check_model(req)
        ids = await run_in_threadpool(self._render_chat, req)
        return await self._respond(request, req, [ids])

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_completion(await _read_body(request))
        self._check_model(req)
        prompts = await run_in_threadpool(self._encode_prompts, req.prompts)
        return await self._respond(request, req, prompts)

    # ---- request preparation
    def _check_model(self, req: ParsedRequest) -> None:
        if req.model is not None and req.model != self.model_name:
            raise APIError(404, f"the model '{req.model}' does not exist (this server serves '{self.model_name}')",
                           "model", code="model_not_found")

    def _render_chat(self, req: ParsedRequest) -> list[int]:
        try:
            return self.llm.apply_chat_template(
                req.messages, req.tools, req.chat_template_kwargs, documents=req.documents,
                add_generation_prompt=req.add_generation_prompt, continue_final_message=req.continue_final_message)
        except CudflashError as e:
            msg = str(e)
            raise APIError(400, msg, "chat_template_kwargs" if "chat_template_kwargs" in msg else "messages") from None

    def _encode_prompts(self, prompts: list[str | list[int]]) -> list[list[int]]:
        return [self.llm.tokenizer.encode(p) if isinstance(p, str) else p for p in prompts]

    def _room(self, prompt_len: int) -> int:
        """The default max_tokens where a request sets none: the rest of the context, as the engine's admission
        counts it (max_model_len, the KV pool, the draft lookahead). At least 1, so that a prompt with no room left
        is refused by admission for its length, not for a max_tokens the client never sent."""
        return max(1, self.llm.admission.room(prompt_len))

    def _params(self, req: ParsedRequest, prompt_len: int, choice: int) -> SamplingParams:
        s, d = req.sampling, self.defaults
        try:
            return SamplingParams(
                max_tokens=s.max_tokens if s.max_tokens is not None else self._room(prompt_len),
                temperature=d.temperature if s.temperature is None else s.temperature,
                top_p=d.top_p if s.top_p is None else s.top_p, top_k=d.top_k if s.top_k is None else s.top_k,
                # choice i of n gets seed + i: reproducible, and choice 0 is what n = 1 gives
                seed=None if s.seed is None else (s.seed + choice) % 2**64,
                ignore_eos=s.ignore_eos, stop_token_ids=list(s.stop_token_ids), stop=list(s.stop))
        except Exception as e:  # cudflash errors, and any type the parser let through that SamplingParams refuses
            raise APIError(400, str(e), _param_of(str(e), None)) from None

    # ---- answering
    async def _respond(self, request: Request, req: ParsedRequest, prompts: list[list[int]]) -> Response:
        queue: asyncio.Queue = asyncio.Queue()
        handles = [RequestHandle(ids, self._params(req, len(ids), c), p * req.n + c, queue)
                   for p, ids in enumerate(prompts) for c in range(req.n)]
        if len(handles) > self.engine.capacity:  # could never be admitted: retrying would not help
            raise APIError(400, f"{len(prompts)} prompt(s) x n={req.n} choices exceed the server's capacity of "
                                f"{self.engine.capacity} requests", "n")
        try:
            self.engine.submit(handles)
        except Overloaded as e:
            raise APIError(429, str(e), type="rate_limit_exceeded", code="rate_limit_exceeded") from None
        events = _Events(queue)
        try:
            await _unless_disconnected(request.receive, self._admitted(handles, events, req.endpoint))
            if req.stream:
                chunks = self._stream(req, handles, events, sum(map(len, prompts)))
                return EventStream(chunks, lambda: self.engine.abort(handles))
            body = await _unless_disconnected(request.receive, self._collect(req, handles, events, prompts))
        except ClientGone:
            self.engine.abort(handles)
            return Response(status_code=499)  # nobody reads it; the engine requests are already aborted
        except BaseException:
            self.engine.abort(handles)
            raise
        return JSONResponse(body)

    async def _admitted(self, handles: list[RequestHandle], events: _Events, endpoint: str) -> None:
        """Wait until the engine accepted every handle; the first refusal aborts the rest and answers 400."""
        waiting = len(handles)
        while waiting:
            index, event = await events.queue.get()
            if isinstance(event, Admitted):
                waiting -= 1
            elif isinstance(event, Failed):
                self.engine.abort(handles)
                default = "prompt" if endpoint == "completions" else "messages"
                param = _param_of(event.message, default) if event.status == 400 else None
                if param == "prompt" and endpoint == "chat":
                    param = "messages"  # a chat request's prompt is what its messages rendered to
                raise APIError(event.status, event.message, param,
                               type="invalid_request_error" if event.status == 400 else "server_error")
            else:
                events.early.append((index, event))

    async def _collect(self, req: ParsedRequest, handles: list[RequestHandle], events: _Events,
                       prompts: list[list[int]]) -> dict:
        texts, reasons = [""] * len(handles), [None] * len(handles)
        completion_tokens, left = 0, len(handles)
        while left:
            index, event = await events.get()
            if isinstance(event, Delta):
                texts[index] += event.text
            elif isinstance(event, Done):
                texts[index] += event.text
                reasons[index], left = event.finish_reason, left - 1
                completion_tokens += event.completion_tokens
            elif isinstance(event, Failed):
                self.engine.abort(handles)
                raise APIError(500, event.message, type="server_error")
        choice = protocol.completion_choice if req.endpoint == "completions" else protocol.chat_choice
        prefix = "cmpl" if req.endpoint == "completions" else "chatcmpl"
        return protocol.envelope(req.endpoint, f"{prefix}-{uuid.uuid4().hex}", int(time.time()), self.model_name,
                                 [choice(i, t, r) for i, (t, r) in enumerate(zip(texts, reasons))], chunk=False,
                                 usage_obj=protocol.usage(sum(map(len, prompts)), completion_tokens))

    async def _stream(self, req: ParsedRequest, handles: list[RequestHandle], events: _Events,
                      prompt_tokens: int) -> AsyncIterator[bytes]:
        chat = req.endpoint == "chat"
        request_id, created = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}", int(time.time())

        def chunk(index: int, text: str | None, finish_reason: str | None = None, first: bool = False) -> bytes:
            if chat:
                delta = {"role": "assistant", "content": ""} if first else {} if text is None else {"content": text}
                choices = [protocol.chat_delta(index, delta, finish_reason)]
            else:
                choices = [protocol.completion_choice(index, text or "", finish_reason)]
            return protocol.sse(protocol.envelope(req.endpoint, request_id, created, self.model_name, choices,
                                                  chunk=True, with_usage=req.include_usage))

        if chat:
            for h in handles:
                yield chunk(h.index, None, first=True)  # the assistant role first, as OpenAI sends it
        completion_tokens, left = 0, len(handles)
        while left:
            index, event = await events.get()
            if isinstance(event, Delta):
                yield chunk(index, event.text)
            elif isinstance(event, Done):
                if event.text:
                    yield chunk(index, event.text)
                yield chunk(index, None, event.finish_reason)
                completion_tokens, left = completion_tokens + event.completion_tokens, left - 1
            elif isinstance(event, Failed):
                self.engine.abort(handles)
                yield protocol.sse(APIError(500, event.message, type="server_error").body())
                break
        else:
            if req.include_usage:
                yield protocol.sse(protocol.envelope(req.endpoint, request_id, created, self.model_name, [],
                                                     chunk=True, usage_obj=protocol.usage(prompt_tokens,
                                                                                          completion_tokens)))
        yield protocol.sse("[DONE]")


def _check_content_type(request: Request) -> None:
    """A body declared as something other than JSON is refused (as vLLM's FastAPI does), rather than parsed as JSON
    anyway; a request that declares no type is read as JSON."""
    declared = request.headers.get("content-type", "")
    media = declared.split(";", 1)[0].strip().lower()
    if media and media != "application/json" and not media.endswith("+json"):
        raise APIError(400, f"the request body must be JSON (Content-Type: application/json), got Content-Type "
                            f"{declared[:60]!a}")


async def _read_body(request: Request) -> dict:
    _check_content_type(request)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY_BYTES:  # refused before reading any of it
        raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
    raw, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > MAX_BODY_BYTES:
            raise APIError(413, f"the request body is larger than {MAX_BODY_BYTES // 2**20} MiB")
        raw.append(piece)
    return protocol.parse_json_body(b"".join(raw))


class BearerAuth:
    """ASGI middleware: every path but /health needs `Authorization: Bearer <key>`."""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not secrets.compare_digest(given, self.expected):
                error = APIError(401, "missing or wrong API key (send 'Authorization: Bearer <key>')",
                                 code="invalid_api_key")
                await JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(llm: LLM, *, model_name: str, api_key: str | None = None, max_queued: int = 256) -> Starlette:
    """The ASGI app; its lifespan starts the engine thread (so run it under a server that runs lifespans)."""
    server = OpenAIServer(llm, model_name, max_queued)

    @asynccontextmanager
    async def lifespan(app):
        server.engine.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            server.engine.stop()

    async def api_error(request: Request, exc: APIError) -> Response:
        return JSONResponse(exc.body(), exc.status)

    async def http_error(request: Request, exc: HTTPException) -> Response:
        return JSONResponse(APIError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}").body(),
                            exc.status_code)

    async def internal_error(request: Request, exc: Exception) -> Response:
        return JSONResponse(APIError(500, "internal server error", type="server_error").body(), 500)

    app = Starlette(
        routes=[Route("/health", server.health, methods=["GET"]),
                Route("/metrics", server.metrics, methods=["GET"]),
                Route("/v1/models", server.models, methods=["GET"]),
                Route("/v1/completions", server.completions, methods=["POST"]),
                Route("/v1/chat/completions", server.chat_completions, methods=["POST"])],
        middleware=[Middleware(BearerAuth, api_key=api_key)] if api_key else [],
        exception_handlers={APIError: api_error, HTTPException: http_error, Exception: internal_error},
        lifespan=lifespan)
    app.state.server = server
    return app
