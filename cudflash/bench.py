"""`cudflash bench`: per-step times of autoregressive and speculative decoding, measured with backend events.

Synthetic models have the exact shapes of a real release (random bf16 weights made on the device), because a
decode step's time depends on the shapes, not on the values. With random weights the drafter's proposals
are almost never accepted, so tokens/s for them is a projection at a stated tau, labelled as such.
"""
from __future__ import annotations

import dataclasses
import json
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from cudflash.backends.tuning import CudaTuning
from cudflash.engine.llm_engine import LLM
from cudflash.errors import BackendError
from cudflash.sampling_params import SamplingParams
from cudflash.tiny import TinyHeads, TinyShape, draft_config, target_config
from cudflash.tiny_hybrid import HybridShape, hybrid_config_json, hybrid_drafter_shape


@dataclass(frozen=True, slots=True)
class HybridPair:
    """A synthetic Qwen3.5 hybrid target and its DFlash drafter. The drafter's vocabulary, hidden size, target
    depth and positions come from the target (tiny_hybrid.hybrid_drafter_shape); `drafter` gives the rest."""

    target: HybridShape
    drafter: TinyShape


# Qwen3.5 text_config fields (docs/hybrid.md, "Synthetic shapes", names the sources): 9B from the config.json of
# Qwen/Qwen3.5-9B (as mirrored in leo-kreisman/Qwen3.5-9B-MLX-8bit), 27B from the config of the Qwen3.5/3.6 27B
# text backbone (Qwen3.6-27B's config.json, the same as THUDM/slime's scripts/models/qwen3.5-27B.sh). Layers
# follow full_attention_interval 4 (every 4th layer is full attention), as both configs list them.
QWEN35_9B = HybridShape(vocab_size=248320, hidden_size=4096, num_layers=32, full_attention_interval=4, num_heads=16,
                        num_kv_heads=4, head_dim=256, partial_rotary_factor=0.25, mrope_section=[11, 11, 10],
                        intermediate_size=12288, linear_num_key_heads=16, linear_num_value_heads=32,
                        linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
                        tie_word_embeddings=False, max_position_embeddings=262144, eos_token_id=248044)
QWEN35_27B = dataclasses.replace(QWEN35_9B, hidden_size=5120, num_layers=64, num_heads=24, intermediate_size=17408,
                                 linear_num_value_heads=48)
# z-lab's DFlash drafters for them: 5 layers, block 16, mask token 248070, taps at the default layer ids
# (1 + k (L - 4) / 4), every layer full attention. 27B: the config of z-lab/Qwen3.5-27B-DFlash (as copied in
# HyzeAI/Hyze1B: 32 / 8 heads of 128, intermediate 17408). 9B: 32 heads, taps [1, 8, 15, 22, 29] and the mask id
# from the model card of a fine-tune of z-lab/Qwen3.5-9B-DFlash (guglxni/Qwen3.5-9B-abliterated-DFlash); its 8 KV
# heads of 128 and intermediate 12288 (the target's, as at 27B) are inferred, consistent with the "1B draft head"
# reported for it and the 1.29 GiB of its Q8_0 GGUF.
QWEN35_DRAFTER = TinyShape(draft_layers=5, num_heads=32, num_kv_heads=8, head_dim=128, block_size=16,
                           mask_token_id=248070, eos_token_id=248044)

SYNTHETIC: dict[str, TinyShape | HybridPair] = {
    "qwen3-8b": TinyShape(arch="qwen3", vocab_size=151936, hidden_size=4096, num_layers=36, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=12288, tie_word_embeddings=False,
                          max_position_embeddings=40960, draft_layers=5, block_size=16,
                          target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669, eos_token_id=151645),
    "qwen3-4b": TinyShape(arch="qwen3", vocab_size=151936, hidden_size=2560, num_layers=36, num_heads=32,
                          num_kv_heads=8, head_dim=128, intermediate_size=9728, tie_word_embeddings=True,
                          max_position_embeddings=40960, draft_layers=5, block_size=16,
                          target_layer_ids=[1, 9, 17, 25, 33], mask_token_id=151669, eos_token_id=151645),
    "qwen3.5-9b": HybridPair(QWEN35_9B, dataclasses.replace(QWEN35_DRAFTER, intermediate_size=12288,
                                                            target_layer_ids=[1, 8, 15, 22, 29])),
    "qwen3.5-27b": HybridPair(QWEN35_27B, dataclasses.replace(QWEN35_DRAFTER, intermediate_size=17408,
                                                              target_layer_ids=[1, 16, 31, 46, 61])),
    "tiny": TinyShape(num_layers=4, target_layer_ids=[1, 2], block_size=16, max_position_embeddings=4096),
    "tiny-hybrid": HybridPair(HybridShape(), TinyShape(target_layer_ids=[1, 2], block_size=16)),
}
PROJECTED_TAU = 6.5


def write_synthetic_configs(name: str, folder: Path, drafter: str = "dflash") -> tuple[Path, Path]:
    """config.json of the synthetic target and drafter; `drafter` picks the family of the drafter's heads."""
    spec, heads = SYNTHETIC[name], TinyHeads(kind=drafter)
    if isinstance(spec, HybridPair):
        shape = dataclasses.replace(hybrid_drafter_shape(spec.target, spec.drafter), heads=heads)
        configs = (hybrid_config_json(spec.target), draft_config(shape))
    else:
        shape = dataclasses.replace(spec, heads=heads)
        configs = (target_config(shape), draft_config(shape))
    target, draft = folder / "target", folder / "drafter"
    for path, cfg in zip((target, draft), configs):
        path.mkdir(parents=True, exist_ok=True)
        (path / "config.json").write_text(json.dumps(cfg))
    return target, draft


@dataclass
class BatchResult:
    batch: int
    prompt_len: int
    block: int
    prefill_ms: float  # all prompts of the batch (= time to first token at batch 1)
    ar_step_ms: float
    # The speculative figures are None when the bench times plain decoding (a target without a drafter).
    propose_ms: float | None
    verify_ms: float | None
    accept_ms: float | None
    spec_step_ms: float | None
    tau: float | None  # measured (real checkpoints) or projected (synthetic)
    tau_measured: bool
    ar_tokens_per_s: float
    spec_tokens_per_s: float | None
    verify_gb_per_s: float | None
    propose_gb_per_s: float | None
    ar_gb_per_s: float
    gpu: dict[str, Any] = field(default_factory=dict)
    prefill_tokens_per_s: float | None = None  # batch x prompt_len / prefill_ms


@dataclass
class PrefillResult:
    """bench --prefill-only: the prefill of `batch` prompts of `prompt_len` tokens, in one engine step where the
    token budget allows (max_num_batched_tokens is sized for it), then nothing else."""

    batch: int
    prompt_len: int
    prefill_ms: float  # until every prompt has its first token
    tokens_per_s: float
    gemm_tflop_s: float  # 2 x target weight elements x prompt tokens / time: the share of it the GEMMs account for
    gpu: dict[str, Any] = field(default_factory=dict)


def weight_bytes(obj: Any, elements: bool = False) -> int:
    """Bytes (or, with `elements`, elements) of every array reachable from a model object, each counted once."""
    seen: set[int] = set()

    def walk(x: Any) -> int:
        if hasattr(x, "nbytes") and hasattr(x, "shape"):
            if id(x) in seen:
                return 0
            seen.add(id(x))
            return int(x.size) if elements else int(x.nbytes)
        if isinstance(x, (list, tuple)):
            return sum(walk(v) for v in x)
        if hasattr(x, "__dataclass_fields__"):
            return sum(walk(getattr(x, f)) for f in x.__dataclass_fields__)
        return 0

    return sum(walk(v) for k, v in vars(obj).items() if not k.startswith("rope"))


def weight_memory(llm: LLM) -> dict[str, dict[str, Any]]:
    """Per model: bytes on the device (every array it holds), and per checkpoint format (bf16, fp8, nvfp4, ...) the
    bytes as stored and on the device, where the weights came from a checkpoint (not with --synthetic)."""
    out: dict[str, dict[str, Any]] = {}
    for label, model in (("target", llm.runner.target), ("drafter", llm.runner.draft)):
        if model is None:
            continue
        mem = llm.runner.weight_memory.get(label)
        out[label] = {"device_bytes": weight_bytes(model),
                      "stored_by_format": dict(mem.stored) if mem else None,
                      "device_by_format": dict(mem.device) if mem else None}
    return out


def format_weight_memory(memory: dict[str, dict[str, Any]], state_bytes: int = 0) -> str:
    """The weights' device memory per model (and format), and a hybrid target's GDN state pools beside them."""
    parts = []
    for label, m in memory.items():
        formats = "" if not m["stored_by_format"] else " (" + ", ".join(
            f"{fmt}: {m['stored_by_format'][fmt] / 1e9:.3f} GB stored, {m['device_by_format'][fmt] / 1e9:.3f} GB on "
            f"the device" for fmt in m["stored_by_format"]) + ")"
        parts.append(f"{label} {m['device_bytes'] / 1e9:.3f} GB{formats}")
    line = "weights on the device: " + "; ".join(parts)
    return line + (f"; GDN state pools {state_bytes / 1e9:.3f} GB" if state_bytes else "")


class PhaseTimer:
    """Backend events at the phase boundaries of each engine step; read after one synchronize."""

    def __init__(self, backend):
        self.b, self.steps = backend, []

    def start(self) -> None:
        self.steps.append({"start": self.b.event()})

    def __call__(self, phase: str) -> None:
        self.steps[-1][phase] = self.b.event()

    def mean_ms(self, a: str, z: str) -> float:
        return statistics.mean(self.b.elapsed_ms(s[a], s[z]) for s in self.steps)


def gpu_readings() -> dict[str, Any]:
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(0)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        name = pynvml.nvmlDeviceGetName(h)
        return {"power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000,
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "memory_used_gib": mem.used / 2**30,
                "name": name.decode() if isinstance(name, bytes) else name}  # bytes from older bindings
    except Exception:  # no NVML (CPU backend, or the library is missing): report nothing rather than guess
        return {}


def copy_bandwidth_gb_s(backend) -> float:
    """Device-to-device copy, bytes read + written, the ceiling every GB/s figure is compared with. The numpy
    backend's "device" is host memory, so there it is a host copy (smaller: the host's caches are not a GPU's)."""
    if backend.name != "cuda":
        return host_copy_bandwidth_gb_s()
    import cupy

    n = 2 * 2**30
    a, b = cupy.empty(n, dtype=cupy.uint8), cupy.empty(n, dtype=cupy.uint8)
    a.fill(1)
    for _ in range(3):
        b[...] = a
    start = backend.event()
    for _ in range(10):
        b[...] = a
    end = backend.event()
    backend.synchronize()
    return 2 * n * 10 / (backend.elapsed_ms(start, end) * 1e-3) / 1e9


def timed_prefill(llm: LLM, batch: int, prompt_len: int, params: SamplingParams) -> tuple[float, list[int]]:
    """Prefill `batch` random prompts of `prompt_len` tokens after one throwaway prefill of the same length (which
    compiles the prefill kernels and sizes cuBLAS's choices); returns (ms until every one has its first token,
    request ids)."""
    b, sched = llm.backend, llm.scheduler
    rng = np.random.default_rng(batch)
    vocab = llm.target_cfg.vocab_size
    warm = llm.add_request(rng.integers(2, vocab - 2, prompt_len).tolist(), SamplingParams(max_tokens=1))
    while not llm.requests[warm].output_ids:
        llm.engine.run(sched.schedule(), llm.block_size)
    drop(llm, [warm])
    ids = [llm.add_request(rng.integers(2, vocab - 2, prompt_len).tolist(), params) for _ in range(batch)]
    seqs = [llm.requests[i] for i in ids]
    b.synchronize()
    start = b.event()
    while any(s.is_prefilling or not s.output_ids for s in seqs):
        llm.engine.run(sched.schedule(), llm.block_size)
    end = b.event()
    b.synchronize()
    return b.elapsed_ms(start, end), ids


def drop(llm: LLM, ids: list[int]) -> None:
    for i in ids:
        llm.abort(i)
        llm.requests.pop(i)


def bench_prefill(llm: LLM, batch: int, prompt_len: int) -> PrefillResult:
    ms, ids = timed_prefill(llm, batch, prompt_len, SamplingParams(max_tokens=1))
    drop(llm, ids)
    tokens, target = batch * prompt_len, llm.runner.target
    # Every prompt row runs the layers' GEMMs; the embedding is gathered and the LM head runs on last rows only.
    heads = target.embed_tokens.size + (0 if target.lm_head is target.embed_tokens else target.lm_head.size)
    elements = weight_bytes(target, elements=True) - int(heads)
    return PrefillResult(batch=batch, prompt_len=prompt_len, prefill_ms=ms, tokens_per_s=tokens / ms * 1e3,
                         gemm_tflop_s=2 * elements * tokens / (ms * 1e-3) / 1e12, gpu=gpu_readings())


def host_copy_bandwidth_gb_s(n: int = 2**27, repeats: int = 5) -> float:
    a, b = np.ones(n, dtype=np.uint8), np.empty(n, dtype=np.uint8)
    np.copyto(b, a)  # first touch of b's pages
    start = time.perf_counter()
    for _ in range(repeats):
        np.copyto(b, a)
    return 2 * n * repeats / (time.perf_counter() - start) / 1e9


def bench_batch(llm: LLM, batch: int, prompt_len: int, steps: int, warmup: int, measured_tau: bool) -> BatchResult:
    b, runner, sched = llm.backend, llm.runner, llm.scheduler
    params = SamplingParams(max_tokens=prompt_len + 2 * (steps + warmup) * llm.block_size + 8, ignore_eos=True)
    prefill_ms, ids = timed_prefill(llm, batch, prompt_len, params)
    seqs = [llm.requests[i] for i in ids]
    prefill_tps = batch * prompt_len / prefill_ms * 1e3

    def run(block: int) -> PhaseTimer:
        timer = PhaseTimer(b)
        for i in range(warmup + steps):
            plan = sched.schedule()
            assert len(plan.decodes) == batch and not plan.prefills
            if i == warmup:
                timer.steps.clear()
            timer.start()
            llm.engine.run(plan, block, timer)
        b.synchronize()
        return timer

    spec_timer = run(llm.block_size) if llm.speculative else None  # None: plain decoding only (no drafter)
    accepted = [a for s in seqs for a in s.acceptance_lengths[-steps:]]
    ar_timer = run(1)
    drop(llm, ids)
    ar_ms, target_bytes = ar_timer.mean_ms("start", "accept"), weight_bytes(runner.target)
    if spec_timer is None:
        return BatchResult(batch=batch, prompt_len=prompt_len, block=1, prefill_ms=prefill_ms, ar_step_ms=ar_ms,
                           propose_ms=None, verify_ms=None, accept_ms=None, spec_step_ms=None, tau=None,
                           tau_measured=False, ar_tokens_per_s=batch / ar_ms * 1e3, spec_tokens_per_s=None,
                           verify_gb_per_s=None, propose_gb_per_s=None, ar_gb_per_s=target_bytes / ar_ms / 1e6,
                           gpu=gpu_readings(), prefill_tokens_per_s=prefill_tps)
    tau = statistics.mean(accepted) if measured_tau else PROJECTED_TAU
    # A step runs from the event before it to the event after its accept. Plain decoding queues each next step
    # before it waits (cuda_graph.StepGraphs.decode), so the device passes both events only as the step queued in
    # front of them completes: the AR time is then the interval between two step completions, which is what a user
    # gets per token, any idle device time included.
    spec_ms = spec_timer.mean_ms("start", "accept")
    propose_ms = spec_timer.mean_ms("start", "propose")
    verify_ms = spec_timer.mean_ms("propose", "verify")
    draft_bytes = weight_bytes(runner.draft)
    lm_head_bytes = int(runner.target.lm_head.nbytes)
    return BatchResult(
        batch=batch, prompt_len=prompt_len, block=llm.block_size, prefill_ms=prefill_ms, ar_step_ms=ar_ms,
        propose_ms=propose_ms, verify_ms=verify_ms, accept_ms=spec_timer.mean_ms("verify", "accept"),
        spec_step_ms=spec_ms, tau=tau, tau_measured=measured_tau,
        ar_tokens_per_s=batch / ar_ms * 1e3, spec_tokens_per_s=batch * tau / spec_ms * 1e3,
        verify_gb_per_s=target_bytes / verify_ms / 1e6, propose_gb_per_s=(draft_bytes + lm_head_bytes) / propose_ms / 1e6,
        ar_gb_per_s=target_bytes / ar_ms / 1e6, gpu=gpu_readings(), prefill_tokens_per_s=prefill_tps,
    )


def format_table(results: list[BatchResult], copy_gb_s: float | None) -> str:
    head = (f"{'batch':>5} {'prompt':>6} {'prefill':>9} {'tok/s':>7} {'AR step':>8} {'propose':>8} {'verify':>8} {'accept':>7} "
            f"{'spec step':>9} {'tau':>9} {'AR tok/s':>9} {'spec tok/s':>10} {'verify GB/s':>11} {'% copy':>6}")
    lines = [head, "-" * len(head)]
    def cell(x: float | None, width: int, unit: str = "", digits: int = 2) -> str:
        return f"{'-':>{width + len(unit)}}" if x is None else f"{x:>{width}.{digits}f}{unit}"

    for r in results:
        pct = f"{100 * r.verify_gb_per_s / copy_gb_s:5.0f}%" if copy_gb_s and r.verify_gb_per_s else "     -"
        tau = "-" if r.tau is None else f"{r.tau:.2f}" + ("" if r.tau_measured else " proj")
        lines.append(f"{r.batch:>5} {r.prompt_len:>6} {r.prefill_ms:>7.2f}ms {cell(r.prefill_tokens_per_s, 7, digits=0)} "
                     f"{r.ar_step_ms:>6.2f}ms "
                     f"{cell(r.propose_ms, 6, 'ms')} {cell(r.verify_ms, 6, 'ms')} {cell(r.accept_ms, 5, 'ms')} "
                     f"{cell(r.spec_step_ms, 7, 'ms')} {tau:>9} {r.ar_tokens_per_s:>9.1f} "
                     f"{cell(r.spec_tokens_per_s, 10, digits=1)} {cell(r.verify_gb_per_s, 11, digits=1)} {pct}")
    if copy_gb_s:
        lines.append(f"measured device copy bandwidth: {copy_gb_s:.0f} GB/s (read + write)")
    for r in results:  # NVML, read right after each batch's timed steps
        g = r.gpu
        if g:
            lines.append(f"batch {r.batch}: {g.get('name', 'GPU')} at {g['power_w']:.0f} W, SM clock {g['sm_clock_mhz']} "
                         f"MHz, {g['memory_used_gib']:.1f} GiB in use")
    if results and results[0].tau is not None and not results[0].tau_measured:
        lines.append(f"synthetic weights: spec tok/s is a projection at tau {PROJECTED_TAU} (batch x tau / step time)")
    return "\n".join(lines)


# The linear weights of a target layer that --weights replaces: a dense layer's, a GDN layer's (in_proj, out_proj) and
# a gated-attention layer's (qkvg, o_proj), with the MLP's.
PROJECTIONS = ("qkv", "qkvg", "in_proj", "o_proj", "out_proj", "gate_up", "down")


def synthetic_quantized(target: Any, backend: Any, weights: str, std: float = 0.02, lm_head: bool = False,
                        draft: Any = None) -> None:
    """Replace the synthetic target's linear weights (every layer's projections: PROJECTIONS) by FP8 or NVFP4
    weights (`weights`) of the same shapes made on the device (fp8_weight.random_fp8, fp4_weight.random_fp4), as an
    FP8 / NVFP4 checkpoint kept on the device holds them; the embedding stays bf16, and so does the LM head (as in
    the Qwen -FP8 releases) unless `lm_head` (quantize_lm_head: a head in that format beside a tied embedding too).
    `draft` (quantize_draft): the drafter's projections too (its layers' q, o, gate_up, down and the fused K/V; fc
    and the heads stay bf16, as quantize_draft leaves them). Before the first step, so every captured graph reads
    them."""
    if backend.name != "cuda":
        raise BackendError(f"bench --weights {weights} needs the cuda backend (the weights are made on the device)")
    if any(not any(hasattr(layer, name) for name in PROJECTIONS) for layer in target.layers):
        raise BackendError(f"bench --weights {weights}: a target layer has none of the projections {PROJECTIONS}")
    if draft is not None and not hasattr(draft, "fused_kv"):
        raise BackendError(f"bench --quantize-draft replaces a DFlash-layout drafter's projections; "
                           f"{type(draft).__name__} has others")
    from cudflash.backends.fp4_weight import random_fp4
    from cudflash.backends.fp8_weight import random_fp8

    make = {"fp8": random_fp8, "nvfp4": random_fp4}[weights]
    for i, layer in enumerate(target.layers):
        for j, name in enumerate(PROJECTIONS):
            if hasattr(layer, name):
                setattr(layer, name, make(getattr(layer, name).shape, std, seed=1000 + len(PROJECTIONS) * i + j))
    if lm_head:
        target.lm_head = make(target.lm_head.shape, std, seed=999)
    if draft is not None:
        for i, layer in enumerate(draft.layers):
            for j, name in enumerate(("q_proj", "o_proj", "gate_up", "down")):
                setattr(layer, name, make(getattr(layer, name).shape, std, seed=2000 + 4 * i + j))
        draft.fused_kv = make(draft.fused_kv.shape, std, seed=1999)


@dataclass(frozen=True, slots=True)
class StepBytes:
    """What the phases of one decode step must move at least, per model and per sequence.

    Weights are read once per forward (an untied embedding table is left out: a step gathers a few of its rows).
    Per sequence, each forward reads the KV of its context in every attention layer (a hybrid's GDN layers hold
    none) and writes its new rows' KV; a Gated DeltaNet hybrid also reads each GDN layer's conv + recurrent state
    (float32) and, once the step's tokens are known, writes it back."""

    target_weights: int
    draft_weights: int  # the drafter's own weights and the target's LM head it borrows
    kv_per_position: int  # K + V of one position over the target's attention layers
    draft_kv_per_position: int  # the same over the drafter's layers (its context K/V)
    state_bytes: int  # one sequence's GDN conv + recurrent states over all GDN layers; 0 for a dense target
    context: int  # positions each step attends to: the prompt's
    draft_context: int  # summed over the drafter's layers: min(context, window) each (its sliding windows)
    block: int  # rows a verify runs per sequence


def phase_bytes(b: StepBytes, batch: int) -> dict[str, int]:
    """Bytes read + written by each phase at `batch` sequences. AR: one row, the state read and written back.
    Verify: `block` rows, the state only read (the commit writes it after acceptance, in the accept phase).
    Propose: the drafter over its context. Spec step: verify + propose + the commit's state write."""
    kv = b.context * b.kv_per_position
    ar = b.target_weights + batch * (kv + b.kv_per_position + 2 * b.state_bytes)
    verify = b.target_weights + batch * (kv + b.block * b.kv_per_position + b.state_bytes)
    propose = b.draft_weights + batch * b.draft_context * b.draft_kv_per_position
    return {"AR step": ar, "verify": verify, "propose": propose, "spec step": verify + propose + batch * b.state_bytes}


def phase_floors_ms(result: BatchResult, nbytes: dict[str, int], copy_gb_s: float) -> dict[str, float]:
    """Each phase's floor: its bytes over the measured copy bandwidth (read + write); plain decoding has AR only."""
    per_ms = copy_gb_s * 1e6  # bytes per ms
    phases = nbytes if result.verify_ms is not None else {"AR step": nbytes["AR step"]}
    return {k: v / per_ms for k, v in phases.items()}


def step_bytes(llm: LLM, context: int) -> StepBytes:
    """StepBytes of the loaded pair: weights as held on the device, KV and state sizes from the configs."""
    runner, cfg, item = llm.runner, llm.target_cfg, llm.backend.act_itemsize
    target, draft, dcfg = runner.target, runner.draft, runner.draft_cfg
    gathered = 0 if target.lm_head is target.embed_tokens else int(target.embed_tokens.nbytes)
    attention_layers = len(cfg.hybrid.full_layers) if cfg.hybrid else cfg.num_layers
    windows = (dcfg.layer_windows or [0] * dcfg.num_layers) if dcfg else []
    return StepBytes(
        target_weights=weight_bytes(target) - gathered,
        draft_weights=weight_bytes(draft) + int(target.lm_head.nbytes) if draft else 0,
        kv_per_position=attention_layers * 2 * cfg.num_kv_heads * cfg.head_dim * item,
        draft_kv_per_position=2 * dcfg.num_kv_heads * dcfg.head_dim * item if dcfg else 0,
        state_bytes=target.state_bytes_per_slot() if cfg.hybrid else 0,
        context=context, draft_context=sum(min(context, w or context) for w in windows),
        block=llm.block_size)


def format_floors(results: list[BatchResult], floors: list[dict[str, float]],
                  nbytes: list[dict[str, int]]) -> str:
    lines = []
    for r, f, n in zip(results, floors, nbytes):
        got = {"AR step": r.ar_step_ms, "verify": r.verify_ms, "propose": r.propose_ms, "spec step": r.spec_step_ms}
        lines.append(f"batch {r.batch} byte floors: " + ", ".join(
            f"{k} {v:.3f} ms = {n[k] / 1e9:.3f} GB (x{got[k] / v:.2f})" for k, v in f.items()))
    return "\n".join(lines)


def format_prefill(results: list[PrefillResult]) -> str:
    lines = [f"{'batch':>5} {'prompt':>6} {'prefill':>10} {'tok/s':>9} {'GEMM TFLOP/s':>12}"]
    lines += [f"{r.batch:>5} {r.prompt_len:>6} {r.prefill_ms:>8.2f}ms {r.tokens_per_s:>9.0f} {r.gemm_tflop_s:>12.1f}"
              for r in results]
    return "\n".join(lines)


def draft_options(args) -> dict[str, Any] | None:
    opts = {"context_window": args.draft_context_window, "tree_budget": getattr(args, "tree_budget", None)}
    return {k: v for k, v in opts.items() if v is not None} or None


def run_bench(args, tuning: CudaTuning | None = None) -> str:
    tuning = tuning or CudaTuning()
    synthetic = args.synthetic is not None
    folder = tempfile.mkdtemp(prefix="cudflash-bench-") if synthetic else None
    target, draft = (write_synthetic_configs(args.synthetic, Path(folder), args.drafter) if synthetic
                     else (args.target, args.draft))
    batches = [int(x) for x in str(args.batch).split(",")]
    llm = LLM(target, draft=draft, backend=args.backend, block_size=args.block_size, max_num_seqs=max(batches),
              max_num_batched_tokens=max(8192, args.prompt_len * max(batches)), random_weights=synthetic,
              progress=not synthetic, memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, tuning=tuning,
              draft_options=draft_options(args),
              quantize=getattr(args, "quantize", None),
              quantize_draft=getattr(args, "quantize_draft", False) and not synthetic,
              quantize_lm_head=getattr(args, "quantize_lm_head", False) and not synthetic)
    weights = getattr(args, "weights", "bf16")
    if weights != "bf16":
        synthetic_quantized(llm.runner.target, llm.backend, weights, lm_head=getattr(args, "quantize_lm_head", False),
                            draft=llm.runner.draft if getattr(args, "quantize_draft", False) else None)
    memory = weight_memory(llm)
    copy = copy_bandwidth_gb_s(llm.backend)
    report: dict[str, Any] = {"backend": llm.backend.name, "model": args.synthetic or str(target),
                              "drafter": args.drafter if synthetic else draft and str(draft), "copy_gb_per_s": copy,
                              "tuning": tuning.changed(), "weights": memory, "weight_format": weights,
                              "draft_options": draft_options(args), "state_pool_bytes": llm.runner.state_bytes}
    if getattr(args, "prefill_only", False):
        prefills = [bench_prefill(llm, n, args.prompt_len) for n in batches]
        report["prefill"] = [asdict(r) for r in prefills]
        table = format_prefill(prefills) + "\n" + format_weight_memory(memory, llm.runner.state_bytes)
    else:
        table = decode_report(llm, args, batches, synthetic, copy, memory, report)
    if args.json is not None:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if weights != "bf16":
        table += f"\ntarget linear weights: {weights} (synthetic, made on the device)"
    changed = tuning.changed()  # an A/B run says what it changed
    return table + "\ntuning: " + ", ".join(f"{k}={v}" for k, v in changed.items()) if changed else table


def decode_report(llm: LLM, args, batches: list[int], synthetic: bool, copy: float,
                  memory: dict[str, dict[str, Any]], report: dict[str, Any]) -> str:
    """Time the decode phases per batch size; fill `report` with the results, each phase's bytes and floors."""
    results = [bench_batch(llm, n, args.prompt_len, args.steps, args.warmup, measured_tau=not synthetic)
               for n in batches]
    sizes = step_bytes(llm, args.prompt_len)
    nbytes = [phase_bytes(sizes, r.batch) for r in results]
    floors = [phase_floors_ms(r, n, copy) for r, n in zip(results, nbytes)]
    report.update(results=[asdict(r) for r in results], step_bytes=asdict(sizes), phase_bytes=nbytes,
                  floors_ms=floors)
    table = format_table(results, copy) + "\n" + format_weight_memory(memory, llm.runner.state_bytes)
    table += "\n" + format_floors(results, floors, nbytes)
    if getattr(args, "tree_budget", None):
        table += (f"\nspeculative steps verify a draft tree of {args.tree_budget} nodes per sequence "
                  f"({args.tree_budget + 1} rows with the root)")
    return table
