"""A/B (or a bisect: A/B/C/...) of `cudflash bench` between source trees on one machine, in one call: rounds go
round robin A, B, C, A, B, C, ... so that drift hits every tree alike.

Usage: python3 scripts/ab_bench.py A_DIR B_DIR [MORE_DIRS ...] [--rounds N] [-- bench arguments]
Each tree is a folder holding `cudflash/` and `kernels/` (e.g. `git archive COMMIT cudflash kernels | tar -x -C DIR`;
`.` for this checkout); relative paths are taken from the current folder. The bench arguments default to
`--synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20`. Prints, per batch size and field, each
tree's per-round step times, their median, and the median against A's.
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
    if len(own) < 2:
        raise SystemExit(__doc__)
    trees = [Path(t).resolve() for t in own]
    args = DEFAULT + extra  # later options override earlier ones in argparse
    runs: list[list[dict]] = [[] for _ in trees]
    for _ in range(rounds):
        for k, tree in enumerate(trees):
            runs[k].append(bench(tree, args))
    print(f"{rounds} rounds, round robin; bench {' '.join(args)}")
    for k, tree in enumerate(trees):
        print(f"  {chr(65 + k)} = {tree}")
    print(f"{'batch':>5} {'field':>13} {'tree':>4} {'rounds':>30} {'median':>8} {'/ A':>7}")
    for batch in sorted(runs[0][0]):
        for f in FIELDS:
            base = statistics.median(r[batch][f] for r in runs[0])
            for k in range(len(trees)):
                times = [r[batch][f] for r in runs[k]]
                med = statistics.median(times)
                print(f"{batch:>5} {f:>13} {chr(65 + k):>4} {' '.join(f'{x:.3f}' for x in times):>30} "
                      f"{med:>8.3f} {med / base:>7.3f}")


if __name__ == "__main__":
    main(sys.argv[1:])
