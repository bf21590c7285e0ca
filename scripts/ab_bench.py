"""A/B of `cudflash bench` between two source trees on one machine, in one call: rounds alternate A, B, A, B, ...

Usage: python3 scripts/ab_bench.py A_DIR B_DIR [--rounds N] [-- bench arguments]
Each tree is a folder holding `cudflash/` and `kernels/` (e.g. `git archive COMMIT cudflash kernels | tar -x -C DIR`;
`.` for this checkout). The bench arguments default to `--synthetic qwen3-8b --backend cuda --batch 1 --prompt-len
512 --new 20`. Prints, per batch size, each tree's per-round step times and their medians, and B against A.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEFAULT = ["--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20"]
FIELDS = ("ar_step_ms", "propose_ms", "verify_ms", "spec_step_ms")


def bench(tree: Path, args: list[str]) -> dict[int, dict[str, float]]:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "bench.json"
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        subprocess.run([sys.executable, "-m", "cudflash", "bench", *args, "--json", str(out)], env=env, check=True,
                       cwd=tmp, stdout=sys.stderr)
        return {r["batch"]: {f: r[f] for f in FIELDS} for r in json.loads(out.read_text())["results"]}


def main(argv: list[str]) -> None:
    cut = argv.index("--") if "--" in argv else len(argv)
    own, extra = argv[:cut], argv[cut + 1:]
    rounds = 2
    if "--rounds" in own:
        i = own.index("--rounds")
        rounds = int(own[i + 1])
        del own[i:i + 2]
    trees = [Path(own[0]), Path(own[1])]
    args = DEFAULT + extra  # later options override earlier ones in argparse
    runs: list[list[dict]] = [[], []]
    for _ in range(rounds):
        for k, tree in enumerate(trees):
            runs[k].append(bench(tree, args))
    print(f"A = {trees[0]}   B = {trees[1]}   {rounds} rounds, alternating; bench {' '.join(args)}")
    print(f"{'batch':>5} {'field':>13} {'A rounds':>24} {'B rounds':>24} {'A med':>8} {'B med':>8} {'B/A':>7}")
    for batch in sorted(runs[0][0]):
        for f in FIELDS:
            a = [r[batch][f] for r in runs[0]]
            b = [r[batch][f] for r in runs[1]]
            ma, mb = statistics.median(a), statistics.median(b)
            print(f"{batch:>5} {f:>13} {' '.join(f'{x:.3f}' for x in a):>24} {' '.join(f'{x:.3f}' for x in b):>24} "
                  f"{ma:>8.3f} {mb:>8.3f} {mb / ma:>7.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
