"""CUDA graphs for the steady state: every running sequence decoding, no prefill in the step.

Three graphs per (padded batch, block width, context bucket), captured lazily with CuPy's stream API:
- propose graph: drafter forward over the block -> LM head on the mask rows -> argmax -> the drafts written
  into the verify ids on the device (absent with block width 1, plain decoding);
- verify graph: target forward over [pending token, drafts] -> float32 logits -> argmax (and the taps);
- context graph: the drafter's context update from the taps of EVERY block row: fc -> hidden_norm -> stacked
  K/V GEMM -> k_norm + RoPE -> drafter cache at the block's positions.
The host stages each step's inputs into the static buffers and replays the propose and verify graphs; the
drafts and argmaxes go back to page-locked host memory, and the context graph is queued behind that copy, so
the device runs it while the host waits for the copy and accepts.

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
from typing import Any

import cupy
import numpy as np

from cudflash.backends.base import AttentionMeta
from cudflash.backends.cuda_attention import DeviceMeta, batch_bucket, context_bucket
from cudflash.engine.propose import block_rows
from cudflash.engine.sequence import Sequence
from cudflash.engine.staging import fill_step_inputs
from cudflash.models.batch import ForwardBatch

def pinned_int32(size: int) -> np.ndarray:
    """A host int32 array in page-locked memory, so that a copy into it is asynchronous DMA."""
    memory = cupy.cuda.alloc_pinned_memory(max(1, size) * 4)
    return np.frombuffer(memory, dtype=np.int32, count=size)  # its base keeps `memory` alive


@dataclass
class StepBuffers:
    """Static inputs of one (padded batch, block width): the host writes them before each replay.

    The per-step inputs are views into one packed int32 buffer, staged from a page-locked mirror of the same
    layout (`inputs` gives the views of either) with ONE asynchronous copy on the graphs' stream: ordered behind
    the previous step's context graph, which reads its positions and slots, without the host waiting for it.
    """

    n: int
    q: int
    step_in: cupy.ndarray  # int32 [3 n q + n + n max_blocks]: ids | positions | slots | context_lens | block_tables
    cu_seqlens: cupy.ndarray  # int32 [n + 1] = arange * q (fixed)
    draft_rows: cupy.ndarray  # int32 [n * (q - 1)]: the mask rows (fixed)
    verify_ids: cupy.ndarray  # int32 [n * q]: ids with the drafts in place of the masks (written on the device)
    host_in: np.ndarray  # int32, page-locked, the layout of step_in
    host_out: np.ndarray  # int32 [n q + n (q - 1)], page-locked: targets | drafts, copied back after verify

    def inputs(self, packed: Any) -> tuple[Any, Any, Any, Any, Any]:
        """Views of step_in or host_in: ids [n q] ([pending token, MASK x (q-1)] per sequence), positions [n q],
        slots [n q] (-1 for padded sequences), context_lens [n], block_tables [n, max_blocks]."""
        nq, n = self.n * self.q, self.n
        return (packed[:nq], packed[nq:2 * nq], packed[2 * nq:3 * nq], packed[3 * nq:3 * nq + n],
                packed[3 * nq + n:].reshape(n, -1))

    @property
    def ids(self) -> cupy.ndarray:
        return self.inputs(self.step_in)[0]

    @property
    def positions(self) -> cupy.ndarray:
        return self.inputs(self.step_in)[1]

    @property
    def slots(self) -> cupy.ndarray:
        return self.inputs(self.step_in)[2]

    @property
    def context_lens(self) -> cupy.ndarray:
        return self.inputs(self.step_in)[3]

    @property
    def block_tables(self) -> cupy.ndarray:
        return self.inputs(self.step_in)[4]


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

    @property
    def nbytes(self) -> int:
        return self.pool.total_bytes()

    def release(self) -> None:
        """Drop the graphs and everything they reference, then hand the pool's memory back to the device."""
        self.propose_graph = self.verify_graph = self.context_graph = None
        self.drafts = self.targets = self.logits = None
        self.keep.clear()
        self.pool.free_all_blocks()


class StepGraphs:
    def __init__(self, runner, max_blocks: int, dummy_block: int, max_bytes: int):
        self.runner, self.b = runner, runner.backend
        self.max_blocks, self.dummy_block, self.max_bytes = max_blocks, dummy_block, max_bytes
        self.stream = cupy.cuda.get_current_stream()
        self.buffers: dict[tuple[int, int], StepBuffers] = {}
        # (padded batch, block width, context bucket) -> captured step, least recently used first
        self.steps: OrderedDict[tuple[int, int, int], CapturedStep] = OrderedDict()
        self.num_captures = 0
        self.copied_back = cupy.cuda.Event(disable_timing=True)  # recorded behind a step's device-to-host copy

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
                pinned_int32(3 * n * q + n + n * self.max_blocks), pinned_int32(n * q + n * (q - 1)))
        return self.buffers[key]

    def stage(self, seqs: list[Sequence], q: int, mask: int) -> tuple[StepBuffers, int]:
        """Fill the page-locked inputs of the step's batch bucket and queue their copy; (buffers, context bucket)."""
        n = batch_bucket(len(seqs))
        buf = self._buffers(n, q)
        longest = fill_step_inputs(buf.host_in, n, q, seqs, mask, self.runner.blocks.block_size, self.dummy_block)
        self._copy(buf.host_in, buf.step_in, cupy.cuda.runtime.memcpyHostToDevice)  # one copy of all of it
        return buf, context_bucket(longest)

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

    def _capture(self, buf: StepBuffers, ctx_bucket: int, speculative: bool) -> CapturedStep:
        # The eager warm-ups run on the staged inputs: they write the KV slots the replay writes next, with the
        # same values.
        meta = self._meta(buf, ctx_bucket)
        # A private pool per captured step: its three graphs replay in the order they were captured, so they may
        # share memory with each other, but never with another step's graphs (whose outputs stay alive).
        pool = cupy.cuda.MemoryPool()
        with cupy.cuda.using_allocator(pool.malloc):
            propose_graph = drafts = context_graph = None
            if speculative:
                propose_graph, drafts = self._graph(self._propose_forward, buf, meta)
            verify_graph, (targets, logits, taps) = self._graph(self._verify_forward, buf, meta, speculative)
            if speculative:
                context_graph, _ = self._graph(self._context_forward, buf, taps)
        self.num_captures += 1
        return CapturedStep(propose_graph, verify_graph, context_graph, drafts, targets, logits, pool,
                            keep=[taps, meta])

    def propose(self, seqs: list[Sequence], q: int, mask: int) -> tuple[CapturedStep, StepBuffers]:
        """Stage the step's inputs, capture its graphs if this shape is new, replay the propose graph."""
        buf, ctx_bucket = self.stage(seqs, q, mask)
        key = (buf.n, q, ctx_bucket)
        if key not in self.steps:
            self.steps[key] = self._capture(buf, ctx_bucket, q > 1)
            while len(self.steps) > 1 and self.nbytes > self.max_bytes:
                _, old = self.steps.popitem(last=False)
                old.release()
        self.steps.move_to_end(key)
        step = self.steps[key]
        if step.propose_graph is not None:
            step.propose_graph.launch(self.stream)
        return step, buf

    def verify(self, step: CapturedStep, buf: StepBuffers) -> tuple[np.ndarray, np.ndarray]:
        """Replay the verify graph, copy (targets [n, q], drafts [n, q - 1]) back, queue the context graph behind
        the copy, and return them once the copy (not the context update) is done."""
        step.verify_graph.launch(self.stream)
        nq = buf.n * buf.q
        self._copy(step.targets, buf.host_out[:nq], cupy.cuda.runtime.memcpyDeviceToHost)
        if step.drafts is not None:
            self._copy(step.drafts, buf.host_out[nq:], cupy.cuda.runtime.memcpyDeviceToHost)
        self.copied_back.record(self.stream)
        if step.context_graph is not None:
            step.context_graph.launch(self.stream)
        self.copied_back.synchronize()
        return buf.host_out[:nq].reshape(buf.n, buf.q).copy(), buf.host_out[nq:].reshape(buf.n, buf.q - 1).copy()

    def _copy(self, src: Any, dst: Any, kind: int) -> None:
        """Queue a copy between a device array and a page-locked host array on the graphs' stream. A host array
        is written (staging) or read (read-back) only while no copy of it is pending: each step synchronises on
        its read-back before it stages the next."""
        ptr = lambda a: a.ctypes.data if isinstance(a, np.ndarray) else a.data.ptr  # noqa: E731
        cupy.cuda.runtime.memcpyAsync(ptr(dst), ptr(src), dst.nbytes, kind, self.stream.ptr)
