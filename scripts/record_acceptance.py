"""Record cudflash's float32 CPU speculative run of a pair into its golden_dev.jsonl (`spec_ids`,
`acceptance_lengths`), for a pair whose goldens hold only the target's own greedy tokens (`ar_ids`: transformers,
float32), such as tests/data/tiny-hybrid-pair. tests/test_hybrid_pair.py checks the CPU reproduces what is recorded
and that spec_ids == ar_ids; the GPU test compares its tau with the recorded one.

    python3 scripts/record_acceptance.py tests/data/tiny-hybrid-pair [--max-new-tokens 128]
"""
from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from cudflash import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("pair", type=Path, help="a folder with target/, drafter/ and golden_dev.jsonl")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    args = ap.parse_args()
    path = args.pair / "golden_dev.jsonl"
    goldens = [json.loads(line) for line in path.read_text().splitlines()]
    llm = LLM(args.pair / "target", draft=args.pair / "drafter", backend="cpu")
    outs = llm.generate([g["prompt_ids"] for g in goldens],
                        SamplingParams(max_tokens=args.max_new_tokens, ignore_eos=True))
    for g, o in zip(goldens, outs):
        g["spec_ids"], g["acceptance_lengths"] = list(o.token_ids), list(o.acceptance_lengths)
    path.write_text("".join(json.dumps(g) + "\n" for g in goldens))
    same = sum(g["spec_ids"] == g["ar_ids"] for g in goldens)
    print(f"{path}: spec == ar on {same}/{len(goldens)} prompts, tau "
          f"{statistics.mean(statistics.mean(g['acceptance_lengths']) for g in goldens):.4f}")


if __name__ == "__main__":
    main()
