"""How often does each way of running the target flip a greedy token of the tiny pair's goldens?

Teacher-forced (the golden continuation is fed in, so one flip does not derail the rest): for each of the 32
prompts, the prompt is prefilled, then the 128 golden tokens are fed in chunks of C rows (C = 1: autoregressive
decode, C = 16: a verify block, C = 128: one prefill), and the argmax at every position is compared with the
golden next token. 4096 positions per row of the table, so flip rates are measured, not guessed from which 32
free-running prompts happen to survive. Also: relative logit error against the numpy float32 backend, and how
many positions give bitwise-equal logits to the C = 1 run.

Usage: PYTHONPATH=$PWD python3 scripts/flip_rates.py [pair_dir]
"""
import json
import sys
from pathlib import Path

import numpy as np

from cudflash.engine.llm_engine import LLM
from cudflash.engine.sequence import Sequence
from cudflash.sampling_params import SamplingParams


def teacher_forced_logits(llm: LLM, prompt: list[int], golden: list[int], chunk: int) -> np.ndarray:
    runner = llm.runner
    ids = prompt + golden
    seq = Sequence(-1, list(ids), SamplingParams())
    runner.blocks.reserve(seq, len(ids))
    out = []
    try:
        start, step = 0, len(prompt)
        while start < len(ids) - 1:
            piece = ids[start:start + step]
            hidden, _ = runner.target.forward(runner.batch([seq], [piece], [start]), runner.target_kv)
            rows = np.arange(len(piece)) if start else np.array([len(piece) - 1])
            out.append(runner.backend.to_numpy(runner.logits(hidden, rows)))
            start, step = start + len(piece), chunk
    finally:
        runner.blocks.free(seq)
    return np.concatenate(out)[: len(golden)]  # [128, V]: row i predicts golden[i]


def main() -> None:
    pair = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-code-pair")
    goldens = [json.loads(line) for line in (pair / "golden_dev.jsonl").read_text().splitlines()]
    cpu = LLM(pair / "target", backend="cpu")
    gpu = LLM(pair / "target", backend="cuda")
    ref = [teacher_forced_logits(cpu, g["prompt_ids"], g["ar_ids"], 128) for g in goldens]
    assert all((r.argmax(1) == g["ar_ids"]).all() for r, g in zip(ref, goldens)), "float32 must match the goldens"
    base = None
    print(f"{'rows per forward':>16} {'flips':>10} {'rel err':>9} {'== C=1':>8}  flipped at (prompt, token, f32 gap)")
    for chunk in (1, 16, 128):
        runs = [teacher_forced_logits(gpu, g["prompt_ids"], g["ar_ids"], chunk) for g in goldens]
        base = base or runs
        flips = []
        for p, (lg, r, g) in enumerate(zip(runs, ref, goldens)):
            for t in np.flatnonzero(lg.argmax(1) != np.asarray(g["ar_ids"])):
                top = np.sort(r[t])[-2:]
                flips.append(f"({p},{t},{(top[1] - top[0]) / abs(top[1]):.1e})")
        err = np.mean([np.linalg.norm(a - b) / np.linalg.norm(b) for a, b in zip(runs, ref)])
        same = sum(int((a == b).all(axis=1).sum()) for a, b in zip(runs, base))
        print(f"{chunk:>16} {len(flips):>5}/4096 {err:9.2e} {same:>8}  {' '.join(flips)}", flush=True)


if __name__ == "__main__":
    main()
