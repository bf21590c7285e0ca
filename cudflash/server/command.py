"""The `cudflash serve` subcommand: its options, checked before the model loads, and the uvicorn run."""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from cudflash.errors import CudflashError, RequestError


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    s.add_argument("--target", required=True, help="target model directory (Hugging Face format)")
    s.add_argument("--draft", help="drafter directory; without it, plain autoregressive decoding")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    s.add_argument("--api-key", default=os.environ.get("CUDFLASH_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: $CUDFLASH_API_KEY)")
    s.add_argument("--served-model-name", help="the model id clients send (default: the target folder's name)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences in flight at once")
    s.add_argument("--max-queued", type=int, default=256,
                   help="requests that may wait beyond --max-num-seqs; more are answered 429")
    s.add_argument("--block-size", type=int, help="speculative block size (default: the drafter's)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of free device memory the KV cache may take")
    s.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (op by op on the GPU)")


def serve(args: argparse.Namespace) -> None:
    if not 1 <= args.port <= 65535:
        raise RequestError(f"--port must be in 1..65535, got {args.port}")
    if args.max_queued < 0:
        raise RequestError(f"--max-queued must be >= 0, got {args.max_queued}")
    if args.api_key is not None and not args.api_key:
        raise RequestError("--api-key must not be empty")
    try:
        import starlette  # noqa: F401
        import uvicorn
    except ImportError:
        raise CudflashError("cudflash serve needs the serve extra: pip install 'cudflash[serve]'") from None
    from cudflash import LLM
    from cudflash.server.app import build_app

    llm = LLM(args.target, draft=args.draft, backend=args.backend, block_size=args.block_size,
              max_num_seqs=args.max_num_seqs, memory_utilization=args.gpu_memory_utilization,
              enforce_eager=args.enforce_eager, progress=True)
    name = args.served_model_name or Path(args.target).resolve().name
    app = build_app(llm, model_name=name, api_key=args.api_key, max_queued=args.max_queued)
    if llm.chat_template is None:
        print(f"cudflash: warning: {args.target} has no chat template; /v1/chat/completions will answer 400",
              file=sys.stderr)
    print(f"cudflash: serving '{name}' on http://{args.host}:{args.port}/v1 (backend {llm.backend.name})",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
