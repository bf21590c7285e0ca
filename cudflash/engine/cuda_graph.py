"""CUDA graphs for the steady state: every running sequence decoding, no prefill in the step.

`StepGraphs` executes the phases of spec_decode.SpeculativeStep.run as graph replays. Per (padded batch, block
width, context bucket) it records, lazily, exactly the calls the eager path makes (StepPhases.propose, .verify and
.commit_context) over static inputs: one packed int32 buffer in step_inputs.py's layout, staged each step from
page-locked memory with ONE asynchronous copy on the graphs' stream (ordered behind the previous step's graphs,
which read it, without the host waiting for them). Padded sequences use the dummy KV block and slot -1.

The targets (and, for drafts made on the device, the verify ids holding them) go back to page-locked host memory;
the context graph is queued behind that copy, so the device updates the drafter's context while the host accepts.
Drafts proposed on the host (the DFlash2 selector walk, DSpark confidence cuts) are written into the verify ids
between the propose and verify graphs; a cut draft leaves masks in the rows it dropped (a graph's shape is fixed),
which acceptance never reads. A draft tree (engine/tree.py) is verified over other rows than the block it was
proposed from: its propose graph is captured alone, and the tree, padded to the budget's width (spec_decode.tree_chunk),
is staged into a buffer of its own, whose verify and context graphs are captured per (padded batch, context bucket).

Plain decoding (block width 1, every sequence greedy) runs one step ahead: while the host waits for step k's tokens
and accepts them, step k + 1 is already queued, staged one position further on with its pending tokens copied on the
device from step k's argmax, so the device never idles on the host's staging, launch, read-back and bookkeeping.
The next step takes the queued one only if its sequences are exactly the predicted ones (same objects, each one
token further, the same cache blocks); otherwise the queued step is dropped. A dropped step did no harm: it wrote
K/V only at the slot of position num_cached + 1 of its own sequences (scratch until committed, and written again by
whichever step computes that position before anything reads it), and anything that reuses those blocks later is
ordered after it on the stream. The scheduler reserves that slot (Scheduler's lookahead).

Hybrid (Gated DeltaNet) targets: the state slots are staged in the packed buffer too (padding sequences -1), and
a speculative step's verify graph leaves the states as they were and keeps its tape (models/hybrid.py). After
acceptance a commit graph, recorded per captured step over that tape, advances each sequence's state by the rows it
accepted: the counts travel as a span (int32 [2, n]: rows already committed | rows to commit) in one asynchronous
copy from page-locked memory into a device buffer the graph reads. A commit crossing a prefix-cache block boundary
is two replays with the snapshot copy between them (ModelRunner.commit_states), as op by op. Plain decoding commits
every row it runs (each is a sequence's pending token), so its forward advances the states itself: no tape, no
commit graph, and its warm-up before capture runs with the state slots masked (`_states_untouched`). It still does
not run ahead on a hybrid: a queued step that is dropped would have advanced its sequences' states in place.

Rules kept here: every buffer a graph touches is allocated before capture or during capture from a memory pool
private to that step's graphs, and is kept alive with them (graphs of two steps sharing a pool overwrite each
other's live outputs); each shape is run once eagerly before capture so that kernels are compiled and cuBLAS has
chosen its algorithms (the warm-ups write the KV slots the replay writes next, with the same values); nothing inside
a capture copies between host and device or synchronises (nor the cycle collector, whose frees of earlier
engines' memory would: graph_capture.py).

Memory: a captured step keeps its pool (float32 logits [padded batch x block, V] and the forward's activations:
hundreds of MB for an 8B target at batch 32) for as long as it lives, and the context and batch buckets can take
many values over a long run. Captured steps therefore live in an LRU cache bounded by `max_bytes` (the backend's
graph reserve, which the KV cache budget leaves free); a step evicted is captured again if needed.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import cupy
import numpy as np

from cudflash.backends.cuda_attention import batch_bucket, context_bucket
from cudflash.engine.graph_capture import capture
from cudflash.engine.model_runner import CommitRun
from cudflash.engine.proposal import HeadOutputs, HeadRows, Proposal
from cudflash.engine.scheduler import StepPlan
from cudflash.engine.sequence import Sequence
from cudflash.engine.spec_decode import StepPhases, Verified, decode_chunks, tree_chunk
from cudflash.engine.step_inputs import Chunk, StepLayout, StepTensors, fill
from cudflash.engine.tree import DraftTree, words_for
from cudflash.models.hybrid import commit_span


def pinned_int32(size: int) -> np.ndarray:
    """A host int32 array in page-locked memory, so that a copy into it is asynchronous DMA."""
    memory = cupy.cuda.alloc_pinned_memory(max(1, size) * 4)
    return np.frombuffer(memory, dtype=np.int32, count=size)  # its base keeps `memory` alive


@dataclass
class HostSlot:
    """Page-locked staging memory for one step in flight. Two per StepBuffers, used in turn, so that plain decoding
    can stage step k + 1 while step k's copies may still be pending; a slot is written again only after the
    read-back of the last step that used it has landed (`done`)."""

    host_in: np.ndarray  # int32 [layout.size]: the packed inputs
    host_out: np.ndarray  # int32 [2 n q]: targets | the verify ids (drafts made on the device)
    verify_in: np.ndarray  # int32 [n q]: verify ids of drafts proposed on the host
    done: cupy.cuda.Event  # recorded behind the read-back of the last step that used this slot


@dataclass
class StepBuffers:
    """Static inputs of one (padded batch n, block width q): every replay of its graphs reads these."""

    layout: StepLayout
    device: cupy.ndarray  # int32 [layout.size]: the packed inputs (step_inputs.py)
    verify_ids: cupy.ndarray | None  # int32 [n q]: ids with the drafts in place of the masks (drafting only)
    rows: HeadRows | None  # the proposer's index rows (drafting only)
    host: list[HostSlot]  # two, used in turn
    span: cupy.ndarray | None = None  # int32 [2, n]: the commit graphs' rows (hybrid targets only)
    host_span: list[tuple[np.ndarray, cupy.cuda.Event]] = field(default_factory=list)  # [2, n] pinned, copied-out
    turn: int = 0
    span_turn: int = 0

    @property
    def n(self) -> int:
        return self.layout.seqs

    @property
    def q(self) -> int:
        return self.layout.rows // self.layout.seqs

    def take_span(self) -> np.ndarray:
        """Page-locked memory for the next commit run's span (two, used in turn: a step's two runs are both pending
        at once), once the copy out of it last time has landed; `span_copied` records that copy."""
        host, copied = self.host_span[self.span_turn]
        copied.synchronize()
        return host

    def span_copied(self, stream: cupy.cuda.Stream) -> None:
        self.host_span[self.span_turn][1].record(stream)
        self.span_turn ^= 1

    def take_slot(self) -> HostSlot:
        """The next host slot, once the last step that used it has copied its outputs back."""
        slot = self.host[self.turn]
        self.turn ^= 1
        slot.done.synchronize()
        return slot

    def tensors(self, host: np.ndarray, ctx_bucket: int) -> StepTensors:
        """The static inputs as the phases take them, for a replay of up to `ctx_bucket` keys per sequence."""
        return StepTensors(self.layout, host, self.device, ctx_bucket, verify_ids=self.verify_ids, rows=self.rows)


@dataclass
class CapturedStep:
    propose_graph: Any | None  # cupy.cuda.Graph of StepPhases.propose (drafting only)
    verify_graph: Any | None  # cupy.cuda.Graph of StepPhases.verify (None: a draft tree's block, proposed only)
    context_graph: Any | None  # cupy.cuda.Graph of StepPhases.commit_context (drafting only)
    commit_graph: Any | None  # cupy.cuda.Graph of StepPhases.commit_states over the verify's tape (hybrid only)
    head_out: HeadOutputs | None  # the propose graph's outputs
    targets: cupy.ndarray | None  # int32 [n q]: argmax of every verify row
    logits: cupy.ndarray | None  # float32 [n q, V]
    pool: Any  # cupy.cuda.MemoryPool private to this step's graphs
    keep: list[Any] = field(default_factory=list)  # everything else the graphs reference

    @property
    def nbytes(self) -> int:
        return self.pool.total_bytes()

    def release(self) -> None:
        """Drop the graphs and everything they reference, then hand the pool's memory back to the device."""
        self.propose_graph = self.verify_graph = self.context_graph = self.commit_graph = None
        self.head_out = self.targets = self.logits = None
        self.keep.clear()
        self.pool.free_all_blocks()


@dataclass
class Staged:
    """One step's inputs on the graphs' stream, and what it was staged for."""

    seqs: list[Sequence]
    rows: list[tuple[int, int]]  # per sequence: (position of its first row, cache block of that position)
    buf: StepBuffers
    slot: HostSlot
    step: CapturedStep
    launched: bool = False  # its verify graph is queued (a plain decoding step queued ahead)

    @staticmethod
    def rows_of(seqs: list[Sequence], ahead: int, block_size: int) -> list[tuple[int, int]]:
        return [(s.num_cached + ahead, s.block_table[(s.num_cached + ahead) // block_size]) for s in seqs]

    def matches(self, seqs: list[Sequence], block_size: int) -> bool:
        """Whether this step is the decode of exactly `seqs` as they stand now."""
        return len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs)) \
            and self.rows_of(seqs, 0, block_size) == self.rows


@contextmanager
def _states_untouched(inp: StepTensors) -> Iterator[None]:
    """Within: every staged state slot is -1, which every GDN op skips (no state read or written). The eager
    warm-up of a forward that commits the states (plain decoding on a hybrid) runs so; on the staged slots it would
    advance them once before the first replay advances them again. Its other writes are the verify's usual scratch
    (K/V at the slots the replay writes next)."""
    slots = inp.state_slots_device
    saved = slots.copy()
    slots.fill(-1)
    try:
        yield
    finally:
        slots[...] = saved


class StepGraphs:
    def __init__(self, phases: StepPhases, max_bytes: int, run_ahead: bool = True):
        self.phases = phases
        runner = phases.runner
        self.blocks, self.max_blocks, self.dummy_block = runner.blocks, runner.max_blocks, runner.dummy_block
        self.max_bytes = max_bytes
        self.stream = cupy.cuda.get_current_stream()
        self.buffers: dict[tuple[int, int, int], StepBuffers] = {}  # (n, q, tree words)
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()  # LRU first; keys: StepGraphs._step_for
        self.num_captures = 0
        self.hybrid = runner.hybrid
        # Plain decoding queues the next step before waiting for this one; never on a hybrid (module docstring).
        self.pipeline = run_ahead and not self.hybrid
        self.pending: Staged | None = None  # the step queued ahead
        self.num_run_ahead = 0  # decode steps that found themselves already queued
        self.num_replays = 0  # steps whose verification replayed a graph

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps.values())

    def takes(self, plan: StepPlan) -> bool:
        return bool(plan.decodes) and not plan.prefills and batch_bucket(len(plan.decodes)) is not None

    def rebind(self, phases: StepPhases) -> None:
        """Serve other phases (a new proposer): every captured step and index row belongs to the old ones."""
        self.stream.synchronize()
        for step in self.steps.values():
            step.release()
        self.steps.clear()
        self.buffers.clear()
        self.pending = None
        self.phases = phases

    # ---- staging
    def _buffers(self, n: int, q: int, drafting: bool, tree_words: int = 0) -> StepBuffers:
        key = (n, q, tree_words)
        if key not in self.buffers:
            layout = StepLayout(n * q, n, n if drafting else 0, q if drafting else 0, 0, self.max_blocks, tree_words,
                                state_slots=self.hybrid)
            slots = [HostSlot(pinned_int32(layout.size), pinned_int32(2 * n * q), pinned_int32(n * q),
                              cupy.cuda.Event(disable_timing=True)) for _ in range(2)]
            buf = StepBuffers(layout, cupy.zeros(layout.size, dtype=cupy.int32),
                              cupy.zeros(n * q, dtype=cupy.int32) if drafting else None,
                              self.phases.head_rows(n, q) if drafting else None, slots)
            if self.hybrid:
                buf.span = cupy.zeros((2, n), dtype=cupy.int32)
                buf.host_span = [(pinned_int32(2 * n).reshape(2, n), cupy.cuda.Event(disable_timing=True))
                                 for _ in range(2)]
            self.buffers[key] = buf
        return self.buffers[key]

    def _stage(self, seqs: list[Sequence], q: int, mask: int, drafting: bool, ahead: int = 0) -> Staged:
        n = batch_bucket(len(seqs))
        buf = self._buffers(n, q, drafting)
        chunks = decode_chunks(seqs, q, mask, ahead)
        # A tree's block is only proposed from here: its verification is staged with the tree (_stage_trees).
        parts = ("propose",) if drafting and self.trees else ("propose", "verify") if drafting else ("verify",)
        return self._stage_chunks(seqs, buf, chunks, mask, parts, ahead)

    def _stage_chunks(self, seqs: list[Sequence], buf: StepBuffers, chunks: list[Chunk], mask: int,
                      parts: tuple[str, ...], ahead: int = 0) -> Staged:
        slot = buf.take_slot()
        chunks = chunks + [Chunk(None, 0, [mask] * buf.q)] * (buf.n - len(seqs))
        longest = fill(slot.host_in, buf.layout, chunks, self.blocks.block_size, self.dummy_block)
        self._copy(slot.host_in, buf.device, cupy.cuda.runtime.memcpyHostToDevice)  # one copy of all of it
        step = self._step_for(buf, slot, context_bucket(longest), parts)
        return Staged(list(seqs), Staged.rows_of(seqs, ahead, self.blocks.block_size), buf, slot, step)

    @property
    def trees(self) -> bool:
        return getattr(self.phases.proposer, "budget", None) is not None

    def _stage_trees(self, st: Staged, trees: list[DraftTree]) -> Staged:
        """The verify batch of draft trees: each decode's root and nodes, padded to the budget's width."""
        width = self.phases.proposer.budget + 1
        words = words_for(width - 1)
        buf = self._buffers(st.buf.n, width, False, words)
        chunks = [tree_chunk(s, t, words, width) for s, t in zip(st.seqs, trees)]
        return self._stage_chunks(st.seqs, buf, chunks, self.phases.runner.draft_cfg.mask_token_id,
                                  ("verify", "taps"))

    def stage(self, plan: StepPlan, q: int, speculative: bool) -> Staged:
        pending, self.pending = self.pending, None
        if q == 1 and pending is not None and pending.matches(plan.decodes, self.blocks.block_size):
            self.num_run_ahead += 1
            return pending
        mask = self.phases.runner.draft_cfg.mask_token_id if speculative else 0
        return self._stage(plan.decodes, q, mask, speculative)

    # ---- capture
    def _graph(self, fn, *args, warm_up: AbstractContextManager = nullcontext()):
        """Run fn once eagerly (compiles kernels, lets cuBLAS choose its algorithms) within `warm_up`, then capture
        it."""
        with warm_up:
            fn(*args)
        graph, out = capture(self.stream, fn, *args)
        graph.upload(self.stream)
        return graph, out

    def _capture(self, buf: StepBuffers, slot: HostSlot, ctx_bucket: int, parts: tuple[str, ...]) -> CapturedStep:
        """The graphs of `parts`: "propose" (the drafter over the decode blocks), "verify" (the target forward; with
        a drafter, also the drafter's context from its taps). A block is proposed and verified in one captured step;
        a tree's block is proposed in one and the tree verified in another ("verify", "taps")."""
        inp = buf.tensors(slot.host_in, ctx_bucket)
        p = self.phases
        drafting = "propose" in parts
        taps_wanted = drafting or "taps" in parts
        # A private pool per captured step: its graphs replay in the order they were captured, so they may share
        # memory with each other, but never with another step's graphs (whose outputs stay alive).
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            propose_graph = head_out = context_graph = verify_graph = commit_graph = targets = logits = taps = None
            tape = None
            if drafting:
                propose_graph, head_out = self._graph(p.propose, inp)
            if "verify" in parts:
                # Plain decoding's forward commits the GDN states: its warm-up must not advance them.
                warm_up = _states_untouched(inp) if self.hybrid and not taps_wanted else nullcontext()
                verify_graph, (targets, logits, taps) = self._graph(p.verify, inp, taps_wanted, warm_up=warm_up)
                tape, p.runner.tape = p.runner.tape, None  # the captured forward's: only the commit graph reads it
            if taps is not None:
                context_graph, _ = self._graph(p.commit_context, inp, taps)
            if tape is not None:
                # The warm-up run before the capture commits nothing: every count of the span is 0.
                buf.span.fill(0)
                commit_graph, _ = self._graph(p.commit_states, inp, tape, buf.span)
        self.num_captures += 1
        return CapturedStep(propose_graph, verify_graph, context_graph, commit_graph, head_out, targets, logits,
                            pool, keep=[taps, inp, tape])

    def _step_for(self, buf: StepBuffers, slot: HostSlot, ctx_bucket: int, parts: tuple[str, ...]) -> CapturedStep:
        """The captured step of this shape, captured now if new (evicting the least recently used past the bound)."""
        key = (buf.n, buf.q, buf.layout.tree_words, ctx_bucket, parts)
        if key not in self.steps:
            self.steps[key] = self._capture(buf, slot, ctx_bucket, parts)
            while len(self.steps) > 1 and self.nbytes > self.max_bytes:
                _, old = self.steps.popitem(last=False)
                self.stream.synchronize()  # a step queued ahead may still be running on the graphs released here
                old.release()
        self.steps.move_to_end(key)
        return self.steps[key]

    # ---- the phases, replayed
    def propose(self, st: Staged) -> HeadOutputs:
        st.step.propose_graph.launch(self.stream)
        if st.step.verify_graph is None:  # a tree's block: nothing else reads this slot's staging
            st.slot.done.record(self.stream)
        return st.step.head_out

    def stage_drafts(self, st: Staged, plan: StepPlan, proposal: Proposal) -> Staged:
        """Write [pending token, drafts] of drafts proposed on the host into the verify ids (masks in the rows of
        drafts a cut dropped), or stage the draft trees' verification."""
        if proposal.trees is not None:
            return self._stage_trees(st, proposal.trees)
        q, ids = st.buf.q, st.slot.verify_in
        ids[:] = st.slot.host_in[:st.buf.n * q]  # [pending token, MASK x (q - 1)] per sequence, as staged
        for i, d in enumerate(proposal.drafts):
            ids[i * q + 1:i * q + 1 + len(d)] = d
        self._copy(ids, st.buf.verify_ids, cupy.cuda.runtime.memcpyHostToDevice)
        return st

    def verify(self, st: Staged, speculative: bool, read_drafts: bool) -> Verified:
        """Replay the verify graph (unless queued ahead already), copy its targets back, queue the context graph
        behind the copy (and, in plain decoding, the next step), and return once the copy has landed."""
        n, q = st.buf.n, st.buf.q
        nq = n * q
        self.num_replays += 1
        if not st.launched:
            self._verify_and_copy_back(st, read_drafts)
        if st.step.context_graph is not None:
            st.step.context_graph.launch(self.stream)
        if q == 1 and self.pipeline and self._can_run_ahead(st.seqs):
            self.pending = self._launch_ahead(st)
        st.slot.done.synchronize()
        out = st.slot.host_out
        drafts = out[nq:2 * nq].reshape(n, q)[:len(st.seqs), 1:].astype(np.int64) if read_drafts else None
        return Verified(out[:nq].copy(), st.step.logits, drafts, list(range(0, nq, q)))

    def _verify_and_copy_back(self, st: Staged, read_drafts: bool) -> None:
        st.step.verify_graph.launch(self.stream)
        nq = st.buf.n * st.buf.q
        self._copy(st.step.targets, st.slot.host_out[:nq], cupy.cuda.runtime.memcpyDeviceToHost)
        if read_drafts:
            self._copy(st.buf.verify_ids, st.slot.host_out[nq:2 * nq], cupy.cuda.runtime.memcpyDeviceToHost)
        st.slot.done.record(self.stream)
        st.launched = True

    # ---- the hybrid commit after acceptance (module docstring)
    def commit_run(self, st: Staged) -> CommitRun | None:
        """How ModelRunner.commit_states runs this step's commit: replays of its commit graph (None: not hybrid)."""
        if st.step.commit_graph is None:
            return None
        return lambda done, count: self._commit(st, done, count)

    def _commit(self, st: Staged, done: list[int], count: list[int]) -> None:
        """One commit run: per sequence of the batch, `count` rows after the first `done` of its verify rows (the
        padding sequences none), staged with one copy, then the commit graph."""
        buf = st.buf
        host = buf.take_span()
        host[...] = commit_span(np.arange(buf.n + 1) * buf.q, done, [d + c for d, c in zip(done, count)])
        self._copy(host, buf.span, cupy.cuda.runtime.memcpyHostToDevice)
        buf.span_copied(self.stream)
        st.step.commit_graph.launch(self.stream)

    # ---- plain decoding, one step ahead (module docstring)
    def _can_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Greedy sequences (their next token is the argmax on the device), none ending at this step's length limit,
        each with a slot for position num_cached + 1 (the scheduler's lookahead reserves it)."""
        blocks = self.blocks
        return all(s.params.greedy and len(s.output_ids) + 1 < s.params.max_tokens
                   and blocks.blocks_for(s.num_cached + 2) <= len(s.block_table) for s in seqs)

    def _launch_ahead(self, now: Staged) -> Staged | None:
        """Queue the step after `now`: positions one further on, pending tokens = now's argmax, copied on the device.
        None (nothing queued) where that step's shape has no captured graph yet: capturing runs it eagerly first."""
        seqs = now.seqs
        key = (now.buf.n, 1, 0, context_bucket(max(s.num_cached + 2 for s in seqs)), ("verify",))
        if key not in self.steps:
            return None
        st = self._stage(seqs, 1, 0, False, ahead=1)
        self._copy(now.step.targets, st.buf.device[:st.buf.n], cupy.cuda.runtime.memcpyDeviceToDevice)  # ids
        self._verify_and_copy_back(st, False)
        return st

    def _copy(self, src: Any, dst: Any, kind: int) -> None:
        """Queue a copy of all of dst between a device array and a page-locked host array (or two device arrays)
        on the graphs' stream. A host array is written (staging) or read (read-back) only while no copy of it is
        pending: see HostSlot."""
        ptr = lambda a: a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr  # noqa: E731
        cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), dst.nbytes, kind, self.stream.ptr)
