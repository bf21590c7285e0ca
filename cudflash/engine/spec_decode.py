"""The engine step, written once: propose, verify, accept, commit (plain decoding is the same step with one row per
sequence and no drafter).

Per decoding sequence with L committed tokens and a pending token t:
1. propose: the drafter's block [t, MASK x (q - 1)] at positions L .. L + q - 1 -> drafts (Proposer);
2. verify: ONE target forward over every prefill chunk and every [t, drafts] block -> float32 logits of the rows
   that need them -> their argmax (and the taps of `target_layer_ids` for the drafter);
3. accept (host): the longest prefix of drafts equal to the target's choices, and one target token;
4. commit: the drafter's context from the taps, and the KV cache rolled back to the committed tokens; on a hybrid
   target, the GDN states (which the verify left as they were) advance by the committed rows
   (ModelRunner.commit_states).

The phases' device work is three methods, `propose`, `verify` and `commit_context` (and, on a hybrid target, the
state commit after acceptance, `commit_states`): the eager path calls them on freshly staged inputs, and a CUDA graph
(cuda_graph.py) records exactly those calls over static inputs and replays them. Both stage through
step_inputs.fill. `run` is the one sequence of phases; `Eager` and `cuda_graph.StepGraphs` say only how each phase
executes.

Which rows update the drafter's context: every row of the target forward, before acceptance (`commit_context`).
The drafter's context K/V at a position is a function of the target's tap at that position alone, so the committed
rows (the pending token and the accepted drafts, a prefix of each block) get exactly the K/V an update after
acceptance would write, and the rows past them land at positions >= the new committed length: scratch, which the
next propose overwrites with its own block's K/V before anything reads them (its block starts at that length and
is at least as long). Updating before acceptance needs no second staging and lets the device run the update while
the host accepts.

Afterwards every sequence keeps the invariant of `Sequence`: positions below num_cached hold valid target KV and
drafter context K/V; a decoding sequence has exactly one pending token.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import numpy as np

from cudflash.engine.model_runner import CommitRun, ModelRunner
from cudflash.engine.proposal import HeadOutputs, HeadRows, Proposal, head_rows
from cudflash.engine.propose import Proposer
from cudflash.engine.sampler import VerifyGroup, verify_tokens
from cudflash.engine.scheduler import StepPlan
from cudflash.engine.sequence import Sequence, SequenceStatus
from cudflash.engine.step_inputs import Chunk, StepTensors, fill, layout_for
from cudflash.engine.tree import DraftTree, ancestor_masks, pack_bits, words_for

Mark = Callable[[str], None]


def _no_mark(phase: str) -> None:
    pass


@dataclass(slots=True)
class Verified:
    """What verification hands acceptance, on the host except the logits."""

    targets: np.ndarray  # int32 [R]: argmax of every scored row
    logits: Any  # float32 [R, V] on the backend (rows of sampled sequences are read from it)
    drafts: np.ndarray | None  # int64 [nd, q - 1]: the device part's drafts (drafts_on_device), else None
    score_first: list[int]  # per sequence of the batch: the index of its first row among the R


def completes_prompt(seq: Sequence, n: int) -> bool:
    """Whether a prefill chunk of n tokens is a fresh prompt's last: its last row's logits give the first token
    (a preempted sequence recomputing its history already holds its pending token)."""
    return seq.num_cached + n == seq.prefill_end and not seq.output_ids


def tree_chunk(seq: Sequence, tree: DraftTree, words: int, width: int | None = None) -> Chunk:
    """A decode's verify rows for its draft tree (engine/tree.py): the root and the nodes in storage order, then
    padding rows up to `width` (a CUDA graph's fixed width), each seeing the root and itself only. Padding rows take
    the slots after the tree's, inside the lookahead the scheduler reserves for a full tree: scratch, never read
    by a real row (no mask bit points at them) and past the committed length whatever the walk accepts."""
    start = seq.num_cached
    pad = 0 if width is None else width - 1 - tree.size
    masks = ancestor_masks(tree)
    if pad:
        masks = np.pad(masks, ((0, pad), (0, pad)))
        masks[tree.size + 1:, 0] = True
        np.fill_diagonal(masks, True)
    return Chunk(seq, start, [seq.last_token] + tree.tokens.tolist() + [seq.last_token] * pad,
                 [start] + (start + tree.depths).tolist() + [start] * pad, pack_bits(masks, words))


def decode_chunks(decodes: list[Sequence], q: int, mask: int, ahead: int = 0) -> list[Chunk]:
    """Each decode's block [pending token, MASK x (q - 1)], `ahead` positions past its committed length."""
    pad = [mask] * (q - 1)
    return [Chunk(s, s.num_cached + ahead, [s.last_token] + pad) for s in decodes]


class StepPhases:
    """The device work of the phases, over staged inputs: what the eager path runs and a CUDA graph records."""

    def __init__(self, runner: ModelRunner, proposer: Proposer | None):
        self.runner, self.b = runner, runner.backend
        self.proposer = proposer
        self._rows: dict[tuple[int, int], HeadRows] = {}

    def head_rows(self, n: int, q: int) -> HeadRows:
        """The proposer's index rows for n blocks of q rows; made outside any CUDA graph capture and kept."""
        key = (n, q)
        if key not in self._rows:
            self._rows[key] = head_rows(self.b, n, q, self.proposer.first_row)
        return self._rows[key]

    def propose(self, inp: StepTensors) -> HeadOutputs:
        """The proposer's device part over the decode blocks; drafts that are final go into the verify ids here."""
        out = self.proposer.device_part(self.runner, inp.draft_batch(self.b), inp.rows)
        if self.proposer.drafts_on_device:
            t = inp.layout.rows - inp.layout.draft_rows
            inp.verify_ids[...] = inp.ids
            inp.verify_ids[t:][inp.rows.verify] = out.drafts
        return out

    def verify(self, inp: StepTensors, speculative: bool) -> tuple[Any, Any, Any]:
        """(argmax int32 [R], float32 logits [R, V], taps [T, K H] or None) of the scored rows."""
        r = self.runner
        # Plain decoding commits every row it runs (the pending tokens): a hybrid's forward advances its states.
        hidden, taps = r.target_forward(inp.verify_batch(self.b), with_taps=speculative, commit=not speculative)
        if not inp.scores:  # prefill chunks that complete no prompt: the LM head over their rows would be waste
            return self.b.asarray(np.zeros(0, dtype=np.int32), "i32"), None, taps
        if inp.score_rows is not None:
            hidden = self.b.take_rows(hidden, inp.score_rows)
        logits = r.target.logits(hidden)
        return self.b.argmax(logits), logits, taps

    def commit_context(self, inp: StepTensors, taps: Any) -> None:
        """The drafter's context from every row of the target forward (the rule in the module docstring)."""
        self.runner.draft_context(taps, inp.verify_batch(self.b))

    def commit_states(self, inp: StepTensors, tape: Any, span: Any) -> None:
        """Hybrid targets: the GDN states of the verified sequences advance by the tape's rows in span (int32 [2, n]
        on the backend; ModelRunner.commit_tape). The eager path reaches the same call through
        ModelRunner.commit_states; a CUDA graph records this one and replays it with the counts acceptance gives."""
        self.runner.commit_tape(tape, inp.state_slots_device, span)


class Executor(Protocol):
    """How each phase of `SpeculativeStep.run` executes: `Eager`, or replays (cuda_graph.StepGraphs)."""

    def stage(self, plan: StepPlan, q: int, speculative: bool) -> Any: ...
    def propose(self, staged: Any) -> HeadOutputs: ...
    def stage_drafts(self, staged: Any, plan: StepPlan, proposal: Proposal) -> Any: ...
    def verify(self, staged: Any, speculative: bool, read_drafts: bool) -> Verified: ...
    # How the hybrid commit after acceptance runs for this step (None: the runner's op-by-op commit of its tape).
    def commit_run(self, staged: Any) -> CommitRun | None: ...


class GraphExecutor(Executor, Protocol):
    def takes(self, plan: StepPlan) -> bool: ...  # whether this step's shape replays
    def rebind(self, phases: StepPhases) -> None: ...  # new phases: what was captured for the old ones goes


class SpeculativeStep:
    def __init__(self, phases: StepPhases, graphs: GraphExecutor | None = None):
        self.phases, self.runner, self.b = phases, phases.runner, phases.b
        self.graphs = graphs
        self.eager = Eager(phases)

    @property
    def proposer(self) -> Proposer | None:
        return self.phases.proposer

    def set_proposer(self, proposer: Proposer | None) -> None:
        """A new proposer: the captured propose graphs and index rows belong to the old one, so they go."""
        self.phases = StepPhases(self.runner, proposer)
        self.eager = Eager(self.phases)
        if self.graphs is not None:
            self.graphs.rebind(self.phases)

    # ---- the step
    def run(self, plan: StepPlan, block: int, mark: Mark = _no_mark) -> None:
        """Advance every planned sequence: emitted tokens and acceptance lengths are appended to the sequences.
        `mark(phase)` is called as each phase ends ("propose", "verify", "accept"): benchmarks put events there."""
        speculative = block > 1 and self.runner.draft is not None and self.proposer is not None
        q = block if speculative else 1
        graphed = self.graphs is not None and self.graphs.takes(plan)
        exe: Executor = self.graphs if graphed else self.eager
        decodes = plan.decodes
        staged = exe.stage(plan, q, speculative)
        head = exe.propose(staged) if speculative and decodes else None
        proposal = None
        if head is not None and not self.proposer.drafts_on_device:
            proposal = self.proposer.host_part(self.runner, head, decodes, q)
            staged = exe.stage_drafts(staged, plan, proposal)
        mark("propose")
        out = exe.verify(staged, speculative, read_drafts=head is not None and proposal is None)
        mark("verify")
        if proposal is None:
            empty = np.zeros(0, dtype=np.int64)
            proposal = Proposal(list(out.drafts) if out.drafts is not None else [empty] * len(decodes))
        first, emitted = self.accept(plan, out, proposal)
        self.commit(plan, first, emitted, exe.commit_run(staged))
        mark("accept")

    def accept(self, plan: StepPlan, out: Verified, proposal: Proposal) -> tuple[list, list[list[int]]]:
        """(first tokens of prompts completed now, per decode: the tokens it emits). A sequence whose scored rows
        hold a non-finite logit (argmax -1) emits nothing: `commit` finishes it with an error."""
        groups, first_of = [], []
        for i, (s, n) in enumerate(plan.prefills):
            if completes_prompt(s, n):
                groups.append(VerifyGroup(s, out.score_first[i], np.zeros(0, dtype=np.int64)))
                first_of.append(s)
        base = len(plan.prefills)
        for j, s in enumerate(plan.decodes):
            q = proposal.q[j] if proposal.q is not None else None
            tree = proposal.trees[j] if proposal.trees is not None else None
            groups.append(VerifyGroup(s, out.score_first[base + j], proposal.drafts[j], q, tree))
        ok = [g for g in groups if (out.targets[g.first_row:g.first_row + len(g.drafts) + 1] >= 0).all()]
        tokens = dict(zip(map(id, ok), verify_tokens(self.b, out.logits, ok, argmax=out.targets))) if ok else {}
        emitted = [tokens.get(id(g), []) for g in groups]
        if proposal.trees is not None:
            self.compact([g for g in groups[len(first_of):] if g.path is not None])
        return list(zip(first_of, emitted[:len(first_of)])), emitted[len(first_of):]

    def compact(self, groups: list[VerifyGroup]) -> None:
        """Each tree's matched path: its nodes' K/V (target and drafter) move from their storage slots L + row to
        the slots of positions L + 1 .. L + a, where the next steps expect them (engine/tree.py)."""
        blocks, src, dst = self.runner.blocks, [], []
        for g in groups:
            at = g.seq.num_cached
            for depth, row in enumerate(g.path[1:], start=1):
                if row != depth:
                    src += blocks.slots(g.seq, at + row, 1)
                    dst += blocks.slots(g.seq, at + depth, 1)
        if src:
            r = self.runner
            src_i, dst_i = (self.b.asarray(np.asarray(x, dtype=np.int32), "i32") for x in (src, dst))
            for cache in (r.target_kv.k, r.target_kv.v, r.draft_kv.k, r.draft_kv.v):
                self.b.copy_slots(cache, src_i, dst_i)

    def commit(self, plan: StepPlan, first: list, emitted: list[list[int]], run: CommitRun | None = None) -> None:
        """The accepted tokens become committed; a sequence that emitted nothing (non-finite logits) finishes with
        an error, and its K/V of this step is never offered to the prefix cache. run: how the hybrid state commit
        executes (ModelRunner.commit_states)."""
        blocks = self.runner.blocks
        seqs = [s for s, _ in plan.prefills] + plan.decodes  # the verify batch's order
        before = [s.num_cached for s in seqs]
        failed = {s.seq_id for s, tokens in first if not tokens}
        failed |= {s.seq_id for s, tokens in zip(plan.decodes, emitted) if not tokens}
        for s, n in plan.prefills:
            s.num_cached += n
            if s.seq_id not in failed:
                blocks.hash_committed(s)
        for s, tokens in first:
            s.output_ids.extend(tokens)  # a completed prompt's first token
        for s in [s for s, _ in plan.prefills] + plan.decodes:
            if s.seq_id in failed:
                s.status, s.finish_reason = SequenceStatus.FINISHED, "error"
        for s, tokens in zip(plan.decodes, emitted):
            if not tokens:
                continue
            s.num_cached += len(tokens)  # the pending token and the accepted drafts are now committed
            s.acceptance_lengths.append(len(tokens))
            s.output_ids.extend(tokens)
            blocks.trim(s, s.num_cached + 1)  # roll back: slots past the pending token are scratch again
            blocks.hash_committed(s)
        # Hybrid targets: the verified sequences' GDN states advance by the rows they committed (prefill chunks
        # committed theirs in the forward), and states at the block boundaries passed become snapshots.
        self.runner.commit_states(seqs, [None] * len(plan.prefills) + [len(t) for t in emitted], before, run)


class Eager:
    """Each phase run now, op by op, on inputs staged for exactly this step's rows."""

    def __init__(self, phases: StepPhases):
        self.phases, self.b, self.runner = phases, phases.b, phases.runner

    def _stage(self, plan: StepPlan, decode: list[Chunk], drafting: bool, q: int) -> StepTensors:
        """Prefill chunks, then `decode`; the rows scored are a fresh prompt's last row and every decode row."""
        prefill = [Chunk(s, s.num_cached, s.token_ids[s.num_cached:s.num_cached + n]) for s, n in plan.prefills]
        score_rows: list[int] = []
        score_first: list[int] = []
        row = 0
        for (s, n), c in zip(plan.prefills, prefill):
            score_first.append(len(score_rows))
            row += len(c.ids)
            if completes_prompt(s, n):
                score_rows.append(row - 1)
        for c in decode:
            score_first.append(len(score_rows))
            score_rows.extend(range(row, row + len(c.ids)))
            row += len(c.ids)
        chunks, every = prefill + decode, not prefill
        r = self.runner
        layout = layout_for(chunks, len(decode) if drafting else 0, q if drafting else 0,
                            0 if every else len(score_rows), r.max_blocks, state_slots=r.hybrid)
        host = np.empty(layout.size, dtype=np.int32)
        longest = fill(host, layout, chunks, r.blocks.block_size, r.dummy_block, () if every else score_rows)
        inp = StepTensors(layout, host, self.b.asarray(host, "i32"), longest, score_first=score_first,
                          chunked_seqs=len(prefill), scores=every or bool(score_rows))
        if drafting:
            inp.verify_ids = self.b.zeros((layout.rows,), "i32")
            inp.rows = self.phases.head_rows(len(decode), q)
        return inp

    def stage(self, plan: StepPlan, q: int, speculative: bool) -> StepTensors:
        mask = self.runner.draft_cfg.mask_token_id if speculative else 0
        drafting = speculative and bool(plan.decodes)
        return self._stage(plan, decode_chunks(plan.decodes, q, mask), drafting, q)

    def propose(self, inp: StepTensors) -> HeadOutputs:
        return self.phases.propose(inp)

    def stage_drafts(self, inp: StepTensors, plan: StepPlan, proposal: Proposal) -> StepTensors:
        """The verify batch again, each decode holding exactly its drafts (a cut proposal verifies fewer rows), or its
        draft tree: the root and every node, at slots L .. L + N, positions L + depth, ancestor masks."""
        if proposal.trees is not None:
            words = words_for(max(t.size for t in proposal.trees))  # one mask width for the batch
            decode = [tree_chunk(s, t, words) for s, t in zip(plan.decodes, proposal.trees)]
        else:
            decode = [Chunk(s, s.num_cached, [s.last_token] + [int(t) for t in d])
                      for s, d in zip(plan.decodes, proposal.drafts)]
        return self._stage(plan, decode, False, 0)

    def commit_run(self, inp: StepTensors) -> CommitRun | None:
        return None  # the runner commits its last forward's tape op by op

    def verify(self, inp: StepTensors, speculative: bool, read_drafts: bool) -> Verified:
        targets, logits, taps = self.phases.verify(inp, speculative)
        if taps is not None:
            self.phases.commit_context(inp, taps)
        drafts = None
        if read_drafts:
            slots = inp.layout.q - 1
            drafts = self.b.to_numpy(inp.verify_ids[inp.layout.rows - inp.layout.draft_rows:]).astype(np.int64)
            drafts = drafts.reshape(-1, inp.layout.q)[:, 1:1 + slots]
        return Verified(self.b.to_numpy(targets), logits, drafts, inp.score_first)

