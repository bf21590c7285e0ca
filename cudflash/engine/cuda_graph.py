"""CUDA graphs for the steady state: every running sequence decoding, no prefill in the step.

Three graphs per (padded batch, block width, context bucket), captured lazily with CuPy's stream API:
- propose graph: drafter forward over the block -> LM head on the mask rows -> argmax -> the drafts written
  into the verify ids on the device (absent with block width 1, plain decoding). For the other drafter families
  (DFlash2, DSpark: propose.DraftProposer) it holds the device part of their heads (drafter forward, logits, the
  selector's pair scores or the Markov walk); the host part (selector walk, confidence cuts) reads its outputs and
  `verify_drafts` stages the drafts;
- verify graph: target forward over [pending token, drafts] -> float32 logits -> argmax (and the taps);
- context graph: the drafter's context update from the taps of EVERY block row: fc -> hidden_norm -> stacked
  K/V GEMM -> k_norm + RoPE -> drafter cache at the block's positions.
The host stages each step's inputs into the static buffers and replays the propose and verify graphs; the
drafts and argmaxes go back to page-locked host memory, and the context graph is queued behind that copy, so
the device runs it while the host waits for the copy and accepts.

Plain decoding (block width 1, every sequence greedy) runs one step ahead (`decode`): while the host waits for step
k's tokens and accepts them, step k + 1 is already queued, staged for positions one further on with its pending
tokens copied on the device from step k's argmax. So the device never idles on the host's staging, launch,
read-back and bookkeeping (0.05-0.3 ms per step on the H200 machine, BENCHMARKS.md, session 7). The next step takes
the queued one only if its sequences are exactly the predicted ones (same objects, each one token further, the
same slots); otherwise the queued step is dropped. A dropped step did no harm: it wrote K/V only at the slot of
position num_cached + 1 of its own sequences (scratch until committed, and written again by whichever step does
compute that position before anything reads it), and anything that reuses those blocks later is ordered after it
on the stream.

Why the context update may run before acceptance, over rows that may be rejected: the drafter's context K/V at a
position is a function of the target's tap at that position alone, and every row of the block was a verify
input. The committed rows (the pending token and the accepted drafts, a prefix) therefore get the K/V an update
after acceptance would write (bit for bit: the GEMMs see n x q rows, as in the gathered update this replaced and
the GPU tests compare with eager steps), and the rows past them land at
positions >= the new committed length, which the next propose overwrites with its own block's K/V before any
attention reads them (its block starts at that length and is as long as this one). It also needs no staging.

Rules kept here: every buffer a graph touches is allocated before capture or during capture from a memory
pool private to that step's graphs, and is kept alive with them (two steps sharing a pool corrupted each
other's outputs: an illegal address on the H200); each shape is run once
eagerly before capture so that kernels are compiled and cuBLAS has chosen its algorithms; nothing inside a
capture copies between host and device or synchronises. Padded sequences use a dummy KV block and slot -1.

Memory: a captured step keeps its pool (float32 logits [padded batch x block, V] and the forward's activations:
hundreds of MB for an 8B target at batch 32) for as long as it lives, and the context bucket and batch bucket can
take many values over a long run. Captured steps therefore live in an LRU cache bounded by `max_bytes` (the
backend's graph reserve, which the KV cache budget leaves free); a step evicted is captured again if needed.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import cupy
import numpy as np

from cudflash.backends.base import AttentionMeta
from cudflash.backends.cuda_attention import DeviceMeta, batch_bucket, context_bucket
from cudflash.engine.propose import DraftProposer, HeadOutputs, HeadRows, block_rows, head_rows
from cudflash.engine.sequence import Sequence
from cudflash.engine.staging import fill_step_inputs
from cudflash.models.batch import ForwardBatch


def pinned_int32(size: int) -> np.ndarray:
    """A host int32 array in page-locked memory, so that a copy into it is asynchronous DMA."""
    memory = cupy.cuda.alloc_pinned_memory(max(1, size) * 4)
    return np.frombuffer(memory, dtype=np.int32, count=size)  # its base keeps `memory` alive


@dataclass
class HostSlot:
    """Page-locked staging memory for one step in flight. Two per StepBuffers, used in turn, so that plain decoding
    can stage step k + 1 while step k's copies may still be pending; a slot is written again only after the
    read-back of the last step that used it has landed (`done`)."""

    host_in: np.ndarray  # int32, the layout of StepBuffers.step_in
    host_out: np.ndarray  # int32 [n q + n (q - 1)]: targets | drafts, copied back after verify
    verify_in: np.ndarray  # int32 [n q]: verify ids of drafts proposed on the host (`verify_drafts`)
    done: cupy.cuda.Event  # recorded behind the read-back of the last step that used this slot


@dataclass
class StepBuffers:
    """Static inputs of one (padded batch, block width): the host writes them before each replay.

    The per-step inputs are views into one packed int32 buffer (staging.py states its layout), staged from a
    page-locked mirror of the same layout with ONE asynchronous copy on the graphs' stream: ordered behind
    the previous step's graphs, which read its positions and slots, without the host waiting for them.
    """

    n: int
    q: int
    step_in: cupy.ndarray  # int32 [3 n q + n + n max_blocks]: ids | positions | slots | context_lens | block_tables
    cu_seqlens: cupy.ndarray  # int32 [n + 1] = arange * q (fixed)
    draft_rows: cupy.ndarray  # int32 [n * (q - 1)]: the mask rows (fixed)
    verify_ids: cupy.ndarray  # int32 [n * q]: ids with the drafts in place of the masks (written on the device)
    host: list[HostSlot]  # two, used in turn
    turn: int = 0
    head_rows: HeadRows | None = None  # index rows of the drafter heads (DraftProposer), made on first use

    def take_slot(self) -> HostSlot:
        """The next host slot, once the last step that used it has copied its outputs back."""
        slot = self.host[self.turn]
        self.turn ^= 1
        slot.done.synchronize()
        return slot

    def __post_init__(self) -> None:
        # Views of step_in, the graphs' inputs: ids [n q] ([pending token, MASK x (q-1)] per sequence),
        # positions [n q], slots [n q] (-1 for padded sequences), context_lens [n], block_tables [n, max_blocks].
        nq, n, packed = self.n * self.q, self.n, self.step_in
        self.ids, self.positions, self.slots = packed[:nq], packed[nq:2 * nq], packed[2 * nq:3 * nq]
        self.context_lens, self.block_tables = packed[3 * nq:3 * nq + n], packed[3 * nq + n:].reshape(n, -1)


@dataclass
class Launched:
    """A plain decoding step on the stream: what it was staged for, and where its argmax lands."""

    seqs: list[Sequence]
    rows: list[tuple[int, int]]  # per sequence: (num_cached, cache block of the row's position) it was staged for
    step: "CapturedStep"
    buf: StepBuffers
    slot: HostSlot

    @staticmethod
    def rows_of(seqs: list[Sequence], ahead: int, block_size: int) -> list[tuple[int, int]]:
        """`rows` of a step staged `ahead` positions past each sequence's num_cached."""
        return [(s.num_cached + ahead, s.block_table[(s.num_cached + ahead) // block_size]) for s in seqs]

    def matches(self, seqs: list[Sequence], block_size: int) -> bool:
        """Whether this step is the decode of exactly `seqs` as they stand now."""
        return len(seqs) == len(self.seqs) and all(a is b for a, b in zip(seqs, self.seqs)) \
            and self.rows_of(seqs, 0, block_size) == self.rows


@dataclass
class CapturedStep:
    propose_graph: Any | None  # cupy.cuda.Graph of the drafter block forward (speculative only)
    verify_graph: Any  # cupy.cuda.Graph of the target forward
    context_graph: Any | None  # cupy.cuda.Graph of the drafter context update (speculative only)
    drafts: cupy.ndarray | None  # int32 [n * (q - 1)]
    targets: cupy.ndarray  # int32 [n * q]: argmax of every verify row
    logits: cupy.ndarray  # float32 [n * q, V]
    pool: Any  # cupy.cuda.MemoryPool private to this step's graphs
    keep: list[Any] = field(default_factory=list)  # everything else the graphs reference
    head_out: HeadOutputs | None = None  # the propose graph's outputs for a DraftProposer

    @property
    def nbytes(self) -> int:
        return self.pool.total_bytes()

    def release(self) -> None:
        """Drop the graphs and everything they reference, then hand the pool's memory back to the device."""
        self.propose_graph = self.verify_graph = self.context_graph = None
        self.drafts = self.targets = self.logits = self.head_out = None
        self.keep.clear()
        self.pool.free_all_blocks()


class StepGraphs:
    def __init__(self, runner, max_blocks: int, dummy_block: int, max_bytes: int):
        self.runner, self.b = runner, runner.backend
        self.max_blocks, self.dummy_block, self.max_bytes = max_blocks, dummy_block, max_bytes
        self.stream = cupy.cuda.get_current_stream()
        self.buffers: dict[tuple[int, int], StepBuffers] = {}
        # (padded batch, block width, context bucket, what the propose graph holds: see _step_for) -> captured
        # step, least recently used first
        self.steps: OrderedDict[tuple, CapturedStep] = OrderedDict()
        self.num_captures = 0
        self.pipeline = self.b.tuning.run_ahead  # plain decoding queues the next step before waiting (`decode`)
        self.pending: Launched | None = None  # the step `decode` queued ahead
        self.num_run_ahead = 0  # decode steps that found themselves already queued

    @property
    def nbytes(self) -> int:
        return sum(step.nbytes for step in self.steps.values())

    def fits(self, num_seqs: int) -> bool:
        return batch_bucket(num_seqs) is not None

    # ---- staging
    def _buffers(self, n: int, q: int) -> StepBuffers:
        key = (n, q)
        if key not in self.buffers:
            z = lambda size: cupy.zeros(size, dtype=cupy.int32)  # noqa: E731
            self.buffers[key] = StepBuffers(
                n, q, z(3 * n * q + n + n * self.max_blocks), cupy.asarray(np.arange(n + 1, dtype=np.int32) * q),
                cupy.asarray(block_rows(n, q, 1, q - 1).astype(np.int32)), z(n * q),
                [HostSlot(pinned_int32(3 * n * q + n + n * self.max_blocks), pinned_int32(n * q + n * (q - 1)),
                          pinned_int32(n * q), cupy.cuda.Event(disable_timing=True)) for _ in range(2)])
        return self.buffers[key]

    def stage(self, seqs: list[Sequence], q: int, mask: int, ahead: int = 0) -> tuple[StepBuffers, HostSlot, int]:
        """Fill the page-locked inputs of the step's batch bucket and queue their copy; (buffers, the host slot
        used, context bucket). `ahead`: see fill_step_inputs."""
        n = batch_bucket(len(seqs))
        buf = self._buffers(n, q)
        slot = buf.take_slot()
        longest = fill_step_inputs(slot.host_in, n, q, seqs, mask, self.runner.blocks.block_size, self.dummy_block,
                                   ahead)
        self._copy(slot.host_in, buf.step_in, cupy.cuda.runtime.memcpyHostToDevice)  # one copy of all of it
        return buf, slot, context_bucket(longest)

    def _meta(self, buf: StepBuffers, ctx_bucket: int) -> AttentionMeta:
        meta = AttentionMeta(np.arange(buf.n + 1, dtype=np.int32) * buf.q, np.full(buf.n, ctx_bucket, np.int32),
                             np.zeros((buf.n, self.max_blocks), np.int32), buf.q, ctx_bucket)
        meta.device = DeviceMeta(buf.cu_seqlens, buf.context_lens, buf.block_tables)
        return meta

    # ---- the captured work
    def _propose_forward(self, buf: StepBuffers, meta: AttentionMeta) -> cupy.ndarray:
        r, b = self.runner, self.b
        hidden = r.draft.forward(ForwardBatch(buf.ids, buf.positions, buf.slots, meta), r.draft_kv, r.target)
        drafts = b.argmax(r.target.logits(b.take_rows(hidden, buf.draft_rows)))
        buf.verify_ids[...] = buf.ids
        buf.verify_ids[buf.draft_rows] = drafts
        return drafts

    def _verify_forward(self, buf: StepBuffers, meta: AttentionMeta, speculative: bool):
        r, b = self.runner, self.b
        ids = buf.verify_ids if speculative else buf.ids
        hidden, taps = r.target.forward(ForwardBatch(ids, buf.positions, buf.slots, meta), r.target_kv,
                                        r.tap_layers if speculative else None)
        logits = r.target.logits(hidden)
        return b.argmax(logits), logits, taps

    def _context_forward(self, buf: StepBuffers, taps: cupy.ndarray) -> None:
        """Every block row, before acceptance: see the module docstring."""
        self.runner.draft.update_context(taps, buf.positions, buf.slots, self.runner.draft_kv)

    def _graph(self, fn, *args):
        """Run fn once eagerly (compiles kernels, lets cuBLAS choose its algorithms), then capture it."""
        fn(*args)
        self.stream.begin_capture()
        out = fn(*args)
        graph = self.stream.end_capture()
        graph.upload(self.stream)
        return graph, out

    def _heads_forward(self, buf: StepBuffers, meta: AttentionMeta, proposer: DraftProposer) -> HeadOutputs:
        r = self.runner
        return proposer.device_part(r, ForwardBatch(buf.ids, buf.positions, buf.slots, meta), buf.head_rows)

    def _capture(self, buf: StepBuffers, ctx_bucket: int, speculative: bool,
                 proposer: DraftProposer | str | None) -> CapturedStep:
        # The eager warm-ups run on the staged inputs: they write the KV slots the replay writes next, with the
        # same values.
        meta = self._meta(buf, ctx_bucket)
        # A private pool per captured step: its three graphs replay in the order they were captured, so they may
        # share memory with each other, but never with another step's graphs (whose outputs stay alive).
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            propose_graph = drafts = context_graph = head_out = None
            if proposer == "dflash":
                propose_graph, drafts = self._graph(self._propose_forward, buf, meta)
            elif proposer is not None:
                propose_graph, head_out = self._graph(self._heads_forward, buf, meta, proposer)
            verify_graph, (targets, logits, taps) = self._graph(self._verify_forward, buf, meta, speculative)
            if speculative:
                context_graph, _ = self._graph(self._context_forward, buf, taps)
        self.num_captures += 1
        return CapturedStep(propose_graph, verify_graph, context_graph, drafts, targets, logits, pool,
                            keep=[taps, meta], head_out=head_out)

    def _step_for(self, buf: StepBuffers, ctx_bucket: int, speculative: bool,
                  proposer: DraftProposer | str | None) -> CapturedStep:
        """The captured step of this shape, captured now if new (evicting the least recently used past the bound).
        proposer: what the propose graph holds: "dflash" (plain DFlash, drafts written on the device), a
        DraftProposer (its device part), or None (no propose graph)."""
        key = (buf.n, buf.q, ctx_bucket, proposer if proposer is None or isinstance(proposer, str) else id(proposer))
        if key not in self.steps:
            self.steps[key] = self._capture(buf, ctx_bucket, speculative, proposer)
            while len(self.steps) > 1 and self.nbytes > self.max_bytes:
                _, old = self.steps.popitem(last=False)
                self.stream.synchronize()  # a step queued ahead may still be running on the graphs released here
                old.release()
        self.steps.move_to_end(key)
        return self.steps[key]

    def propose(self, seqs: list[Sequence], q: int, mask: int,
                proposer: DraftProposer | None = None) -> tuple[CapturedStep, StepBuffers, HostSlot]:
        """Stage the step's inputs, capture its graphs if this shape is new, replay the propose graph: plain DFlash's
        (drafts into the verify ids on the device), or a DraftProposer's device part (its host part then reads
        step.head_out, and `verify_drafts` stages the drafts)."""
        self.pending = None  # a step queued ahead by `decode` is not this one
        buf, slot, ctx_bucket = self.stage(seqs, q, mask)
        if proposer is not None and buf.head_rows is None:
            buf.head_rows = head_rows(self.b, buf.n, q, proposer.first_row(self.runner))
        step = self._step_for(buf, ctx_bucket, q > 1, proposer if proposer is not None else "dflash")
        step.propose_graph.launch(self.stream)
        return step, buf, slot

    def verify_drafts(self, step: CapturedStep, buf: StepBuffers, slot: HostSlot,
                      drafts: list[np.ndarray]) -> np.ndarray:
        """Write [pending token, drafts] of drafts proposed on the host into the verify ids, replay the verify and
        context graphs; targets [n, q]. A sequence with fewer than q - 1 drafts is verified over the whole block
        (masks in place of the missing drafts); acceptance reads only the rows of its drafts."""
        q = buf.q
        ids = slot.verify_in
        ids[:] = slot.host_in[:buf.n * q]  # [pending token, MASK x (q - 1)] per sequence, as staged
        for i, d in enumerate(drafts):
            ids[i * q + 1:i * q + 1 + len(d)] = d
        self._copy(ids, buf.verify_ids, cupy.cuda.runtime.memcpyHostToDevice)
        return self.verify(step, buf, slot)[0]

    def verify(self, step: CapturedStep, buf: StepBuffers, slot: HostSlot) -> tuple[np.ndarray, np.ndarray]:
        """Replay the verify graph, copy (targets [n, q], drafts [n, q - 1]) back, queue the context graph behind
        the copy, and return them once the copy (not the context update) is done."""
        self._verify_and_copy_back(step, buf, slot)
        if step.context_graph is not None:
            step.context_graph.launch(self.stream)
        slot.done.synchronize()
        nq = buf.n * buf.q
        return slot.host_out[:nq].reshape(buf.n, buf.q).copy(), slot.host_out[nq:].reshape(buf.n, buf.q - 1).copy()

    def _verify_and_copy_back(self, step: CapturedStep, buf: StepBuffers, slot: HostSlot) -> None:
        step.verify_graph.launch(self.stream)
        nq = buf.n * buf.q
        self._copy(step.targets, slot.host_out[:nq], cupy.cuda.runtime.memcpyDeviceToHost)
        if step.drafts is not None:
            self._copy(step.drafts, slot.host_out[nq:], cupy.cuda.runtime.memcpyDeviceToHost)
        slot.done.record(self.stream)

    # ---- plain decoding, one step ahead (module docstring)
    def decode(self, seqs: list[Sequence], mark: Callable[[str], None]) -> tuple[np.ndarray, cupy.ndarray]:
        """One plain decoding step of `seqs`: (their argmax tokens [len(seqs)], the step's float32 logits). Takes
        the step queued ahead by the last call if it is this one, else stages and launches it; then queues the
        next step (greedy sequences only: their logits are then overwritten) before waiting for this one's."""
        pending, self.pending = self.pending, None
        bs = self.runner.blocks.block_size
        if pending is not None and pending.matches(seqs, bs):
            now = pending
            self.num_run_ahead += 1
        else:
            buf, slot, ctx_bucket = self.stage(seqs, 1, 0)
            now = Launched(list(seqs), Launched.rows_of(seqs, 0, bs), self._step_for(buf, ctx_bucket, False, None),
                           buf, slot)
            self._verify_and_copy_back(now.step, buf, slot)
        mark("propose")
        if self.pipeline and self._can_run_ahead(seqs):
            self.pending = self._launch_ahead(seqs, now)
        now.slot.done.synchronize()
        mark("verify")
        return now.slot.host_out[:len(seqs)].copy(), now.step.logits

    def _can_run_ahead(self, seqs: list[Sequence]) -> bool:
        """Greedy sequences (their next token is the argmax on the device), none ending at this step's length
        limit, with slots for position num_cached + 1 (reserved here, if the pool has them)."""
        blocks = self.runner.blocks
        if any(not s.params.greedy or len(s.output_ids) + 1 >= s.params.max_tokens for s in seqs):
            return False
        if sum(max(0, blocks.blocks_for(s.num_cached + 2) - len(s.block_table)) for s in seqs) > blocks.num_free:
            return False
        for s in seqs:
            blocks.reserve(s, s.num_cached + 2)
        return True

    def _launch_ahead(self, seqs: list[Sequence], now: Launched) -> Launched | None:
        """Queue the step after `now`: positions one further on, pending tokens = now's argmax, copied on the device.
        None (nothing queued) where that step's shape has no captured graph yet: capturing runs it eagerly first."""
        bs = self.runner.blocks.block_size
        n = batch_bucket(len(seqs))
        longest = max(s.num_cached + 2 for s in seqs)
        key = (n, 1, context_bucket(longest), None)
        step = self.steps.get(key)
        if step is None:
            return None
        buf, slot, _ = self.stage(seqs, 1, 0, ahead=1)
        self.steps.move_to_end(key)
        self._copy(now.step.targets, buf.ids, cupy.cuda.runtime.memcpyDeviceToDevice)  # [n] pending tokens
        self._verify_and_copy_back(step, buf, slot)
        return Launched(list(seqs), Launched.rows_of(seqs, 1, bs), step, buf, slot)

    def _copy(self, src: Any, dst: Any, kind: int) -> None:
        """Queue a copy of all of dst between a device array and a page-locked host array (or two device arrays)
        on the graphs' stream. A host array is written (staging) or read (read-back) only while no copy of it is
        pending: see HostSlot."""
        ptr = lambda a: a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr  # noqa: E731
        cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), dst.nbytes, kind, self.stream.ptr)
