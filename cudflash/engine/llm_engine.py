"""The public entry point: `LLM(target, draft=...)`, with `generate`, `stream`, and the step-level API
(`add_request`, `step`, `abort`) that both are built on.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Sequence as Seq

from cudflash.backends import CudaTuning, get_backend
from cudflash.config import load_target_config
from cudflash.draft_config import DraftOptions, apply_draft_options, load_draft_config, validate_pair
from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.scheduler import Scheduler
from cudflash.engine.sequence import Sequence, SequenceStatus
from cudflash.engine.propose import Proposer, make_proposer
from cudflash.engine.spec_decode import SpeculativeStep, StepPhases
from cudflash.errors import ConfigError, RequestError
from cudflash.sampling_params import SamplingParams
from cudflash.tokenizer import load_tokenizer


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str | None
    finish_reason: str  # "stop" | "length" | "abort"
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
                 tuning: CudaTuning | dict | None = None):
        self.target_cfg = load_target_config(target)
        self.draft_cfg = load_draft_config(draft) if draft is not None else None
        # Drafting choices (sliding-window override, DSpark confidence cut / adaptive verify): lossless, off by default.
        self.draft_options = DraftOptions(**draft_options) if isinstance(draft_options, dict) else draft_options
        if self.draft_options is not None and self.draft_cfg is None:
            raise ConfigError("draft options need a drafter (--draft)")
        if self.draft_cfg is not None:
            validate_pair(self.target_cfg, self.draft_cfg)
            self.draft_cfg = apply_draft_options(self.draft_cfg, self.draft_options or DraftOptions())
        if block_size is not None and block_size < 1:
            raise ConfigError(f"block size must be >= 1, got {block_size}")
        if block_size is not None and block_size > 1 and self.draft_cfg is None:
            raise ConfigError(f"block size {block_size} needs a drafter (--draft)")
        self.block_size = block_size or (self.draft_cfg.block_size if self.draft_cfg else 1)  # 1 = autoregressive
        if max_num_batched_tokens < max_num_seqs * self.block_size:
            raise ConfigError(f"max_num_batched_tokens {max_num_batched_tokens} cannot hold {max_num_seqs} "
                              f"sequences of block {self.block_size}")
        self.backend = get_backend(backend, tuning)  # tuning: the cuda backend's (backends/tuning.py)
        tree = self.draft_options.tree_budget if self.draft_options is not None else None
        if tree is not None and self.backend.name != "cpu":
            raise ConfigError("tree verification (tree_budget) runs on the cpu backend only, for now")
        # Rows a decoding sequence computes per verify, and the lookahead slots it holds: its block, or its tree's
        # root and nodes (engine/tree.py), whichever is more.
        verify_rows = tree + 1 if tree is not None else self.block_size
        lookahead = max(self.block_size, verify_rows)
        self.runner = ModelRunner(self.target_cfg, self.draft_cfg, self.backend, max_block_size=lookahead,
                                  kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
                                  max_num_seqs=max_num_seqs, memory_utilization=memory_utilization,
                                  progress=progress, random_weights=random_weights)
        self.runner.blocks.enable_prefix_caching = enable_prefix_caching
        proposer = make_proposer(self.runner, self.draft_options) if self.runner.draft is not None else None
        self.engine = self._make_step(proposer, graphs=self.backend.name == "cuda" and not enforce_eager)
        # Plain decoding replayed from graphs queues each next step ahead: it needs a slot one position further on.
        ahead = self.engine.graphs is not None and self.engine.graphs.pipeline and self.block_size == 1
        self.scheduler = Scheduler(self.runner.blocks, verify_rows, max_num_seqs, max_num_batched_tokens,
                                   lookahead=lookahead + (1 if ahead else 0))
        self.tokenizer = load_tokenizer(target)
        self.eos_token_ids = set(self.target_cfg.eos_token_ids)
        self.requests: dict[int, Sequence] = {}
        self._next_id = 0

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
    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    f"text prompt given but no tokenizer is available for {self.target_cfg.path} "
                    "(needs tokenizer.json and `pip install tokenizers`); pass token ids instead"
                )
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(i) for i in prompt]
        if not ids:
            raise RequestError("empty prompt")
        vocab = self.target_cfg.vocab_size
        bad = next((i for i in ids if not 0 <= i < vocab), None)
        if bad is not None:
            raise RequestError(f"prompt token id {bad} outside the vocabulary (0..{vocab - 1})")
        return ids

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None) -> int:
        """Queue a request; it runs in the next steps alongside the others. Returns its request id."""
        params = params or SamplingParams()
        ids = self._prompt_ids(prompt)
        limit = self.target_cfg.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        worst = len(ids) + params.max_tokens + self.scheduler.lookahead + 1
        if self.runner.blocks.blocks_for(worst) > self.runner.blocks.num_blocks:
            raise RequestError(f"request of {len(ids)} + {params.max_tokens} tokens can never fit the KV pool "
                               f"({self.runner.blocks.num_blocks} blocks of {self.runner.blocks.block_size})")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer (tokenizer.json and `pip install tokenizers`)")
        seq = Sequence(self._next_id, ids, params)
        self._next_id += 1
        self.requests[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def abort(self, request_id: int) -> None:
        seq = self.requests.get(request_id)
        if seq is not None and not seq.finished:
            self.scheduler.remove(seq)
            self._finish(seq, "abort")

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ---- stepping
    def step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        while plan.empty and self.scheduler.running:
            # Every running sequence is stuck prefilling on a full pool: free the youngest for the others.
            self.scheduler.preempt_youngest()
            plan = self.scheduler.schedule()
        if plan.empty:
            return []
        touched = [s for s, _ in plan.prefills] + plan.decodes
        before = {s.seq_id: len(s.output_ids) for s in touched}
        self.engine.run(plan, self.block_size)
        outputs = []
        for s in touched:
            n = before[s.seq_id]
            if len(s.output_ids) == n:
                continue  # a prefill chunk that emitted nothing yet
            text_before = s.text
            self._check_finished(s, n)
            outputs.append(RequestOutput(s.seq_id, s.output_ids[n:], s.text[len(text_before):]
                                         if self.tokenizer else None, s.finished, s.finish_reason))
            if s.finished:
                self.scheduler.remove(s)
        return outputs

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
        """Extend seq.text by this step's tokens (decoding a short window, not the whole output), then cut at a
        stop string if one appeared."""
        delta, *offsets = self.tokenizer.decode_delta(seq.output_ids, *seq.detok_offsets, final=seq.finished)
        seq.detok_offsets = tuple(offsets)
        text = seq.text + delta
        for stop in seq.params.stop:
            at = text.find(stop, max(0, len(seq.text) - len(stop)))
            if at != -1:
                # Keep the fewest tokens whose text reaches the stop string; the stop string is not output.
                m = next(m for m in range(first_new + 1, len(seq.output_ids) + 1)
                         if stop in self.tokenizer.decode(seq.output_ids[:m]))
                del seq.output_ids[m:]
                text = text[:at]
                self._finish(seq, "stop")
                break
        seq.text = text

    # ---- convenience
    def generate(self, prompts: Seq[str | list[int]] | str,
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids: list[int] = []
        try:
            for p, sp in zip(prompts, params):
                ids.append(self.add_request(p, sp))
        except Exception:  # a bad request: none of this call's requests may stay queued
            for i in ids:
                self.abort(i)
                self.requests.pop(i)
            raise
        while any(not self.requests[i].finished for i in ids):
            self.step()
        return [self.result(i) for i in ids]

    def stream(self, prompt: str | list[int], params: SamplingParams | None = None) -> Iterator[RequestOutput]:
        """Yield each step's new tokens (and text delta) for one request; closing the iterator aborts it."""
        request_id = self.add_request(prompt, params)
        try:
            while not self.requests[request_id].finished:
                for out in self.step():
                    if out.request_id == request_id:
                        yield out
        finally:
            self.abort(request_id)
            self.requests.pop(request_id)

    def result(self, request_id: int) -> GenerationResult:
        """The finished request's output; it is forgotten afterwards (call once per add_request)."""
        seq = self.requests.pop(request_id)
        text = seq.text if self.tokenizer is not None else None
        return GenerationResult(seq.prompt_ids, list(seq.output_ids), text, seq.finish_reason or "length",
                                list(seq.acceptance_lengths))
