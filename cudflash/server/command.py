"""The `cudflash serve` subcommand's run: the server's own options checked, the LLM built, uvicorn started. Its
options (the engine's, as `generate` takes them, and the server's) are declared in cudflash/cli.py."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from cudflash.errors import CudflashError, RequestError


def serve(args: argparse.Namespace, engine: dict[str, Any]) -> None:
    """Serve until interrupted; `engine`: the LLM's keyword arguments (cli.engine_kwargs)."""
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

    llm = LLM(args.target, draft=args.draft, progress=True, **engine)
    name = args.served_model_name or Path(args.target).resolve().name
    app = build_app(llm, model_name=name, api_key=args.api_key, max_queued=args.max_queued)
    if llm.chat_template is None:
        print(f"cudflash: warning: {args.target} has no chat template; /v1/chat/completions will answer 400",
              file=sys.stderr)
    print(f"cudflash: serving '{name}' on http://{args.host}:{args.port}/v1 (backend {llm.backend.name})",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info", timeout_graceful_shutdown=5)
