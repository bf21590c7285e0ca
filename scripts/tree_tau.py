"""tau of tree verification against the single path on the tiny pair's dev prompts (the CPU backend: exact).

Usage: python3 scripts/tree_tau.py [--backend cpu] [--budgets 16,32,64,128] [--new 128] [PAIR_DIR]
Prints, per budget, the mean acceptance length (the mean over prompts of each prompt's mean), its ratio to the
single path's, and how many prompts' tokens equal the single path's (greedy: all must).
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cudflash import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair", nargs="?", default=str(Path(__file__).resolve().parents[1] / ".." / "shared" / "models"
                                                   / "tiny-code-pair"))
    ap.add_argument("--backend", default="cpu")
    ap.add_argument("--budgets", default="16,32,64,128")
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    pair = Path(args.pair)
    prompts = json.loads((pair / "prompts_dev.json").read_text())["prompts"]
    params = SamplingParams(max_tokens=args.new, ignore_eos=True)
    runs = {}
    for budget in [None] + [int(b) for b in args.budgets.split(",")]:
        llm = LLM(pair / "target", draft=pair / "drafter", backend=args.backend,
                  draft_options=None if budget is None else {"tree_budget": budget})
        outs = llm.generate(prompts, params)
        runs[budget] = ([o.token_ids for o in outs], statistics.mean(o.tau for o in outs))
    base_ids, base_tau = runs[None]
    print(f"{'budget':>8} {'tau':>7} {'x single':>9} {'same tokens':>12}")
    for budget, (ids, tau) in runs.items():
        same = sum(a == b for a, b in zip(ids, base_ids))
        print(f"{budget or 'single':>8} {tau:7.3f} {tau / base_tau:9.3f} {same:>8}/{len(ids)}")


if __name__ == "__main__":
    main()
