"""One engine thread serves every connection (continuous batching across clients).

The thread owns the `LLM` and is the only caller of `add_request`, `step`, `abort` and `result`. HTTP handlers,
on the asyncio loop, talk to it through a thread-safe command queue; it answers through asyncio futures and
queues that it only ever touches with `loop.call_soon_threadsafe`. Commands are handled between steps, so an
abort frees its blocks before the next step runs. Invariant: every submitted handle gets exactly one final
event (Done or Failed), which is what releases its place in the bounded queue.
"""
from __future__ import annotations

import asyncio
import queue
import sys
import threading
import traceback
from dataclasses import dataclass, field

from cudflash.engine.llm_engine import LLM
from cudflash.errors import CudflashError
from cudflash.sampling_params import SamplingParams


# ---- events a handle receives, in order: Admitted, Delta*, Done; or Failed alone (refused) or last
@dataclass(slots=True)
class Admitted:
    """add_request accepted the request (it checks what depends on the model: vocabulary, context, KV pool)."""


@dataclass(slots=True)
class Delta:
    text: str


@dataclass(slots=True)
class Done:
    text: str  # the rest of the text (held back until the request finished)
    finish_reason: str
    completion_tokens: int


@dataclass(slots=True)
class Failed:
    message: str
    status: int = 500  # 400: add_request refused the request


@dataclass(eq=False)
class RequestHandle:
    """One engine request (one prompt, one choice). Handles of one HTTP request share `events`."""

    prompt_ids: list[int]
    params: SamplingParams
    index: int  # the choice index in the response
    events: asyncio.Queue  # (index, Admitted | Delta | Done | Failed)
    request_id: int | None = None  # set by the engine thread once added
    finished: bool = False  # loop side: the final event was delivered


class Overloaded(Exception):
    pass


@dataclass(slots=True)
class EngineStats:
    """A snapshot the engine thread publishes after every step; read by /metrics from the loop thread."""

    running: int = 0
    waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    preemptions: int = 0
    prefix_cache_hit_tokens: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    steps: int = 0  # engine steps that produced tokens for some request
    spec_steps: int = 0  # per-request speculative steps of finished requests
    spec_tokens: int = 0  # tokens those steps committed (accepted drafts + 1 each)
    finished: dict[str, int] = field(default_factory=dict)  # finish reason -> requests


class _TextStream:
    """Text of one request as the client sees it. While stop strings could still cut the text, the last
    (longest stop - 1) characters are held back: the engine cuts at most that many already-produced characters
    when a stop string completes, so what was sent is always a prefix of the final text."""

    def __init__(self, params: SamplingParams):
        self.holdback = max((len(s) for s in params.stop), default=1) - 1
        self.text, self.sent = "", 0

    def push(self, new_text: str) -> str:
        self.text += new_text
        upto = len(self.text) - self.holdback
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta

    def finish(self, final_text: str) -> str:
        return final_text[self.sent:]


_STOP = object()
STEP_FAILED = "internal error in the engine step"


class EngineLoop:
    def __init__(self, llm: LLM, max_queued: int):
        if llm.tokenizer is None:
            raise CudflashError(f"serving needs the target's tokenizer: {llm.target_cfg.path} has no "
                                "tokenizer.json (or `pip install tokenizers` is missing)")
        self.llm = llm
        self.capacity = llm.scheduler.max_num_seqs + max_queued  # requests in the engine at once
        self.inflight = 0  # loop thread only: submitted handles without their final event yet
        self.stats = EngineStats(kv_blocks_total=llm.runner.blocks.num_blocks)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Engine thread only:
        self._live: dict[int, tuple[RequestHandle, _TextStream]] = {}
        self._counts = EngineStats()

    # ---- loop side
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="cudflash-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._commands.put(_STOP)
            self._thread.join()
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, handles: list[RequestHandle]) -> None:
        """Queue the handles of one HTTP request, all or none (Overloaded when the bound would be passed)."""
        if self.inflight + len(handles) > self.capacity:
            raise Overloaded(f"the server is at capacity ({self.capacity} requests in flight); retry later")
        self.inflight += len(handles)
        for h in handles:
            self._commands.put(("add", h))

    def abort(self, handles: list[RequestHandle]) -> None:
        for h in handles:
            if not h.finished:
                self._commands.put(("abort", h))

    def _deliver(self, batch: list[tuple[RequestHandle, object]]) -> None:
        for handle, event in batch:
            if handle.finished:
                continue
            if isinstance(event, (Done, Failed)):
                handle.finished = True
                self.inflight -= 1
            handle.events.put_nowait((handle.index, event))

    # ---- engine thread
    def _post(self, batch: list[tuple[RequestHandle, object]]) -> None:
        if batch:
            try:
                self._loop.call_soon_threadsafe(self._deliver, batch)
            except RuntimeError:  # the event loop is closed: the server is shutting down
                pass

    def _run(self) -> None:
        """The engine thread's loop. It never dies of an exception (a dead thread would leave every later request
        waiting forever): whatever escapes one iteration fails the requests in flight and the loop goes on."""
        while True:
            batch: list[tuple[RequestHandle, object]] = []
            try:
                stop = self._iterate(batch)
            except Exception:  # an engine bug outside a step (a step's own failure is handled in _step)
                traceback.print_exc(file=sys.stderr)
                self._fail_all("internal error in the engine loop", batch)
                stop = False
            try:
                self._publish()
            except Exception:
                traceback.print_exc(file=sys.stderr)
            self._post(batch)
            if stop:
                return

    def _iterate(self, batch: list) -> bool:
        """Handle the queued commands, then step once if there is work; True when told to stop."""
        llm = self.llm
        commands = [self._commands.get()] if not llm.has_unfinished() else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                break
        for command in commands:
            if command is _STOP:
                self._fail_all("the server is shutting down", batch)
                return True
            kind, handle = command
            if kind == "add":
                self._add(handle, batch)
            else:
                self._abort(handle, batch)
        if llm.has_unfinished():
            self._step(batch)
        return False

    def _add(self, handle: RequestHandle, batch: list) -> None:
        try:
            rid = self.llm.add_request(handle.prompt_ids, handle.params)
        except CudflashError as e:
            batch.append((handle, Failed(str(e), status=400)))
            return
        except Exception as e:
            traceback.print_exc(file=sys.stderr)
            batch.append((handle, Failed(f"internal error adding the request ({type(e).__name__})")))
            return
        handle.request_id = rid
        self._live[rid] = (handle, _TextStream(handle.params))
        self._counts.prompt_tokens += len(handle.prompt_ids)
        batch.append((handle, Admitted()))

    def _abort(self, handle: RequestHandle, batch: list) -> None:
        if handle.request_id in self._live:
            self.llm.abort(handle.request_id)
            self._finish(handle.request_id, batch)

    def _finish(self, rid: int, batch: list) -> None:
        """The request's final event: Done, or Failed for a request the engine finished with reason "error" (a
        failed step or non-finite logits), so that a client gets a server error rather than a "successful" reply
        with a finish reason OpenAI does not define."""
        handle, stream = self._live.pop(rid)
        result = self.llm.result(rid)  # forgets the request
        c = self._counts
        c.finished[result.finish_reason] = c.finished.get(result.finish_reason, 0) + 1
        if self.llm.speculative:
            c.spec_steps += len(result.acceptance_lengths)
            c.spec_tokens += sum(result.acceptance_lengths)
        if result.finish_reason == "error":
            batch.append((handle, Failed(STEP_FAILED)))
        else:
            batch.append((handle, Done(stream.finish(result.text or ""), result.finish_reason,
                                       len(result.token_ids))))

    def _step(self, batch: list) -> None:
        try:
            outputs = self.llm.step()
        except Exception:
            # LLM.step has finished the requests the failed step touched with reason "error" and left every other
            # one as it was (queued, or running with its KV intact): answer the failed ones, keep serving the rest.
            traceback.print_exc(file=sys.stderr)
            self._finish_failed(batch)
            return
        if outputs:
            self._counts.steps += 1
        for out in outputs:
            if out.request_id not in self._live:
                continue
            self._counts.generated_tokens += len(out.new_token_ids)
            if out.finished:
                self._finish(out.request_id, batch)
            else:
                handle, stream = self._live[out.request_id]
                delta = stream.push(out.new_text or "")
                if delta:
                    batch.append((handle, Delta(delta)))

    def _finish_failed(self, batch: list) -> None:
        """After a step raised: the final event of every live request the engine finished meanwhile."""
        for rid in list(self._live):
            seq = self.llm.requests.get(rid)
            if seq is None:  # forgotten behind our back: nothing to read, but the handle still needs its event
                handle, _ = self._live.pop(rid)
                batch.append((handle, Failed(STEP_FAILED)))
            elif seq.finished:
                self._finish(rid, batch)

    def _fail_all(self, message: str, batch: list) -> None:
        for rid in list(self._live):
            handle, _ = self._live.pop(rid)
            try:
                self.llm.abort(rid)
                self.llm.result(rid)
            except Exception:
                pass  # the engine is already broken; the handle still gets its final event
            batch.append((handle, Failed(message)))

    def _publish(self) -> None:
        s, c = self.llm.scheduler, self._counts
        blocks = self.llm.runner.blocks
        self.stats = EngineStats(
            running=len(s.running), waiting=len(s.waiting), kv_blocks_used=blocks.num_blocks - blocks.num_free,
            kv_blocks_total=blocks.num_blocks, preemptions=s.num_preemptions,
            prefix_cache_hit_tokens=s.num_prefix_hit_tokens, prompt_tokens=c.prompt_tokens,
            generated_tokens=c.generated_tokens, steps=c.steps, spec_steps=c.spec_steps, spec_tokens=c.spec_tokens,
            finished=dict(c.finished))
