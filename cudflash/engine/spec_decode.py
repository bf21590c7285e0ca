"""One engine step: propose, then ONE target forward over every prefill chunk and every verify block, then
acceptance, then the drafter's context update for every newly committed row (DESIGN.md, "The speculative
step"; a graphed step updates every block row before acceptance, see cuda_graph.py). Plain autoregressive
decoding is the same step with block size 1 and no drafts.

Afterwards every sequence keeps the invariant of `Sequence`: positions below num_cached hold valid target KV
and drafter context K/V; a decoding sequence has exactly one pending token.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from cudflash.engine.model_runner import ModelRunner
from cudflash.engine.propose import DraftProposer, Proposal, Proposer, dflash_propose
from cudflash.engine.sampler import VerifyGroup, verify_tokens
from cudflash.engine.scheduler import StepPlan


def engine_step(runner: ModelRunner, plan: StepPlan, block: int, proposer: Proposer = dflash_propose,
                mark: Callable[[str], None] = lambda phase: None) -> None:
    """Advance every planned sequence; appends emitted tokens and acceptance lengths to the sequences.

    `mark(phase)` is called as each phase ends ("propose", "verify", "accept"): benchmarks put events there.
    A step with decodes only runs through CUDA graphs where the backend has them, for plain decoding and the
    package's proposers (dflash_propose, DraftProposer); any other proposer runs op by op.
    """
    speculative = block > 1 and runner.draft is not None
    graphed = (runner.graphs is not None and plan.decodes and not plan.prefills
               and runner.graphs.fits(len(plan.decodes))
               and (not speculative or proposer is dflash_propose or isinstance(proposer, DraftProposer)))
    if graphed:
        first_tokens, decode_emitted = [], _graphed_step(runner, plan.decodes, block if speculative else 1,
                                                         proposer, mark)
    else:
        first_tokens, decode_emitted = _eager_step(runner, plan, block, speculative, proposer, mark)

    for s, n in plan.prefills:
        s.num_cached += n
        runner.blocks.hash_committed(s)
    for s, tokens in first_tokens:
        s.output_ids.extend(tokens)  # a completed prompt's first token
    for s, tokens in zip(plan.decodes, decode_emitted):
        s.num_cached += len(tokens)  # the pending token and the accepted drafts are now committed
        s.acceptance_lengths.append(len(tokens))
        s.output_ids.extend(tokens)
        runner.blocks.trim(s, s.num_cached + 1)  # roll back: slots past the pending token are scratch again
        runner.blocks.hash_committed(s)
    mark("accept")


def _eager_step(runner: ModelRunner, plan: StepPlan, block: int, speculative: bool, proposer: Proposer,
                mark: Callable[[str], None]) -> tuple[list, list[list[int]]]:
    """Op by op: propose; ONE target forward over every prefill chunk and verify block; accept; drafter context."""
    b, decodes = runner.backend, plan.decodes
    proposal = Proposal([np.zeros(0, dtype=np.int64)] * len(decodes))
    if decodes and speculative:
        mask = runner.draft_cfg.mask_token_id
        draft_batch = runner.batch(decodes, [[s.last_token] + [mask] * (block - 1) for s in decodes],
                                   [s.num_cached for s in decodes])
        proposal = proposer(runner, draft_batch, decodes, block)
    mark("propose")

    # One target forward: prefill chunks first, then each decode's [pending token, drafts...].
    seqs = [s for s, _ in plan.prefills] + decodes
    ids = [[s.token_at(p) for p in range(s.num_cached, s.num_cached + n)] for s, n in plan.prefills]
    ids += [[s.last_token] + d.tolist() for s, d in zip(decodes, proposal.drafts)]
    batch = runner.batch(seqs, ids, [s.num_cached for s in seqs])
    hidden, taps = runner.target_forward(batch, with_taps=speculative)

    # Rows to score: the last row of a prefill that completes a fresh prompt, every row of a decode.
    groups, score_rows, context_rows = [], [], []
    cu = batch.meta.cu_seqlens_q
    for i, (s, n) in enumerate(plan.prefills):
        context_rows.extend(range(cu[i], cu[i] + n))
        if s.num_cached + n == s.prefill_end and not s.output_ids:
            groups.append(VerifyGroup(s, len(score_rows), np.zeros(0, dtype=np.int64)))
            score_rows.append(cu[i + 1] - 1)
    first_decode = len(plan.prefills)
    for j, s in enumerate(decodes):
        q = proposal.q[j] if proposal.q is not None else None
        groups.append(VerifyGroup(s, len(score_rows), proposal.drafts[j], q))
        score_rows.extend(range(cu[first_decode + j], cu[first_decode + j + 1]))
    logits = runner.logits(hidden, np.asarray(score_rows, dtype=np.int32)) if groups else None
    mark("verify")
    emitted = verify_tokens(b, logits, groups) if groups else []

    num_first = len(groups) - len(decodes)
    decode_emitted = emitted[num_first:]
    for j, tokens in enumerate(decode_emitted):  # the pending token and the accepted drafts are committed
        start = int(cu[first_decode + j])
        context_rows.extend(range(start, start + len(tokens)))
    if speculative and context_rows:
        runner.draft_context(taps, batch, np.asarray(context_rows, dtype=np.int32))
    return [(g.seq, t) for g, t in zip(groups[:num_first], emitted[:num_first])], decode_emitted


def _graphed_step(runner: ModelRunner, decodes: list, q: int, proposer: Proposer,
                  mark: Callable[[str], None]) -> list[list[int]]:
    """The same step for decodes only, as graph replays: propose, verify, one read-back, accept; the drafter's
    context update runs on the device meanwhile (cuda_graph.py). A DraftProposer's device part replays as the
    propose graph and its host part runs between it and the verify graph."""
    graphs, b = runner.graphs, runner.backend
    if q == 1:  # plain decoding, queued one step ahead
        targets, logits = graphs.decode(decodes, mark)
        groups = [VerifyGroup(s, i, np.zeros(0, dtype=np.int64)) for i, s in enumerate(decodes)]
        return verify_tokens(b, logits, groups, argmax=targets)
    mask = runner.draft_cfg.mask_token_id
    if proposer is dflash_propose:
        step, buf, slot = graphs.propose(decodes, q, mask)
        mark("propose")
        targets, drafts = graphs.verify(step, buf, slot)
        proposal = Proposal([d.astype(np.int64) for d in drafts])
    else:  # a DraftProposer: its device part is the propose graph, its host part runs before the verify graph
        step, buf, slot = graphs.propose(decodes, q, mask, proposer)
        proposal = proposer.host_part(runner, step.head_out, decodes, q)
        mark("propose")
        targets = graphs.verify_drafts(step, buf, slot, proposal.drafts)
    mark("verify")
    groups = [VerifyGroup(s, i * q, proposal.drafts[i], proposal.q[i] if proposal.q is not None else None)
              for i, s in enumerate(decodes)]
    return verify_tokens(b, step.logits, groups, argmax=targets.reshape(-1))
