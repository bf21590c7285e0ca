"""Tau of the trained tiny pair with its target quantized, against bf16, on the CPU (float32 numpy backend).

Usage: python3 scripts/quant_tau.py [PAIR_DIR] [--new N] [--backend cpu|cuda] [--tune NAME=VALUE ...]
    [--only TEXT]
PAIR_DIR defaults to ../shared/models/tiny-code-pair. Variants: the bf16 pair; the target quantized to FP8 at load
(drafter bf16, then drafter FP8 too, then the LM head FP8 too: quantize_lm_head); the target written as a Qwen -FP8
release and as a ModelOpt NVFP4 release (tests/quant_checkpoints.py, from its bf16 weights) and loaded as such (NVFP4
at load is the same recipe: the same model), with the drafter bf16 and NVFP4. For each: tau (mean over prompts of each
prompt's mean acceptance length, as golden_dev.jsonl defines it), whether speculative greedy == autoregressive
greedy of the same target on every prompt, and how many prompts' greedy output equals the bf16 target's.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from cudflash import LLM, SamplingParams  # noqa: E402
from cudflash.checkpoint import Checkpoint  # noqa: E402
from cudflash.backends.tuning import parse_tuning  # noqa: E402
from tests.quant_checkpoints import copy_side_files, write_quantized  # noqa: E402


def released(pair: Path, fmt: str, folder: Path) -> Path:
    """The pair's target rewritten in a released quantized layout (from its bf16 weights, as the release tools do)."""
    ckpt = Checkpoint(pair / "target")
    tensors = {n: ckpt.float32(n) for n in ckpt.names}
    config = json.loads((pair / "target" / "config.json").read_text())
    out = write_quantized(folder / fmt, config, tensors, fmt)
    copy_side_files(pair / "target", out)
    return out


def run(target: Path, drafter: Path, prompts, new: int, backend: str, **kw):
    params = SamplingParams(max_tokens=new, ignore_eos=True)
    ar = LLM(target, backend=backend, **kw).generate(prompts, params)
    spec = LLM(target, draft=drafter, backend=backend, **kw).generate(prompts, params)
    tau = statistics.mean(statistics.mean(r.acceptance_lengths) for r in spec)
    return tau, [a.token_ids for a in ar], [s.token_ids for s in spec]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("pair", nargs="?", type=Path, default=ROOT / ".." / "shared" / "models" / "tiny-code-pair")
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--backend", default="cpu")
    p.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE", help="the cuda backend's tuning")
    p.add_argument("--only", default="", help="only the variants whose name contains TEXT (and bf16, the base)")
    args = p.parse_args()
    tuning = {"tuning": parse_tuning(args.tune)} if args.tune else {}
    pair = args.pair.resolve()
    prompts = json.loads((pair / "prompts_dev.json").read_text())["prompts"]
    drafter = pair / "drafter"
    with tempfile.TemporaryDirectory() as tmp:
        variants = [("bf16", pair / "target", {}),
                    ("fp8 at load (drafter bf16)", pair / "target", {"quantize": "fp8"}),
                    ("fp8 at load (drafter fp8)", pair / "target", {"quantize": "fp8", "quantize_draft": True}),
                    ("fp8 at load, FP8 LM head", pair / "target", {"quantize": "fp8", "quantize_lm_head": True}),
                    ("Qwen-FP8 layout on disk", released(pair, "qwen_fp8", Path(tmp)), {}),
                    ("ModelOpt NVFP4 on disk", released(pair, "modelopt_nvfp4", Path(tmp)), {}),
                    ("nvfp4 at load (drafter bf16)", pair / "target", {"quantize": "nvfp4"}),
                    ("nvfp4 at load (drafter nvfp4)", pair / "target", {"quantize": "nvfp4", "quantize_draft": True})]
        variants = [v for v in variants if v[0] == "bf16" or args.only.lower() in v[0].lower()]
        base_ar = None
        print(f"{len(prompts)} prompts, {args.new} new tokens, backend {args.backend}")
        print(f"{'variant':<30} {'tau':>6} {'vs bf16':>8} {'spec == AR':>11} {'AR == bf16 AR':>14}")
        base_tau = None
        for name, target, kw in variants:
            tau, ar, spec = run(target, drafter, prompts, args.new, args.backend, **kw, **tuning)
            base_ar = base_ar or ar
            base_tau = base_tau or tau
            same = sum(a == s for a, s in zip(ar, spec))
            agree = sum(a == b for a, b in zip(ar, base_ar))
            print(f"{name:<30} {tau:6.3f} {100 * (tau / base_tau - 1):+7.1f}% {same:>5}/{len(prompts):<5} "
                  f"{agree:>8}/{len(prompts)}", flush=True)


if __name__ == "__main__":
    main()
