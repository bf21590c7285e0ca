"""Owns the models, their paged KV caches and the block manager; turns sequences into model inputs.

No speculative logic lives here (that is spec_decode.py): the runner only knows how to run a target forward,
a drafter context update and a drafter block forward over a set of (sequence, tokens, start position).
"""
from __future__ import annotations

import dataclasses
import sys
import time
from typing import Any, Callable, TextIO

import numpy as np

from cudflash.backends.base import Backend
from cudflash.checkpoint import Checkpoint
from cudflash.config import TargetConfig
from cudflash.draft_config import DraftConfig
from cudflash.engine.block_manager import BlockManager
from cudflash.engine.sequence import Sequence
from cudflash.engine.step_inputs import Chunk, StepTensors, fill, layout_for
from cudflash.errors import BackendError, ConfigError
from cudflash.models.batch import ForwardBatch, KVCache
from cudflash.engine.state_pool import HybridBlockManager, StateSlots
from cudflash.models.dflash import DFlashDraftModel
from cudflash.models.hybrid import GDNTape, HybridCache, HybridTargetModel, commit_span, state_use
from cudflash.models.target import TargetModel
from cudflash.models.weights import RandomWeights, WeightLoader, WeightMemory
from cudflash.parallel.engine_target import TensorParallelTarget
from cudflash.quant import QuantScheme
from cudflash.quant.memory import dequantized_bytes, keep_quantized
from cudflash.rope import device_rope_tables


class LoadProgress:
    """Progress on stderr while weights move to the backend: one line rewritten in place on a terminal (at most every
    `tty_interval` seconds); elsewhere (a log file, a pipe) plain lines at most every `interval` seconds, so a log
    holds no carriage returns. The last line (100%) is always printed."""

    def __init__(self, label: str, total_bytes: int, enabled: bool, out: TextIO | None = None,
                 interval: float = 5.0, tty_interval: float = 0.5, clock: Callable[[], float] = time.perf_counter):
        self.label, self.total, self.done, self.enabled = label, max(total_bytes, 1), 0, enabled
        self.out = out  # None: sys.stderr as it is when a line is printed
        self.interval, self.tty_interval, self.clock = interval, tty_interval, clock
        self.start = self.last = clock()

    def __call__(self, nbytes: int) -> None:
        self.done += nbytes
        if not self.enabled:
            return
        out = self.out if self.out is not None else sys.stderr
        tty = _is_terminal(out)
        now, finished = self.clock(), self.done >= self.total
        if not finished and now - self.last <= (self.tty_interval if tty else self.interval):
            return
        self.last = now
        line = (f"loading {self.label}: {100 * self.done / self.total:5.1f}% "
                f"({self.done / 1e9:.2f} / {self.total / 1e9:.2f} GB, {now - self.start:.1f} s)")
        if tty:
            print(f"\r{line}", end="\n" if finished else "", file=out, flush=True)
        else:
            print(line, file=out, flush=True)


def _is_terminal(out: TextIO) -> bool:
    try:
        return out.isatty()
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _loader(ckpt: Checkpoint, backend: Backend, label: str, progress: bool, check_weights: bool,
            quant: QuantScheme | None = None, quantize: str | None = None,
            quantize_lm_head: bool = False) -> WeightLoader:
    total = sum(ckpt.info(n).nbytes for n in ckpt.names)
    return WeightLoader(ckpt, backend, progress=LoadProgress(label, total, progress), check_weights=check_weights,
                        quant=quant, quantize=quantize, quantize_lm_head=quantize_lm_head)


def step_activation_bytes(cfg: TargetConfig, tokens: int) -> int:
    """An upper estimate of the device memory one step of `tokens` rows (a prefill of max_num_batched_tokens) holds
    at once beside the weights and caches, per row: the MLP's float32 gate_up output and bf16 SwiGLU (10 I bytes),
    about six float32 or bf16 hidden-wide rows (the residual stream, norms, projections, the drafter's taps: 24 H),
    and for a hybrid the GDN layer's in_proj output and conv channels (4 conv_dim + 4 value_dim). At 8192 rows this
    is what a backend's fixed activation reserve covers (1.8 GB at Qwen3-8B); 32 prompts of 2048 rows at
    Qwen3.5-9B need ~17 GB (its gate_up output alone is 6.4 GB)."""
    per_row = 10 * cfg.intermediate_size + 24 * cfg.hidden_size
    if cfg.hybrid is not None:
        per_row += 4 * (cfg.hybrid.conv_dim + cfg.hybrid.value_dim)
    return tokens * per_row


def kv_elements_per_position(target_cfg: TargetConfig, draft_cfg: DraftConfig | None, target_kv_heads: int) -> int:
    """K and V elements one cached position takes over the target's attention layers (a hybrid's GDN layers hold no
    KV) and the drafter's layers."""
    t, d = target_cfg, draft_cfg
    attention_layers = len(t.hybrid.full_layers) if t.hybrid is not None else t.num_layers
    per_position = attention_layers * 2 * target_kv_heads * t.head_dim
    return per_position + (d.num_layers * 2 * d.num_kv_heads * d.head_dim if d is not None else 0)


# One run of a hybrid commit: (rows already committed, rows to commit now) per sequence of the last verify, host
# lists in that forward's order (ModelRunner.commit_states makes one or two runs per step).
CommitRun = Callable[[list[int], list[int]], None]


class ModelRunner:
    def __init__(self, target_cfg: TargetConfig, draft_cfg: DraftConfig | None, backend: Backend, *,
                 max_block_size: int, kv_block_size: int = 16, num_kv_blocks: int | None = None,
                 max_num_seqs: int = 64, memory_utilization: float = 0.9, progress: bool = False,
                 random_weights: bool = False, max_model_len: int | None = None, check_weights: bool = True,
                 target_quant: QuantScheme | None = None, quantize: str | None = None, quantize_draft: bool = False,
                 quantize_lm_head: bool = False, tensor_parallel_size: int = 1,
                 num_state_snapshots: int | None = None, max_num_batched_tokens: int = 8192):
        self.backend, self.target_cfg, self.draft_cfg = backend, target_cfg, draft_cfg
        # The longest prompt + output served; positions reach a draft block (and one pending token) past it.
        self.max_model_len = max_model_len or target_cfg.max_position_embeddings
        seq_blocks = -(-(self.max_model_len + max_block_size + 1) // kv_block_size)
        def loader(path: str, label: str, quant: QuantScheme | None, quantize: str | None,
                   lm_head: bool = False) -> WeightLoader | RandomWeights:
            if random_weights:  # synthetic benchmarks: the shapes of a real model, values made on the device
                return RandomWeights(backend, seed=len(label), untied=not target_cfg.tie_word_embeddings)
            return _loader(Checkpoint(path), backend, label, progress, check_weights, quant, quantize, lm_head)

        # Weight bytes per format, as stored and on the device (empty with random weights: bench.weight_bytes counts).
        self.weight_memory: dict[str, WeightMemory] = {}
        # A checkpoint already in block-scaled FP8 keeps its own choice of unquantized modules (LLM checks the rest).
        target_loader = loader(target_cfg.path, "target", target_quant, None if target_quant else quantize,
                               quantize_lm_head)
        if isinstance(target_loader, WeightLoader):  # nothing is uploaded yet
            self._keep_quantized_if_bf16_does_not_fit(target_loader.ckpt, target_cfg, draft_cfg, backend,
                                                      target_quant, quantize, memory_utilization, progress)
        self.hybrid = target_cfg.hybrid is not None
        if tensor_parallel_size == 1:  # today's path, untouched
            self.target = (HybridTargetModel if self.hybrid else TargetModel)(target_cfg, target_loader, backend)
        else:
            self.target = self._tensor_parallel_target(target_cfg, target_loader, backend, tensor_parallel_size,
                                                       loader)
        self.draft: DFlashDraftModel | None = None
        self.tap_layers: list[int] = []
        draft_loader = None
        if draft_cfg is not None:
            self.tap_layers = draft_cfg.target_layer_ids
            draft_loader = loader(draft_cfg.path, "drafter", None, quantize if quantize_draft else None)
            self.draft = DFlashDraftModel(draft_cfg, draft_loader, backend, len(self.tap_layers))
        for label, used in (("target", target_loader), ("drafter", draft_loader)):
            if isinstance(used, WeightLoader):
                self.weight_memory[label] = used.memory
                if progress:
                    print(f"{label} weights: {used.memory.describe()}", file=sys.stderr, flush=True)
        t, d = target_cfg, draft_cfg
        # A tensor-parallel target's cache holds every rank's KV heads side by side (TensorParallelTarget).
        target_kv_heads = self.target.num_kv_heads if tensor_parallel_size > 1 else t.num_kv_heads
        bytes_per_block = kv_elements_per_position(t, d, target_kv_heads) * kv_block_size * backend.act_itemsize
        # Hybrid targets: a live GDN state per admitted sequence, num_state_snapshots prefix snapshots (default
        # 2 x max_num_seqs; 0: prefix caching finds no state to resume from, so hybrids recompute every prompt) and
        # the zero slot (engine/state_pool.py), charged to the budget before the KV blocks are sized.
        snapshots = 2 * max_num_seqs if num_state_snapshots is None else num_state_snapshots
        self.states = StateSlots(max_num_seqs, snapshots, self._copy_states) if self.hybrid else None
        state_bytes = self.states.size * self.target.state_bytes_per_slot() if self.hybrid else 0
        self.state_bytes = state_bytes  # the GDN state pools' device memory (0: no recurrent layers)
        if state_bytes and progress:
            print(f"GDN states: {self.states.size} slots ({max_num_seqs} live, {snapshots} prefix snapshots, 1 zero) "
                  f"x {self.target.state_bytes_per_slot() / 2**20:.1f} MiB = {state_bytes / 2**30:.2f} GiB",
                  file=sys.stderr, flush=True)
        if num_kv_blocks is None:
            wanted = max_num_seqs * seq_blocks
            # A backend that keeps a fixed reserve for activations (CUDA) gets the rest of what a step of
            # max_num_batched_tokens rows needs beyond it, or a large prefill step would run out of memory.
            reserve = backend.activation_reserve
            extra = 0 if reserve is None else max(0, step_activation_bytes(t, max_num_batched_tokens) - reserve)
            budget = int((backend.memory_budget(memory_utilization) - state_bytes - extra) // bytes_per_block)
            # A max_model_len asked for must fit whole; else sequences are as long as the pool allows.
            if budget < (seq_blocks if max_model_len else -(-(max_block_size + 3) // kv_block_size)):
                states = f" after {state_bytes / 2**20:.1f} MiB of GDN states" if state_bytes else ""
                raise BackendError(
                    f"too little memory for the KV cache{states}: room for {max(budget, 0)} blocks of "
                    f"{kv_block_size} tokens ({bytes_per_block / 2**20:.1f} MiB each); raise the memory utilization "
                    f"or free memory"
                )
            num_kv_blocks = min(wanted, budget)
        shape = lambda c, layers, heads=None: (layers, num_kv_blocks + 1, kv_block_size,  # noqa: E731
                                               heads or c.num_kv_heads, c.head_dim)
        self.cache: HybridCache | None = None  # hybrid targets: the KV of the attention layers and the state pools
        try:
            if self.hybrid:
                self.blocks: BlockManager = HybridBlockManager(num_kv_blocks, kv_block_size, self.states)
                self.cache = self.target.new_cache(num_kv_blocks + 1, kv_block_size, self.states.size)
                self.target_kv = self.cache.kv
            else:
                self.blocks = BlockManager(num_kv_blocks, kv_block_size)
                self.target_kv = KVCache(backend.zeros(shape(t, t.num_layers, target_kv_heads), "act"),
                                         backend.zeros(shape(t, t.num_layers, target_kv_heads), "act"))
            self.draft_kv = KVCache(backend.zeros(shape(d, d.num_layers), "act"),
                                    backend.zeros(shape(d, d.num_layers), "act")) if d else None
        except MemoryError:
            raise BackendError(f"too little memory for a KV cache of {num_kv_blocks} blocks of {kv_block_size} tokens "
                               f"({num_kv_blocks * bytes_per_block / 2**30:.1f} GiB)") from None
        self.tape: GDNTape | None = None  # the last target forward's, until commit_states consumes it
        self.tape_slots: Any = None  # int32 [n]: the state slots of that forward's sequences
        # Every position a sequence reaches has a slot in the pool: the RoPE tables need no more rows than that.
        max_positions = min(self.max_model_len, num_kv_blocks * kv_block_size) + max_block_size + 1
        for model in (self.target, self.draft):
            if isinstance(model, HybridTargetModel):
                model.set_rope(max_positions)  # partial rotary: its own tables
            elif model is not None:  # [max_positions, D / 2] each
                model.rope_cos, model.rope_sin = device_rope_tables(backend, model.cfg.rope, model.cfg.head_dim,
                                                                    max_positions)
        self.max_blocks = -(-max_positions // kv_block_size)  # block-table width of every staged batch
        # One block more than the manager hands out: block `num_kv_blocks` is the dummy that padded rows and unused
        # block-table entries point at (never written: padded rows' slots are -1).
        self.dummy_block = num_kv_blocks

    def _keep_quantized_if_bf16_does_not_fit(self, target_ckpt: Checkpoint, target_cfg: TargetConfig,
                                             draft_cfg: DraftConfig | None, backend: Backend,
                                             target_quant: QuantScheme | None, quantize: str | None,
                                             memory_utilization: float, progress: bool) -> None:
        """A CUDA backend dequantizes FP8 and NVFP4 weights to bf16 at load unless tuning.fp8_on_device /
        nvfp4_on_device: where the bf16 form of the target (and drafter) would leave no room for the KV cache of one
        max_model_len sequence, this load keeps the codes on the device instead (quant/memory.py), and says so.
        """
        tuning = getattr(backend, "tuning", None)
        fmt = quantize or (target_quant.format if target_quant is not None else None)
        if tuning is None or fmt not in ("fp8", "nvfp4"):
            return
        flag = f"{fmt}_on_device"
        if getattr(tuning, flag):
            return
        size = backend.act_itemsize
        weights = dequantized_bytes(target_ckpt, size)
        if draft_cfg is not None:
            weights += dequantized_bytes(Checkpoint(draft_cfg.path), size)
        kv = kv_elements_per_position(target_cfg, draft_cfg, target_cfg.num_kv_heads) * size * self.max_model_len
        budget = backend.memory_budget(memory_utilization)
        if keep_quantized(weights, kv, budget):
            backend.tuning = dataclasses.replace(tuning, **{flag: True})
            if progress:
                print(f"{fmt.upper()} weights stay {fmt.upper()} on the device: their bf16 form "
                      f"({weights / 2**30:.1f} GiB) and the KV cache of one {self.max_model_len}-token sequence would "
                      f"not fit in {budget / 2**30:.1f} GiB", file=sys.stderr, flush=True)

    def _tensor_parallel_target(self, cfg: TargetConfig, first: WeightLoader | RandomWeights, backend: Backend,
                                size: int, loader: Callable) -> TensorParallelTarget:
        """size simulated ranks of the target (CPU backend), each loading its slices with a loader of its own."""
        if self.hybrid:
            raise ConfigError(f"{cfg.path}: tensor parallelism over a Gated DeltaNet hybrid is not there yet; "
                              f"use tensor_parallel_size=1")
        if isinstance(first, RandomWeights):
            raise ConfigError("tensor parallelism with random weights is not there yet: use tensor_parallel_size=1")
        loaders = [first] + [loader(cfg.path, f"target rank {r}", None, None) for r in range(1, size)]
        return TensorParallelTarget(cfg, lambda r: loaders[r], backend, size)

    # ---- inputs
    def batch(self, seqs: list[Sequence], ids: list[list[int]], starts: list[int]) -> ForwardBatch:
        """Rows ids[i] of seqs[i] at positions starts[i].. ; keys visible up to the last of those positions."""
        chunks = [Chunk(s, start, list(x)) for s, start, x in zip(seqs, starts, ids)]
        layout = layout_for(chunks, 0, 0, 0, self.max_blocks, state_slots=self.hybrid)
        host = np.empty(layout.size, dtype=np.int32)
        longest = fill(host, layout, chunks, self.blocks.block_size, self.dummy_block)
        return StepTensors(layout, host, self.backend.asarray(host, "i32"), longest).verify_batch(self.backend)

    # ---- model calls
    def target_forward(self, batch: ForwardBatch, with_taps: bool = True,
                       commit: bool = False) -> tuple[Any, Any | None]:
        """commit (hybrid targets): every row of the batch is committed whatever the logits say (plain decoding:
        the row is the pending token), so the forward advances the GDN states itself and keeps no tape; otherwise
        the decode rows leave the states as they were and commit_states advances them after acceptance."""
        taps = self.tap_layers if with_taps and self.tap_layers else None
        with self.backend.inexact_rows(int(batch.meta.cu_seqlens_q[batch.chunked_seqs])):  # the prefill chunks' rows
            if not self.hybrid:
                return self.target.forward(batch, self.target_kv, taps)
            assert batch.state_slots is not None, "a hybrid target's batch names each sequence's state slot"
            use = state_use(self.backend, batch.state_slots, batch.meta.cu_seqlens_q, batch.chunked_seqs, commit,
                            batch.state_slots_device)
            hidden, taps_out, self.tape = self.target.forward(batch, self.cache, use, taps)
        self.tape_slots = use.slots
        return hidden, taps_out

    def commit_tape(self, tape: GDNTape, slots: Any, span: Any) -> None:
        """Advance the GDN states of a verify's sequences (slots int32 [n] on the backend) by the tape's rows in span
        (int32 [2, n] on the backend: rows already committed | rows to commit; HybridTargetModel.commit_span)."""
        self.target.commit_span(tape, self.cache, slots, span)

    def _eager_commit(self, tape: GDNTape | None, slots: Any) -> CommitRun | None:
        """The CommitRun of the last forward's tape, op by op (None: that forward kept no tape)."""
        if tape is None:
            return None
        cu = tape.meta.cu_seqlens_q

        def run(done: list[int], count: list[int]) -> None:
            span = commit_span(cu, done, [d + c for d, c in zip(done, count)])
            self.commit_tape(tape, slots, self.backend.asarray(span, "i32"))
        return run

    def commit_states(self, seqs: list[Sequence], accepted: list[int | None], before: list[int],
                      run: CommitRun | None = None) -> None:
        """After acceptance, on a hybrid target (else nothing to do). `seqs`: the last target forward's sequences in
        its order; accepted[i]: how many of sequence i's verify rows it committed (the pending token and the accepted
        drafts; 0 if it emitted nothing), or None for a prefill chunk, which committed its rows in the forward;
        before[i]: its committed length before the step. The GDN states advance by those rows; where the committed
        length passed a block boundary whose block is now hashed, the state there becomes a snapshot (a verify's
        rows are committed in two runs, up to the boundary and after it; a prefill chunk must end on it).
        run: how a run of the commit executes (a CUDA graph's replay of that forward's commit); None: op by op on the
        last forward's tape. A forward that kept no tape committed its rows itself (target_forward's commit: plain
        decoding, one row per sequence), so only the snapshots are left to take."""
        if not self.hybrid:
            return
        tape, self.tape = self.tape, None
        run = run or self._eager_commit(tape, self.tape_slots)
        blocks: HybridBlockManager = self.blocks  # type: ignore[assignment]
        rows = [n or 0 for n in accepted]
        upto, snaps = list(rows), []
        for i, (s, n, start) in enumerate(zip(seqs, accepted, before)):
            boundary = blocks.snapshot_boundary(s, start, s.num_cached)
            if boundary is None or (n is None and boundary != s.num_cached):
                continue
            # No run (no tape, no graph): committed in the forward, so the state is the one after all the rows and a
            # snapshot can only lie at their end.
            assert run is not None or boundary == s.num_cached, (s.seq_id, start, boundary, s.num_cached)
            snaps.append((blocks.block_hash(s, boundary), s.state_slot))
            upto[i] = 0 if n is None else boundary - start
        if run is not None and any(upto):
            run([0] * len(rows), upto)
        self.states.take(snaps)
        rest = [n - u for n, u in zip(rows, upto)]
        if run is not None and any(rest):
            run(upto, rest)

    def _copy_states(self, src: list[int], dst: list[int]) -> None:
        """Every GDN layer's conv and recurrent state from slots src to slots dst (state_pool.CopyStates)."""
        b, c = self.backend, self.cache
        s, d = (b.asarray(np.asarray(x, dtype=np.int32), "i32") for x in (src, dst))
        for pool in (c.conv, c.states):  # [layers, slots, ...] viewed as copy_slots' [layers, slots, 1, ...]
            b.copy_slots(pool.reshape(pool.shape[0], pool.shape[1], 1, -1), s, d)

    def draft_context(self, taps: Any, batch: ForwardBatch) -> None:
        """Feed the taps of every row of the batch to the drafter's context cache, at the rows' positions."""
        with self.backend.inexact_rows(int(batch.meta.cu_seqlens_q[-1])):
            self.draft.update_context(taps, batch.positions, batch.slots, self.draft_kv)

    def draft_forward(self, batch: ForwardBatch) -> Any:
        with self.backend.inexact_rows(int(batch.meta.cu_seqlens_q[-1])):  # drafts need no decode's rounding
            return self.draft.forward(batch, self.draft_kv, self.target)

    def logits(self, hidden: Any, rows: np.ndarray | None = None) -> Any:
        b = self.backend
        if rows is not None:
            hidden = b.take_rows(hidden, b.asarray(rows, "i32"))
        return self.target.logits(hidden)
