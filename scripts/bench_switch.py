"""`cudflash bench` with module switches set: A/B runs of one tree, with no second checkout to keep in step.

Each NAME=VALUE sets a module-level constant of a cudflash.backends module before anything is compiled or planned
(stream_gemm by default; `cuda_attention.NAME` for another; a full name such as
`cudflash.engine.cuda_graph.NAME` for a module elsewhere). The value takes the type of the constant it replaces,
and a name the module does not have is an error, so a typo cannot silently measure the default.
Examples:
  python3 scripts/bench_switch.py PROGRAMMATIC=0                 # stream_gemm launched without PDL
  python3 scripts/bench_switch.py SMEM_BUDGET=149504             # a deeper weight ring
  python3 scripts/bench_switch.py cuda_attention.MAX_SPLITS=8 -- --prompt-len 2048
`--kernels DIR` (first) compiles the CUDA sources from DIR instead of kernels/, to A/B kernel code within one
checkout, e.g. against a parent commit's: `git archive PARENT kernels | tar -x -C /tmp/base`, then
`--kernels /tmp/base/kernels` against no option.
Usage: python3 scripts/bench_switch.py [--kernels DIR] [module.]NAME=VALUE ... [-- bench arguments]
The bench arguments go after `--synthetic qwen3-8b --backend cuda --batch 1 --prompt-len 512 --new 20`, whose
options they override.
"""
from __future__ import annotations

import importlib
import sys

DEFAULT_BENCH = ["--synthetic", "qwen3-8b", "--backend", "cuda", "--batch", "1", "--prompt-len", "512", "--new", "20"]


def apply(assignments: list[str], package: str = "cudflash.backends", default_module: str = "stream_gemm") -> None:
    """Set each `[module.]NAME=VALUE`; raises SystemExit naming the first that does not fit."""
    for text in assignments:
        key, sep, raw = text.partition("=")
        module_name, _, name = key.rpartition(".")
        if not sep or not name:
            raise SystemExit(f"{text!r}: expected [module.]NAME=VALUE")
        full = module_name if module_name.startswith("cudflash.") else f"{package}.{module_name or default_module}"
        module = importlib.import_module(full)
        if not hasattr(module, name):
            raise SystemExit(f"{module.__name__} has no {name}")
        old = getattr(module, name)
        if isinstance(old, bool):
            value = raw.lower() in ("1", "true", "yes")
        elif isinstance(old, (int, float)):
            value = type(old)(raw)
        else:
            raise SystemExit(f"{module.__name__}.{name} is a {type(old).__name__}, not a number or a flag")
        setattr(module, name, value)
        print(f"{module.__name__}.{name} = {value!r} (was {old!r})", file=sys.stderr)


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--kernels"]:
        from pathlib import Path

        from cudflash.backends import kernel_source

        folder = Path(args[1]).resolve()
        kernel_source.kernel_root = lambda kernel_dir=None: folder
        args = args[2:]
    cut = args.index("--") if "--" in args else len(args)
    apply(args[:cut])
    from cudflash.cli import main

    main(["bench", *DEFAULT_BENCH, *args[cut + 1:]])
