"""Prefill, the plain autoregressive step, and the DFlash speculative step (DESIGN.md, "The speculative step").

Every function advances a batch of running sequences by one engine step and keeps the bookkeeping invariant
of `Sequence`: afterwards `num_cached == num_tokens - 1` and the drafter context covers the same positions.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.sampler import accepted_prefix, choose_tokens
from cudflash.engine.sequence import Sequence
from cudflash.models.batch import ForwardBatch


def prefill(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """Whole prompts through the target (KV written, taps into the drafter's context); sample the first token."""
    for s in seqs:
        runner.blocks.reserve(s, len(s.prompt_ids))
    batch = runner.batch(seqs, [s.prompt_ids for s in seqs], [0] * len(seqs))
    hidden, taps = runner.target_forward(batch)
    last_rows = batch.meta.cu_seqlens_q[1:] - 1
    tokens = choose_tokens(runner.backend, runner.logits(hidden, last_rows), [s.params for s in seqs],
                           [s.rng for s in seqs])
    if runner.draft is not None:
        runner.draft_context(taps, batch)
    for s, t in zip(seqs, tokens):
        s.num_cached = len(s.prompt_ids)
        s.output_ids.append(int(t))


def decode_step(runner: ModelRunner, seqs: list[Sequence]) -> None:
    """Plain autoregressive decoding: one token per sequence."""
    for s in seqs:
        runner.blocks.reserve(s, s.num_cached + 1)
    batch = runner.batch(seqs, [[s.last_token] for s in seqs], [s.num_cached for s in seqs])
    hidden, _ = runner.target.forward(batch, runner.target_kv)
    tokens = choose_tokens(runner.backend, runner.logits(hidden), [s.params for s in seqs], [s.rng for s in seqs])
    for s, t in zip(seqs, tokens):
        s.num_cached += 1
        s.output_ids.append(int(t))
        s.acceptance_lengths.append(1)


def dflash_propose(runner: ModelRunner, batch: ForwardBatch, seqs: list[Sequence], block: int) -> np.ndarray:
    """Drafter forward over the block batch [last token, MASK x (block-1)]; argmax drafts [n, block-1]."""
    hidden = runner.draft_forward(batch)
    rows = (np.arange(len(seqs))[:, None] * block + np.arange(1, block)[None, :]).reshape(-1)
    drafts = runner.backend.to_numpy(runner.backend.argmax(runner.logits(hidden, rows)))
    return drafts.reshape(len(seqs), block - 1).astype(np.int64)


Proposer = Callable[[ModelRunner, ForwardBatch, list[Sequence], int], np.ndarray]


def spec_step(runner: ModelRunner, seqs: list[Sequence], block: int, proposer: Proposer = dflash_propose) -> None:
    """Propose, verify, accept, roll back; then the committed rows' taps become drafter context."""
    b = runner.backend
    for s in seqs:
        runner.blocks.reserve(s, s.num_cached + block)
    mask = runner.draft_cfg.mask_token_id
    batch = runner.batch(seqs, [[s.last_token] + [mask] * (block - 1) for s in seqs], [s.num_cached for s in seqs])
    drafts = proposer(runner, batch, seqs, block)
    # Verify: the same positions and slots (now in the target's cache), the drafts in place of the masks.
    ids = np.concatenate([np.concatenate([[s.last_token], d]) for s, d in zip(seqs, drafts)]).astype(np.int32)
    batch = ForwardBatch(b.asarray(ids, "i32"), batch.positions, batch.slots, batch.meta)
    hidden, taps = runner.target_forward(batch)
    row_params = [s.params for s in seqs for _ in range(block)]
    row_rngs = [s.rng for s in seqs for _ in range(block)]
    targets = choose_tokens(b, runner.logits(hidden), row_params, row_rngs).reshape(len(seqs), block)
    commit_rows = []
    for i, s in enumerate(seqs):
        a = accepted_prefix(drafts[i], targets[i])
        commit_rows.extend(range(i * block, i * block + a + 1))  # the anchor and the accepted drafts
        s.output_ids.extend(int(t) for t in drafts[i, :a])
        s.output_ids.append(int(targets[i, a]))
        s.num_cached += a + 1
        s.acceptance_lengths.append(a + 1)
    runner.draft_context(taps, batch, np.asarray(commit_rows, dtype=np.int32))
    for s in seqs:
        runner.blocks.trim(s, s.num_cached)  # roll back: slots past the pending token are scratch again
