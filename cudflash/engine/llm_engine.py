"""The public entry point: `LLM(target, draft=...)` and `generate`.

Requests are admitted while the KV pool can hold their worst case (prompt + max_tokens + one block of
lookahead), so a running sequence never runs out of blocks; finished sequences free theirs at once and
waiting ones are admitted in the next step.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence as Seq

from cudflash.backends import get_backend
from cudflash.config import load_draft_config, load_target_config, validate_pair
from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.sequence import Sequence, SequenceStatus
from cudflash.engine.spec_decode import Proposer, decode_step, dflash_propose, prefill, spec_step
from cudflash.errors import ConfigError, RequestError
from cudflash.sampling_params import SamplingParams
from cudflash.tokenizer import load_tokenizer


@dataclass(slots=True)
class GenerationResult:
    prompt_ids: list[int]
    token_ids: list[int]  # new tokens only
    text: str | None
    finish_reason: str  # "stop" | "length"
    acceptance_lengths: list[int] = field(default_factory=list)  # per step: accepted drafts + 1

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths) if self.acceptance_lengths else 0.0


class LLM:
    def __init__(self, target: str | Path, draft: str | Path | None = None, backend: str = "auto", *,
                 block_size: int | None = None, max_num_seqs: int = 64, kv_block_size: int = 16,
                 num_kv_blocks: int | None = None, memory_utilization: float = 0.9, progress: bool = False):
        self.target_cfg = load_target_config(target)
        self.draft_cfg = load_draft_config(draft) if draft is not None else None
        if self.draft_cfg is not None:
            validate_pair(self.target_cfg, self.draft_cfg)
        if block_size is not None and block_size < 1:
            raise ConfigError(f"block size must be >= 1, got {block_size}")
        if block_size is not None and block_size > 1 and self.draft_cfg is None:
            raise ConfigError(f"block size {block_size} needs a drafter (--draft)")
        default_block = self.draft_cfg.block_size if self.draft_cfg else 1
        self.block_size = block_size or default_block  # 1 = plain autoregressive decoding
        self.backend = get_backend(backend)
        self.max_num_seqs = max_num_seqs
        self.runner = ModelRunner(self.target_cfg, self.draft_cfg, self.backend, max_block_size=self.block_size,
                                  kv_block_size=kv_block_size, num_kv_blocks=num_kv_blocks,
                                  max_num_seqs=max_num_seqs, memory_utilization=memory_utilization,
                                  progress=progress)
        self.tokenizer = load_tokenizer(target)
        self.eos_token_ids = set(self.target_cfg.eos_token_ids)
        self.proposer: Proposer = dflash_propose  # replaceable, e.g. by an oracle in tests
        self._next_id = 0

    @property
    def speculative(self) -> bool:
        return self.block_size > 1

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

    def _make_sequence(self, prompt: str | list[int], params: SamplingParams) -> Sequence:
        ids = self._prompt_ids(prompt)
        limit = self.target_cfg.max_position_embeddings
        if len(ids) + params.max_tokens > limit:
            raise RequestError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the model's "
                f"max_position_embeddings ({limit})"
            )
        if self.runner.blocks.blocks_for(self._worst_case(len(ids), params)) > self.runner.blocks.num_blocks:
            raise RequestError(f"request of {len(ids)} + {params.max_tokens} tokens can never fit the KV pool")
        seq = Sequence(self._next_id, ids, params)
        self._next_id += 1
        return seq

    def _worst_case(self, prompt_len: int, params: SamplingParams) -> int:
        return prompt_len + params.max_tokens + self.block_size + 1

    # ---- generation
    def generate(self, prompts: Seq[str | list[int]] | str,
                 params: SamplingParams | Seq[SamplingParams] | None = None) -> list[GenerationResult]:
        if isinstance(prompts, str):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        if len(params) != len(prompts):
            raise RequestError(f"{len(prompts)} prompts but {len(params)} sampling params")
        seqs = [self._make_sequence(p, sp) for p, sp in zip(prompts, params)]
        self._run(seqs)
        return [self._result(s) for s in seqs]

    def _run(self, seqs: list[Sequence]) -> None:
        waiting, running = deque(seqs), []
        committed = 0  # blocks promised to running sequences' worst cases
        while waiting or running:
            admitted = []
            while waiting and len(running) + len(admitted) < self.max_num_seqs:
                need = self.runner.blocks.blocks_for(self._worst_case(len(waiting[0].prompt_ids), waiting[0].params))
                if committed + need > self.runner.blocks.num_blocks:
                    break
                committed += need
                admitted.append(waiting.popleft())
            if admitted:
                prefill(self.runner, admitted)
                for s in admitted:
                    s.status = SequenceStatus.RUNNING
                    self._check_finished(s, len(s.output_ids) - 1)
                running += admitted
            active = [s for s in running if not s.finished]
            if active:
                before = [len(s.output_ids) for s in active]
                if self.speculative:
                    spec_step(self.runner, active, self.block_size, self.proposer)
                else:
                    decode_step(self.runner, active)
                for s, n in zip(active, before):
                    self._check_finished(s, n)
            for s in [s for s in running if s.finished]:
                self.runner.blocks.free(s)
                committed -= self.runner.blocks.blocks_for(self._worst_case(len(s.prompt_ids), s.params))
                running.remove(s)

    def _check_finished(self, seq: Sequence, first_new: int) -> None:
        p = seq.params
        stops = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        for j in range(first_new, len(seq.output_ids)):
            if seq.output_ids[j] in stops and j < p.max_tokens:
                del seq.output_ids[j + 1:]
                seq.status, seq.finish_reason = SequenceStatus.FINISHED, "stop"
                return
        # The speculative loop keeps stepping until max_tokens tokens are in the KV cache (the pending bonus
        # token does not count), exactly as the z-lab reference does, so tau matches its published figures.
        limit = p.max_tokens + (1 if self.speculative else 0)
        if len(seq.output_ids) >= limit:
            del seq.output_ids[p.max_tokens:]
            seq.status, seq.finish_reason = SequenceStatus.FINISHED, "length"

    def _result(self, seq: Sequence) -> GenerationResult:
        text = self.tokenizer.decode(seq.output_ids) if self.tokenizer is not None else None
        return GenerationResult(seq.prompt_ids, list(seq.output_ids), text, seq.finish_reason or "length",
                                list(seq.acceptance_lengths))
