"""`cudflash generate` (and later `cudflash bench`). User errors print `cudflash: error: ...` and exit 2."""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from cudflash.errors import CudflashError, RequestError
from cudflash.server.command import add_serve_parser, serve


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors, in our one-line form
        self.print_usage(sys.stderr)
        _fail(message)


def _fail(message: str):
    print(f"cudflash: error: {message}", file=sys.stderr)
    sys.exit(2)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cudflash", description="Speculative decoding with DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    g = sub.add_parser("generate", help="generate continuations for prompts (JSON lines out)")
    g.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    g.add_argument("--draft", help="drafter directory (DFlash, DFlash2 or DSpark); without it, plain autoregressive "
                                   "decoding")
    g.add_argument("--prompt", action="extend", nargs="+", default=[], metavar="TEXT", help="prompt text")
    g.add_argument("--prompts", type=Path, metavar="FILE",
                   help='JSON lines: {"prompt": "text"} or {"prompt_ids": [ints]}, optional "max_new_tokens"')
    g.add_argument("--output", type=Path, metavar="FILE", help="write JSON lines here instead of stdout")
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int)
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--block-size", type=int, help="speculative block size (default: the drafter's; 1 = no drafting)")
    g.add_argument("--draft-window", type=int, metavar="N",
                   help="override the sliding window of the drafter's sliding layers (default: its config's; 0 = off)")
    g.add_argument("--draft-context-window", type=int, metavar="N",
                   help="bound every drafter layer's attention to the last N positions (long prompts)")
    g.add_argument("--confidence-threshold", type=float, default=0.0, metavar="C",
                   help="DSpark: cut each draft at its first row with confidence below C (default 0: off)")
    g.add_argument("--adaptive-verify", action="store_true",
                   help="DSpark: pick verify lengths from the confidence head against the verify cost")
    g.add_argument("--verify-cost", type=float, default=0.05, metavar="X",
                   help="with --adaptive-verify: cost of one verified token relative to a step's fixed cost")
    g.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    g.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight at once")
    g.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (op by op on the GPU)")
    g.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free device memory the KV cache may take")
    bench = sub.add_parser("bench", help="time AR and speculative steps (CUDA events on the GPU)")
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", choices=["qwen3-8b", "qwen3-4b", "tiny"],
                        help="random weights with the exact shapes of this model and its DFlash-b16 drafter")
    source.add_argument("--target", help="target model directory (needs --draft)")
    bench.add_argument("--draft", help="drafter directory")
    bench.add_argument("--drafter", choices=["dflash", "dflash2", "dspark"], default="dflash",
                       help="with --synthetic: the drafter family (its DFlash-b16 backbone with this family's heads)")
    bench.add_argument("--prompt-len", type=int, default=512)
    bench.add_argument("--new", dest="steps", type=int, default=20, help="timed steps per measurement")
    bench.add_argument("--warmup", type=int, default=3)
    bench.add_argument("--batch", default="1", help="comma-separated batch sizes, e.g. 1,8,32")
    bench.add_argument("--block-size", type=int)
    bench.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    bench.add_argument("--draft-context-window", type=int, metavar="N",
                       help="bound every drafter layer's attention to the last N positions")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (op by op on the GPU)")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the numbers as JSON too")
    bench.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE",
                       help="set a field of the CUDA backend's tuning (cudflash/backends/tuning.py), e.g. "
                            "stream_gemm_prefill_stages=1, pdl=0, kernel_dir=DIR; repeatable, for A/B runs of one tree")
    add_serve_parser(sub)
    return parser


def read_requests(args: argparse.Namespace) -> list[dict[str, Any]]:
    requests: list[dict[str, Any]] = [{"prompt": p} for p in args.prompt]
    if args.prompts is not None:
        try:
            lines = args.prompts.read_text().splitlines()
        except OSError as e:
            raise RequestError(f"{args.prompts}: cannot read ({e.strerror})") from None
        for n, line in enumerate(lines, 1):
            if not line.strip():
                continue
            where = f"{args.prompts}:{n}"
            try:
                obj = json.loads(line)
            except json.JSONDecodeError:
                raise RequestError(f"{where}: not valid JSON") from None
            if not isinstance(obj, dict) or ("prompt" in obj) == ("prompt_ids" in obj):
                raise RequestError(f'{where}: expected an object with exactly one of "prompt" or "prompt_ids"')
            if "prompt" in obj and not isinstance(obj["prompt"], str):
                raise RequestError(f'{where}: "prompt" must be a string')
            if "prompt_ids" in obj and not (isinstance(obj["prompt_ids"], list)
                                            and all(isinstance(i, int) for i in obj["prompt_ids"])):
                raise RequestError(f'{where}: "prompt_ids" must be a list of integers')
            if "max_new_tokens" in obj and not isinstance(obj["max_new_tokens"], int):
                raise RequestError(f'{where}: "max_new_tokens" must be an integer')
            requests.append(obj)
    if not requests:
        raise RequestError("no prompts: give --prompt TEXT or --prompts FILE")
    return requests


def generate(args: argparse.Namespace) -> None:
    from cudflash import LLM, SamplingParams
    from cudflash.draft_config import DraftOptions

    requests = read_requests(args)
    params = [SamplingParams(max_tokens=r.get("max_new_tokens", args.max_new_tokens), temperature=args.temperature,
                             top_k=args.top_k, top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
              for r in requests]
    options = None
    if (args.draft_window is not None or args.draft_context_window is not None or args.confidence_threshold
            or args.adaptive_verify):
        options = DraftOptions(sliding_window=args.draft_window, context_window=args.draft_context_window,
                               confidence_threshold=args.confidence_threshold, adaptive=args.adaptive_verify,
                               verify_cost=args.verify_cost)
    llm = LLM(args.target, draft=args.draft, backend=args.backend, block_size=args.block_size, draft_options=options,
              max_num_seqs=args.max_num_seqs, memory_utilization=args.gpu_memory_utilization, progress=True,
              enforce_eager=args.enforce_eager)
    prompts = [r["prompt"] if "prompt" in r else r["prompt_ids"] for r in requests]
    start = time.perf_counter()
    results = llm.generate(prompts, params)
    seconds = time.perf_counter() - start
    lines = [json.dumps({"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason,
                         "acceptance_lengths": r.acceptance_lengths, "tau": round(r.tau, 4)}) for r in results]
    out = "\n".join(lines) + "\n"
    if args.output is not None:
        try:
            args.output.write_text(out)
        except OSError as e:
            raise RequestError(f"{args.output}: cannot write ({e.strerror})") from None
    else:
        sys.stdout.write(out)
    new_tokens = sum(len(r.token_ids) for r in results)
    taus = [r.tau for r in results if r.acceptance_lengths]
    mean_tau = sum(taus) / len(taus) if taus else 0.0
    print(f"requests {len(results)}  new tokens {new_tokens}  seconds {seconds:.2f}  "
          f"tokens/s {new_tokens / max(seconds, 1e-9):.1f}  mean tau {mean_tau:.3f}  backend {llm.backend.name}",
          file=sys.stderr)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "generate":
            generate(args)
        elif args.command == "bench":
            if args.target is not None and args.draft is None:
                raise RequestError("bench --target needs --draft")
            if args.target is not None and args.drafter != "dflash":
                raise RequestError("bench --drafter picks the family of a --synthetic drafter; --draft brings its own")
            from cudflash.backends.tuning import parse_tuning
            from cudflash.bench import run_bench

            print(run_bench(args, parse_tuning(args.tune)))  # a bad --tune fails before anything loads
        elif args.command == "serve":
            serve(args)
    except CudflashError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        sys.exit(130)


if __name__ == "__main__":
    main()
