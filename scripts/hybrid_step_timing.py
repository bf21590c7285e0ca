"""Wall time of a hybrid (Gated DeltaNet) target's decode step, op by op against replayed from CUDA graphs.

A random hybrid checkpoint of moderate width (8 layers: 6 GDN, 2 attention; hidden 1024; GDN heads 4 / 8 of 128) is
written to a temporary folder; each engine serves `batch` prompts of 64 tokens, and once every sequence decodes,
the median wall time of `steps` engine steps is printed (a step ends when its tokens are back on the host, so the
wall time is the step's whole cost: staging, launches, device time, acceptance, the commit). Plain decoding and a
DFlash drafter (block 16). Usage: PYTHONPATH=. python3 scripts/hybrid_step_timing.py [--steps 24]
"""
from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from cudflash import LLM, SamplingParams
from cudflash.tiny import TinyShape
from cudflash.tiny_hybrid import HybridShape, write_hybrid_drafter, write_hybrid_target

SHAPE = HybridShape(checkpoint_class="causal", vocab_size=4096, hidden_size=1024, num_layers=8, num_heads=8,
                    num_kv_heads=2, head_dim=128, mrope_section=[8, 4, 4], intermediate_size=2816,
                    linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=128,
                    linear_value_head_dim=128, vision=False, mtp=False)
DRAFT = TinyShape(target_layer_ids=[1, 6], block_size=16, draft_head_dim=128, draft_layers=2)


def step_ms(llm: LLM, prompts: list[list[int]], steps: int) -> float:
    """Median wall time (ms) of `steps` decode-only steps of `prompts` in one batch."""
    params = SamplingParams(max_tokens=1024, ignore_eos=True)  # more than the steps timed emit
    ids = [llm.add_request(p, params) for p in prompts]
    seqs = [llm.requests[i] for i in ids]
    while not all(s.output_ids for s in seqs):  # prefill (op by op in both engines)
        llm.step()
    for _ in range(3):  # captures, warm-up
        llm.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        llm.step()
        times.append((time.perf_counter() - t0) * 1e3)
    for i in ids:
        llm.abort(i)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=24)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as root:
        target = write_hybrid_target(Path(root) / "t", SHAPE, seed=1)
        drafter = write_hybrid_drafter(Path(root) / "d", SHAPE, DRAFT, seed=2)
        prompts = [rng.integers(2, SHAPE.vocab_size, 64).tolist() for _ in range(8)]
        print(f"hybrid decode step, median of {args.steps} (ms): {SHAPE.num_layers} layers, hidden "
              f"{SHAPE.hidden_size}")
        for draft, label in ((None, "plain"), (drafter, "dflash block 16")):
            for batch in (1, 8):
                ms = {}
                for eager in (True, False):
                    llm = LLM(target, draft=draft, backend="cuda", enforce_eager=eager, max_num_seqs=8,
                              enable_prefix_caching=False, max_model_len=2048)
                    ms[eager] = step_ms(llm, prompts[:batch], args.steps)
                    del llm
                print(f"  {label:16s} batch {batch}: eager {ms[True]:7.3f}  graphs {ms[False]:7.3f}  "
                      f"({ms[True] / ms[False]:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
