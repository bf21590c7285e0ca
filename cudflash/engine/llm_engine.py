"""The public entry point: `LLM(target, draft=...)`, with `generate`, `stream`, and the step-level API
(`add_request`, `step`, `abort`) that both are built on.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Callable, Sequence as Seq, TypeVar

import numpy as np

from cudflash import validate
from cudflash.backends import CudaTuning, get_backend
from cudflash.chat import ChatTemplate, chat_prompt_ids, load_chat_template
from cudflash.config import load_target_config
from cudflash.draft_config import DraftOptions, apply_draft_options, load_draft_config, validate_pair
from cudflash.engine.admission import Admission, is_token_ids
from cudflash.engine.model_runner import ModelRunner
from cudflash.parallel.engine_target import check_tensor_parallel
from cudflash.engine.scheduler import Scheduler
from cudflash.engine.sequence import Sequence, SequenceStatus, StepMark
from cudflash.engine.propose import Proposer, make_proposer
from cudflash.engine.spec_decode import SpeculativeStep, StepPhases
from cudflash.errors import ConfigError, CudflashError, RequestError
from cudflash.hub import resolve_model
from cudflash.quant.options import check_quantize
from cudflash.sampling_params import SamplingParams
from cudflash.tokenizer import load_tokenizer


F = TypeVar("F", bound=Callable)


# ---- the LLM's own arguments (ConfigError: they configure the engine, they are not one request's)
def _at_least(minimum: int) -> Callable[[object, str], int]:
    def check(value: object, name: str) -> int:
        try:
            return validate.integer(value, name, minimum=minimum, what=f"an integer >= {minimum}")
        except RequestError as e:
            raise ConfigError(str(e)) from None
    return check


def _optional(value: object, name: str, check: Callable[[object, str], int]) -> int | None:
    return None if value is None else check(value, name)


def _fraction(value: object, name: str) -> float:
    try:
        v = validate.real(value, name, "a number in (0, 1]")
    except RequestError as e:
        raise ConfigError(str(e)) from None
    if not 0.0 < v <= 1.0:
        raise ConfigError(f"{name} must be a number in (0, 1], got {v}")
    return v


def _flag(value: object, name: str) -> bool:
    try:
        return validate.boolean(value, name)
    except RequestError as e:
        raise ConfigError(str(e)) from None


def _draft_options(value: object) -> DraftOptions | None:
    """None, a DraftOptions, or a dict of DraftOptions fields (an unknown one named)."""
    if value is None or isinstance(value, DraftOptions):
        return value
    if not isinstance(value, dict):
        raise ConfigError(f"draft_options must be a DraftOptions or a dict of its fields, got "
                          f"{validate.describe(value)}")
    known = {f.name for f in dataclasses.fields(DraftOptions)}
    unknown = [k for k in value if k not in known]
    if unknown:
        raise ConfigError(f"draft_options: unknown field {unknown[0]!r} (known: {', '.join(sorted(known))})")
    try:
        return DraftOptions(**value)
    except (ConfigError, TypeError) as e:  # TypeError: a value of a type DraftOptions' range checks cannot compare
        raise ConfigError(f"draft_options: {e}") from None


def _serialized(method: F) -> F:
    """Run the method holding the LLM's lock. Invariant: the scheduler, the KV blocks and `requests` change only
    under it, so that threads sharing one LLM (two `generate` calls, a stream consumed in another thread) take turns
    step by step instead of stepping into each other's half-built batches. Reentrant: `generate` holds it around
    `_queue`, which holds it again."""
    @functools.wraps(method)
    def locked(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)
    return locked  # type: ignore[return-value]


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort" | "error" (a step failed: see LLM.step)
    acceptance_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


@dataclass(slots=True)
class RequestOutput:
    """What one engine step produced for one request."""

    request_id: int
    new_token_ids: list[int]
    new_text: str | None
    finished: bool
    finish_reason: str | None


class LLM:
    def __init__(self, target: str | Path, draft: str | Path | None = None, backend: str = "auto", *,
                 block_size: int | None = None, max_num_seqs: int = 64, max_num_batched_tokens: int = 8192,
                 kv_block_size: int = 16, num_kv_blocks: int | None = None, memory_utilization: float = 0.9,
                 enable_prefix_caching: bool = True, progress: bool = False, random_weights: bool = False,
                 draft_options: DraftOptions | dict | None = None, enforce_eager: bool = False,
                 tuning: CudaTuning | dict | None = None, max_model_len: int | None = None,
                 check_weights: bool = True, quantize: str | None = None, quantize_draft: bool = False,
                 quantize_lm_head: bool = False, tensor_parallel_size: int = 1,
                 num_state_snapshots: int | None = None):
        # Every numeric and boolean argument, checked before anything loads and normalised to a plain int / float /
        # bool: a wrong one is a ConfigError naming it, never a TypeError or ZeroDivisionError from deep inside.
        block_size = _optional(block_size, "block_size", _at_least(1))
        max_num_seqs = _at_least(1)(max_num_seqs, "max_num_seqs")
        max_num_batched_tokens = _at_least(1)(max_num_batched_tokens, "max_num_batched_tokens")
        kv_block_size = _at_least(1)(kv_block_size, "kv_block_size")
        num_kv_blocks = _optional(num_kv_blocks, "num_kv_blocks", _at_least(1))
        num_state_snapshots = _optional(num_state_snapshots, "num_state_snapshots", _at_least(0))
        memory_utilization = _fraction(memory_utilization, "memory_utilization")
        enable_prefix_caching = _flag(enable_prefix_caching, "enable_prefix_caching")
        progress, random_weights = _flag(progress, "progress"), _flag(random_weights, "random_weights")
        enforce_eager, check_weights = _flag(enforce_eager, "enforce_eager"), _flag(check_weights, "check_weights")
        quantize_draft = _flag(quantize_draft, "quantize_draft")
        quantize_lm_head = _flag(quantize_lm_head, "quantize_lm_head")
        draft_options = _draft_options(draft_options)
        # A local folder, or a Hugging Face model id ("Org/Name": the local cache first, else a download).
        target = resolve_model(target, "target")
        draft = resolve_model(draft, "draft") if draft is not None else None
        self.target_cfg = load_target_config(target)
        # The longest prompt + output this LLM serves (vLLM's name); at most the model's own limit.
        limit = self.target_cfg.max_position_embeddings
        if max_model_len is not None and (not isinstance(max_model_len, int) or isinstance(max_model_len, bool)
                                          or not 1 <= max_model_len <= limit):
            raise ConfigError(f"max_model_len must be an integer in 1..{limit} (the model's max_position_embeddings), "
                              f"got {max_model_len!r}")
        self.max_model_len = max_model_len or limit
        self.draft_cfg = load_draft_config(draft) if draft is not None else None
        # The target's quantized format (None: unquantized) and the quantize choices, checked (quant/options.py).
        self.target_quant = check_quantize(target, draft, quantize, quantize_draft, random_weights,
                                          quantize_lm_head, tensor_parallel_size)
        # Drafting choices (DraftOptions: drafter windows, DSpark cuts, draft trees): lossless, off by default.
        self.draft_options = draft_options
        if self.draft_options is not None and self.draft_cfg is None:
            raise ConfigError("draft options need a drafter (--draft)")
        if self.target_cfg.hybrid is not None and self.draft_options is not None \
                and self.draft_options.tree_budget is not None:
            # A tree's sibling rows would each advance the recurrent state from the same parent: the GDN layers
            # verify one path per sequence.
            raise ConfigError(f"{target}: a tree budget needs a target of attention layers only; this "
                              f"{self.target_cfg.hybrid.checkpoint_class} has recurrent (Gated DeltaNet) layers, "
                              f"which verify the drafter's single path: drop --tree-budget")
        self.tokenizer = load_tokenizer(target)
        if self.draft_cfg is not None:
            validate_pair(self.target_cfg, self.draft_cfg)
            self.draft_cfg = apply_draft_options(self.draft_cfg, self.draft_options or DraftOptions())
        if block_size is not None and block_size > 1 and self.draft_cfg is None:
            raise ConfigError(f"block size {block_size} needs a drafter (--draft)")
        self.block_size = block_size or (self.draft_cfg.block_size if self.draft_cfg else 1)  # 1 = autoregressive
        if max_num_batched_tokens < max_num_seqs * self.block_size:
            raise ConfigError(f"max_num_batched_tokens {max_num_batched_tokens} cannot hold {max_num_seqs} "
                              f"sequences of block {self.block_size}")
        self.backend = get_backend(backend, tuning)  # tuning: the cuda backend's (backends/tuning.py)
        tree = self.draft_options.tree_budget if self.draft_options is not None else None
        # Rows a decoding sequence computes per verify, and the lookahead slots it holds: its block, or its tree's
        # root and nodes (engine/tree.py), whichever is more.
        verify_rows = tree + 1 if tree is not None else self.block_size
        lookahead = max(self.block_size, verify_rows)
        self.runner = ModelRunner(self.target_cfg, self.draft_cfg, self.backend, max_block_size=lookahead,
                                  kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
                                  max_num_seqs=max_num_seqs, memory_utilization=memory_utilization,
                                  progress=progress, random_weights=random_weights, max_model_len=max_model_len,
                                  check_weights=check_weights, target_quant=self.target_quant,
                                  quantize=quantize, quantize_draft=quantize_draft,
                                  quantize_lm_head=quantize_lm_head, max_num_batched_tokens=max_num_batched_tokens,
                                  tensor_parallel_size=check_tensor_parallel(tensor_parallel_size, self.backend),
                                  num_state_snapshots=num_state_snapshots)
        self.runner.blocks.enable_prefix_caching = enable_prefix_caching
        proposer = make_proposer(self.runner, self.draft_options) if self.runner.draft is not None else None
        graphs = self.backend.name == "cuda" and not enforce_eager
        self.engine = self._make_step(proposer, graphs=graphs)
        # Plain decoding replayed from graphs queues each next step ahead: it needs a slot one position further on.
        ahead = self.engine.graphs is not None and self.engine.graphs.pipeline and self.block_size == 1
        self.scheduler = Scheduler(self.runner.blocks, verify_rows, max_num_seqs, max_num_batched_tokens,
                                   lookahead=lookahead + (1 if ahead else 0))
        self.eos_token_ids = set(self.target_cfg.eos_token_ids)
        self.admission = Admission(self.target_cfg, self.tokenizer, self.scheduler.lookahead, self.runner.blocks,
                                   self.max_model_len)
        self.requests: dict[int, Sequence] = {}  # every request added and not yet forgotten (result / stream end)
        self._abandoned: list[Sequence] = []  # requests of streams dropped unclosed, aborted at the next safe point
        self._next_id = 0
        self._lock = threading.RLock()  # see _serialized
        self._stepping = False  # inside step(): a step re-entered from inside one (a callback) is refused

    def _make_step(self, proposer: Proposer | None, graphs: bool) -> SpeculativeStep:
        """The engine's step; with `graphs`, its decode-only steps replay CUDA graphs that the engine owns."""
        phases = StepPhases(self.runner, proposer)
        if not graphs:
            return SpeculativeStep(phases)
        from cudflash.engine.cuda_graph import StepGraphs  # CuPy: only on the CUDA backend

        run_ahead = getattr(getattr(self.backend, "tuning", None), "run_ahead", True)
        return SpeculativeStep(phases, StepGraphs(phases, self.backend.graph_reserve, run_ahead))

    @property
    def speculative(self) -> bool:
        return self.block_size > 1

    @property
    def proposer(self) -> Proposer | None:
        """The drafter's proposer (DFlash / DFlash2 / DSpark); replaceable, e.g. by an oracle in tests."""
        return self.engine.proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        self.engine.set_proposer(proposer)

    # ---- requests
    @_serialized
    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it runs in the next steps alongside the others. Returns its request id. Every check
        happens here (cudflash.engine.admission): a request that is queued never makes a step raise."""
        ids, params = self.admission.admit(prompt, params)
        return self._queue(ids, params).seq_id

    @_serialized
    def _queue(self, ids: list[int], params: SamplingParams) -> Sequence:
        self._reap_abandoned()
        seq = Sequence(self._next_id, ids, params)
        self._next_id += 1
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq

    @_serialized
    def abort(self, request_id: int) -> None:
        """Finish a request with reason "abort" and free its KV blocks at once; a no-op for a finished or unknown
        id (a stream's request may have ended on its own)."""
        seq = self.requests.get(self._request_id(request_id))
        if seq is not None:
            self._abort(seq)

    @_serialized
    def _abort(self, seq: Sequence) -> None:
        if not seq.finished:
            self.scheduler.remove(seq)
            self._finish(seq, "abort")

    def _reap_abandoned(self) -> None:
        """Abort the requests of streams dropped unclosed (a finaliser only queues them here: it may run at any
        point, inside a step included, where changing the scheduler would not be safe)."""
        while self._abandoned:
            seq = self._abandoned.pop()
            self._abort(seq)
            self.requests.pop(seq.seq_id, None)

    @staticmethod
    def _request_id(request_id: object) -> int:
        return validate.integer(request_id, "request_id", what="a request id (an integer from add_request)")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping
    @_serialized
    def step(self) -> list[RequestOutput]:
        """One engine step: the new tokens (and text) of every request it advanced.

        If the step raises, no request is left half-stepped: each one the step touched is put back as it was
        before it (tokens, text, random stream) with its KV dropped, then, for an error (an Exception), finished
        with reason "error", or, for an interruption (KeyboardInterrupt and other BaseExceptions), queued again
        to recompute its history: it resumes exactly where it was. The exception propagates.

        Threads sharing the LLM take turns (see _serialized); a step re-entered from inside one (a callback that
        calls generate or pulls a stream) is refused, since the outer step's batch is half-built.
        """
        if self._stepping:
            raise RequestError("LLM.step() was re-entered from inside a running step (a callback called generate, "
                               "step or a stream): one step runs at a time")
        self._stepping = True
        try:
            return self._step_once()
        finally:
            self._stepping = False

    def _step_once(self) -> list[RequestOutput]:
        self._reap_abandoned()
        plan = self.scheduler.schedule()
        while plan.empty and self.scheduler.running:
            # Every running sequence is stuck prefilling on a full pool: free the youngest for the others.
            self.scheduler.preempt_youngest()
            plan = self.scheduler.schedule()
        if plan.empty:
            return []
        touched = [s for s, _ in plan.prefills] + plan.decodes
        marks = {s.seq_id: s.mark() for s in touched}
        outputs: list[RequestOutput] = []
        done: set[int] = set()
        try:
            self.engine.run(plan, self.block_size)
            for s in touched:
                out = self._collect(s, marks[s.seq_id].num_output)
                if out is not None:
                    outputs.append(out)
                done.add(s.seq_id)
        except BaseException as e:
            self._recover([s for s in touched if s.seq_id not in done], marks, failed=isinstance(e, Exception))
            raise
        return outputs

    def _collect(self, seq: Sequence, first_new: int) -> RequestOutput | None:
        """After a step: finish checks, text, and this step's output for the sequence (None: a prefill chunk
        that emitted nothing yet)."""
        if len(seq.output_ids) == first_new and not seq.finished:  # (a step may finish one with an error)
            return None
        visible = seq.text_visible
        self._check_finished(seq, first_new)
        if seq.finished:
            self.scheduler.remove(seq)
        return RequestOutput(seq.seq_id, seq.output_ids[first_new:],
                             seq.text[visible:seq.text_visible] if self.tokenizer else None,
                             seq.finished, seq.finish_reason)

    def _recover(self, seqs: list[Sequence], marks: dict[int, StepMark], failed: bool) -> None:
        """Undo a failed step for `seqs` (see `step`); the oldest requeued sequence ends first in line."""
        for s in sorted(seqs, key=lambda s: s.seq_id, reverse=True):
            s.restore(marks[s.seq_id])
            self.scheduler.remove(s)  # frees its blocks; num_cached = 0
            if failed:
                self._finish(s, "error")
            else:
                s.status = SequenceStatus.WAITING
                self.scheduler.waiting.appendleft(s)

    def _finish(self, seq: Sequence, reason: str) -> None:
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason

    def _check_finished(self, seq: Sequence, first_new: int) -> None:
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        for j in range(first_new, len(seq.output_ids)):
            if seq.output_ids[j] in stops and j < p.max_tokens:
                del seq.output_ids[j + 1:]
                self._finish(seq, "stop")
                break
        else:
            # The speculative loop keeps stepping until max_tokens tokens are in the KV cache (the pending
            # token does not count), exactly as the z-lab reference does, so tau matches published figures.
            if len(seq.output_ids) >= p.max_tokens + (1 if self.speculative else 0):
                del seq.output_ids[p.max_tokens:]
                self._finish(seq, "length")
        if self.tokenizer is not None:
            self._detokenize(seq, first_new)

    def _detokenize(self, seq: Sequence, first_new: int) -> None:
        """Extend seq.text by this step's tokens (decoding a short window, not the whole output), cut it at the
        first stop string that appeared, and move the visible end (Sequence.text_visible)."""
        delta, *offsets = self.tokenizer.decode_delta(seq.output_ids, *seq.detok_offsets, final=seq.finished)
        seq.detok_offsets = tuple(offsets)
        text = seq.text + delta
        found = [(at, stop) for stop in seq.params.stop
                 if (at := text.find(stop, max(0, len(seq.text) - len(stop)))) != -1]
        if found:
            at, stop = min(found)
            # Keep the fewest tokens whose text reaches the stop string; the stop string is not output.
            m = next((m for m in range(first_new + 1, len(seq.output_ids) + 1)
                      if stop in self.tokenizer.decode(seq.output_ids[:m])), len(seq.output_ids))
            del seq.output_ids[m:]
            text = text[:at]
            self._finish(seq, "stop")
        seq.text = text
        # Held back until more text shows it cannot start a stop string; a stop string is only ever found ending
        # in new text, so the cut above never reaches below the visible end.
        hold = 0 if seq.finished else max(map(len, seq.params.stop), default=1) - 1
        seq.text_visible = max(seq.text_visible, len(text) - hold)

    # ---- convenience
    def generate(self, prompts: str | list[int] | Seq[str | list[int]],
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[GenerationResult]:
        """Run prompts to completion, alongside whatever else is queued; results in the order of `prompts`.

        `prompts` is one prompt (a str, or a list of token ids) or a list of them; `params` one SamplingParams
        for all, or a list with one per prompt. Every request is checked before any is queued. If the call is
        interrupted or a step fails, its own requests are aborted and forgotten before the exception propagates.
        """
        batch = self._admit_batch(prompts, params)
        seqs = [self._queue(ids, sp) for ids, sp in batch]
        try:
            while not all(s.finished for s in seqs):
                self.step()
        except BaseException:
            for s in seqs:
                self._abort(s)
                self.requests.pop(s.seq_id, None)
            raise
        return [self.result(s.seq_id) for s in seqs]

    def _admit_batch(self, prompts: object, params: object) -> list[tuple[list[int], SamplingParams]]:
        single = params is None or isinstance(params, SamplingParams)
        if isinstance(prompts, str) or is_token_ids(prompts):
            prompts = [prompts]
        elif isinstance(prompts, np.ndarray):
            raise RequestError("prompts: an array must be 1-D integer token ids of one prompt, got "
                               f"{prompts.ndim}-D {prompts.dtype}")
        prompts = validate.sequence(prompts, "prompts", "a str, a list of token ids, or a list of those")
        if single:
            params = [params] * len(prompts)
        else:
            params = validate.sequence(params, "params", "a SamplingParams or a list of them (one per prompt)")
            if len(params) != len(prompts):
                raise RequestError(f"params: {len(prompts)} prompts but {len(params)} sampling params")
        return [self.admission.admit(p, sp, f"prompts[{i}]", "params" if single else f"params[{i}]")
                for i, (p, sp) in enumerate(zip(prompts, params))]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> RequestStream:
        """An iterator of RequestOutputs for one request: every token (and text delta) exactly once, whoever
        steps the engine meanwhile; the last one has `finished` set. Checked and queued now; closing the iterator
        (or leaving a `with` block) aborts the request."""
        ids, params = self.admission.admit(prompt, params)
        return RequestStream(self, self._queue(ids, params))

    @_serialized
    def _drain(self, seq: Sequence) -> RequestOutput | None:
        """What the request's own consumer has not been given yet; None when there is nothing new."""
        text_end = seq.text_visible if self.tokenizer is not None else 0
        if seq.tokens_delivered == len(seq.output_ids) and seq.text_delivered == text_end and \
                (seq.end_delivered or not seq.finished):
            return None
        out = RequestOutput(seq.seq_id, seq.output_ids[seq.tokens_delivered:],
                            seq.text[seq.text_delivered:text_end] if self.tokenizer is not None else None,
                            seq.finished, seq.finish_reason)
        seq.tokens_delivered, seq.text_delivered, seq.end_delivered = len(seq.output_ids), text_end, seq.finished
        return out

    @_serialized
    def result(self, request_id: int) -> GenerationResult:
        """The finished request's output; it is forgotten afterwards (call once per add_request)."""
        seq = self.requests.get(self._request_id(request_id))
        if seq is None:
            raise RequestError(f"request_id {validate.describe(request_id)}: no such request (never added, or its "
                               "result was already taken)")
        if not seq.finished:
            raise RequestError(f"request_id {seq.seq_id} is not finished yet: step() until it is, or abort() it")
        del self.requests[seq.seq_id]
        return GenerationResult(seq.prompt_ids, list(seq.output_ids), seq.text if self.tokenizer is not None else None,
                                seq.finish_reason, list(seq.acceptance_lengths))


    # ---- chat (templates and message checks: cudflash/chat.py)
    @cached_property
    def chat_template(self) -> ChatTemplate | None:
        """The target folder's chat template (None when it has none), read on first use."""
        return load_chat_template(self.target_cfg.path)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None,
                            chat_template_kwargs: dict | None = None, *, documents: list[dict] | None = None,
                            add_generation_prompt: bool = True, continue_final_message: bool = False) -> list[int]:
        """One conversation rendered by the model's chat template, as prompt token ids."""
        return chat_prompt_ids(self.target_cfg.path, self.chat_template, self.tokenizer, messages, tools,
                               chat_template_kwargs, documents, add_generation_prompt, continue_final_message)

    def chat(self, messages_or_conversations: list[dict] | list[list[dict]],
             params: SamplingParams | Seq[SamplingParams] | None = None, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[GenerationResult]:
        """Generate the assistant's reply to one conversation (a list of messages) or to several (a list of such
        lists); one result per conversation. Generation stops at the model's end-of-turn ids."""
        convs = messages_or_conversations
        if isinstance(convs, (list, tuple)) and convs and all(isinstance(c, (list, tuple)) for c in convs):
            conversations = list(convs)
        elif isinstance(convs, (list, tuple)) and convs and all(isinstance(m, dict) for m in convs):
            conversations = [convs]
        else:
            raise RequestError("chat: expected a conversation (a non-empty list of message objects) or a "
                               "non-empty list of conversations")
        prompts = [self._render_conversation(c, tools, chat_template_kwargs, i if len(conversations) > 1 else None)
                   for i, c in enumerate(conversations)]
        return self.generate(prompts, params)

    def _render_conversation(self, messages: list[dict], tools: list[dict] | None, kwargs: dict | None,
                             index: int | None) -> list[int]:
        """One of chat()'s conversations as prompt ids; with several, an error names which one it is about (the
        message index alone, "messages[0].role", would not say)."""
        try:
            return self.apply_chat_template(messages, tools, kwargs)
        except CudflashError as e:
            if index is None:
                raise
            raise type(e)(f"conversations[{index}]: {e}") from None


class RequestStream:
    """`LLM.stream`'s iterator. Dropping it unclosed aborts its request at the engine's next safe point."""

    def __init__(self, llm: LLM, seq: Sequence):
        self.llm, self.seq, self.closed = llm, seq, False

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> RequestOutput:
        while not self.closed:
            out = self.llm._drain(self.seq)
            if out is not None:
                if out.finished:
                    self.close()
                return out
            self.llm.step()
        raise StopIteration

    def close(self) -> None:
        """Abort the request (if still running) and forget it."""
        if not self.closed:
            self.closed = True
            self.llm._abort(self.seq)
            self.llm.requests.pop(self.seq.seq_id, None)

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "closed", True):
            self.llm._abandoned.append(self.seq)
