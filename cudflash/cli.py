"""The `cudflash` command: `generate`, `serve` and `bench`. Every option and every line of a prompts file is checked
before the model loads; user errors print one line, `cudflash: error: ...`, and exit 2, never a traceback.
"""
from __future__ import annotations

import argparse
import codecs
import json
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, TextIO

from cudflash import __version__, validate
from cudflash.errors import CudflashError, RequestError
from cudflash.quant.options import QUANTIZE_CHOICES
from cudflash.sampling_params import SamplingParams

MAX_DIGITS = 40  # longer integers are out of range for every option and field (and stay cheap to reject)
_INTEGER = re.compile(r"[+-]?[0-9]+")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # argparse's own usage errors, in our one-line form
        _fail(message)


def _fail(message: str):
    print(f"cudflash: error: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(2)


# ---- option types: each returns the checked value or raises ArgumentTypeError (argparse names the option)
def _parse_int(text: str) -> int:
    if not _INTEGER.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"expected an integer, got {validate.describe(text)}")
    digits = len(text.strip().lstrip("+-"))
    if digits > MAX_DIGITS:
        raise argparse.ArgumentTypeError(f"an integer of {digits} digits is out of range")
    return int(text)


def _parse_float(text: str) -> float:
    try:
        if len(text) > 100 or not text.isascii():  # float() also reads other scripts' digits
            raise ValueError
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {validate.describe(text)}") from None


def _checked(parse: Callable[[str], Any], check: Callable[[Any], Any]) -> Callable[[str], Any]:
    """parse, then check; a check names its value "value", which argparse's "argument --opt: " replaces."""
    def convert(text: str) -> Any:
        try:
            return check(parse(text))
        except CudflashError as e:
            message = str(e)
            raise argparse.ArgumentTypeError(message.removeprefix("value ")) from None
    return convert


def _int_arg(minimum: int, what: str) -> Callable[[str], int]:
    return _checked(_parse_int, lambda v: validate.integer(v, "value", minimum=minimum, what=what))


def _float_arg(low: float, high: float, what: str, low_open: bool = False, high_open: bool = False):
    def check(v: float) -> float:
        v = validate.real(v, "value", what)
        if v < low or v > high or (low_open and v == low) or (high_open and v == high):
            raise RequestError(f"value must be {what}, got {v}")
        return v
    return _checked(_parse_float, check)


def _sampling_arg(field: str, parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """A value checked exactly as SamplingParams checks its field `field`."""
    def check(value: Any) -> Any:
        SamplingParams(**{field: value})
        return value
    return _checked(parse, check)


def _text_arg(text: str) -> str:
    try:
        return validate.text(text, "value")
    except CudflashError:  # Python decodes undecodable bytes of argv to lone surrogates
        raise argparse.ArgumentTypeError(f"not valid UTF-8: {validate.describe(text)}") from None


def _token_ids_arg(text: str) -> list[int]:
    """`--stop-token-ids 7,9` or `--stop-token-ids 7 9`."""
    return [_int_arg(0, "a token id (an integer >= 0)")(part) for part in text.split(",")]


def _batch_arg(text: str) -> str:
    sizes = [_int_arg(1, "a positive integer")(part) for part in text.split(",")]
    return ",".join(map(str, sizes))


# ---- the parser
def add_engine_arguments(p: argparse.ArgumentParser) -> None:
    """What every command that builds an LLM takes (generate; serve goes the same way): see `engine_kwargs`."""
    p.add_argument("--target", required=True, type=_text_arg,
                   help="target model: a directory (Hugging Face format) or a Hugging Face model id (Org/Name)")
    p.add_argument("--draft", type=_text_arg, help="drafter (DFlash, DFlash2 or DSpark): a directory or a model id; "
                                                   "without it, plain autoregressive decoding")
    p.add_argument("--block-size", type=_int_arg(1, "an integer >= 1"),
                   help="speculative block size (default: the drafter's; 1 = no drafting)")
    p.add_argument("--draft-window", type=_int_arg(0, "an integer >= 0"), metavar="N",
                   help="override the sliding window of the drafter's sliding layers (default: its config's; 0 = off)")
    p.add_argument("--draft-context-window", type=_int_arg(1, "an integer >= 1"), metavar="N",
                   help="bound every drafter layer's attention to the last N positions (long prompts)")
    p.add_argument("--confidence-threshold", type=_float_arg(0.0, 1.0, "a number in [0, 1)", high_open=True),
                   default=0.0, metavar="C",
                   help="DSpark: cut each draft at its first row with confidence below C (default 0: off)")
    p.add_argument("--adaptive-verify", action="store_true",
                   help="DSpark: pick verify lengths from the confidence head against the verify cost")
    p.add_argument("--verify-cost", type=_float_arg(0.0, float("inf"), "a finite number >= 0"), default=0.05,
                   metavar="X", help="with --adaptive-verify: cost of one verified token relative to a step's fixed "
                                     "cost")
    p.add_argument("--tree-budget", type=_int_arg(1, "an integer >= 1"), metavar="N",
                   help="verify a tree of up to N drafts per step instead of one path (DDTree; DFlash / DFlash2 "
                        "drafters; 15, a tree of 16 rows, costs the single path's verify and suits batch 1 and batched serving)")
    _add_quantize_arguments(p)
    p.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    p.add_argument("--max-num-seqs", type=_int_arg(1, "an integer >= 1"), default=64,
                   help="sequences in flight at once")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (op by op on the GPU)")
    p.add_argument("--num-state-snapshots", type=_int_arg(0, "an integer >= 0"), metavar="N",
                   help="hybrid (Gated DeltaNet) targets: recurrent-state snapshots kept for prefix caching "
                        "(default 2 x --max-num-seqs; each costs one sequence's state, 50 MiB at Qwen3.5-9B)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="shard the target over N ranks (1, 2, 4 or 8; the CPU backend simulates them in one process; "
                        "see docs/tensor_parallel.md)")
    p.add_argument("--gpu-memory-utilization", type=_float_arg(0.0, 1.0, "a number in (0, 1]", low_open=True),
                   default=0.9, help="fraction of free device memory the KV cache may take")


def _add_quantize_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quantize", choices=list(QUANTIZE_CHOICES),
                   help="quantize the target's linear weights at load (fp8: 128x128 block-scaled E4M3, the Qwen -FP8 "
                        "layout; nvfp4: E2M1 with an E4M3 scale per 16, the ModelOpt layout; embeddings, norms and "
                        "the LM head stay as stored). Quantized checkpoints load as they are without it")
    p.add_argument("--quantize-draft", action="store_true",
                   help="with --quantize: quantize the drafter too (default: the drafter stays bf16)")
    p.add_argument("--quantize-lm-head", action="store_true",
                   help="the target's LM head (a tied one: an FP8 copy of the embedding) in 128x128 block-scaled FP8 "
                        "at load, on any target; the drafter borrows it (default: as stored, bf16 in the releases)")


def engine_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    """LLM(...) keyword arguments from the options of `add_engine_arguments` (target and draft aside)."""
    options = None
    if (args.draft_window is not None or args.draft_context_window is not None or args.confidence_threshold
            or args.adaptive_verify or args.tree_budget is not None):
        options = {"sliding_window": args.draft_window, "context_window": args.draft_context_window,
                   "confidence_threshold": args.confidence_threshold, "adaptive": args.adaptive_verify,
                   "verify_cost": args.verify_cost, "tree_budget": args.tree_budget}
    return dict(backend=args.backend, block_size=args.block_size, draft_options=options,
                max_num_seqs=args.max_num_seqs, memory_utilization=args.gpu_memory_utilization,
                enforce_eager=args.enforce_eager, quantize=args.quantize, quantize_draft=args.quantize_draft,
                quantize_lm_head=args.quantize_lm_head, tensor_parallel_size=args.tensor_parallel_size,
                num_state_snapshots=args.num_state_snapshots)


def add_generate_arguments(g: argparse.ArgumentParser) -> None:
    add_engine_arguments(g)
    g.add_argument("--prompt", action="extend", nargs="+", default=[], type=_text_arg, metavar="TEXT",
                   help="prompt text")
    g.add_argument("--prompts", type=Path, metavar="FILE",
                   help='JSON lines, each {"prompt": "text"} or {"prompt_ids": [ints]}, optionally with its own '
                        + ", ".join(f'"{k}"' for k in LINE_FIELDS))
    g.add_argument("--output", type=Path, metavar="FILE", help="write JSON lines here instead of stdout")
    g.add_argument("--chat", action="store_true",
                   help='send every text prompt as one user message through the model\'s chat template (prompts-file '
                        'lines may also give "messages": a whole conversation)')
    g.add_argument("--stream", action="store_true",
                   help="write the generated text to stdout as it is generated (JSON lines only to --output)")
    g.add_argument("--max-new-tokens", type=_sampling_arg("max_tokens", _parse_int), default=128)
    g.add_argument("--temperature", type=_sampling_arg("temperature", _parse_float), default=0.0)
    g.add_argument("--top-k", type=_sampling_arg("top_k", _parse_int), default=0)
    g.add_argument("--top-p", type=_sampling_arg("top_p", _parse_float), default=1.0)
    g.add_argument("--seed", type=_sampling_arg("seed", _parse_int))
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--stop", action="append", default=[], type=_sampling_arg("stop", _text_arg), metavar="TEXT",
                   help="stop string (repeatable); not part of the output text")
    g.add_argument("--stop-token-ids", action="extend", nargs="+", default=[], type=_token_ids_arg, metavar="ID",
                   help="token ids that end a request (space or comma separated); part of the output")
    g.add_argument("--progress-interval", type=_float_arg(0.0, float("inf"), "a finite number >= 0"), default=5.0,
                   metavar="SECONDS", help="a progress line on stderr at most this often (default 5; 0: every step)")


# bench.SYNTHETIC's names, listed here so that parsing the command line imports no engine (a test keeps them equal).
SYNTHETIC_MODELS = ["qwen3-8b", "qwen3-4b", "qwen3.5-9b", "qwen3.5-27b", "tiny", "tiny-hybrid"]


def add_bench_arguments(bench: argparse.ArgumentParser) -> None:
    source = bench.add_mutually_exclusive_group(required=True)
    source.add_argument("--synthetic", choices=SYNTHETIC_MODELS,
                        help="random weights with the exact shapes of this model and its DFlash drafter (qwen3.5-*: "
                             "Gated DeltaNet hybrids; tiny-hybrid: a small one for tests)")
    source.add_argument("--target", type=_text_arg, help="target model (without --draft: times plain decoding)")
    bench.add_argument("--draft", type=_text_arg, help="drafter directory or model id")
    bench.add_argument("--drafter", choices=["dflash", "dflash2", "dspark"], default="dflash",
                       help="with --synthetic: the drafter family (its DFlash-b16 backbone with this family's heads)")
    bench.add_argument("--prompt-len", type=_int_arg(1, "an integer >= 1"), default=512)
    bench.add_argument("--new", dest="steps", type=_int_arg(1, "an integer >= 1"), default=20,
                       help="timed steps per measurement")
    bench.add_argument("--warmup", type=_int_arg(0, "an integer >= 0"), default=3)
    bench.add_argument("--batch", type=_batch_arg, default="1", help="comma-separated batch sizes, e.g. 1,8,32")
    bench.add_argument("--block-size", type=_int_arg(1, "an integer >= 1"))
    bench.add_argument("--backend", choices=["auto", "cpu", "cuda"], default="auto")
    bench.add_argument("--gpu-memory-utilization", type=_float_arg(0.0, 1.0, "a number in (0, 1]", low_open=True),
                       default=0.9)
    bench.add_argument("--draft-context-window", type=_int_arg(1, "an integer >= 1"), metavar="N",
                       help="bound every drafter layer's attention to the last N positions")
    bench.add_argument("--tree-budget", type=_int_arg(1, "an integer >= 1"), metavar="N",
                       help="speculative steps verify a draft tree of N nodes (engine/tree.py) instead of the block")
    bench.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (op by op on the GPU)")
    _add_quantize_arguments(bench)
    bench.add_argument("--weights", choices=["bf16", "fp8", "nvfp4"], default="bf16",
                       help="with --synthetic: the format of the target's linear weights (fp8: E4M3 codes with "
                            "128x128 block scales; nvfp4: E2M1 codes with an E4M3 scale per 16 and a global scale; "
                            "made on the device; the embeddings stay bf16, the LM head too unless "
                            "--quantize-lm-head)")
    bench.add_argument("--prefill-only", action="store_true",
                       help="time the prefill of each batch of prompts (tokens/s) and no decode steps")
    bench.add_argument("--json", type=Path, metavar="FILE", help="write the numbers as JSON too")
    bench.add_argument("--tune", action="append", default=[], metavar="NAME=VALUE",
                       help="set a field of the CUDA backend's tuning (cudflash/backends/tuning.py), e.g. "
                            "stream_gemm_prefill_stages=1, pdl=0, kernel_dir=DIR; repeatable, for A/B runs of one tree")


def run_bench_command(args: argparse.Namespace) -> None:
    if args.target is not None and args.drafter != "dflash":
        raise RequestError("bench --drafter picks the family of a --synthetic drafter; --draft brings its own")
    if args.synthetic is not None and args.draft is not None:
        raise RequestError("bench --synthetic makes its own drafter; --draft goes with --target")
    if args.weights != "bf16" and args.synthetic is None:
        raise RequestError("bench --weights picks the format of --synthetic weights; a checkpoint brings its own "
                           "(or --quantize fp8)")
    if args.quantize_lm_head and args.synthetic is not None and args.weights == "bf16":
        raise RequestError("bench --quantize-lm-head with --synthetic goes with --weights fp8 or nvfp4 (the "
                           "quantized weights are made on the device)")
    if args.quantize_draft and args.synthetic is not None and args.weights == "bf16":
        raise RequestError("bench --quantize-draft with --synthetic goes with --weights fp8 or nvfp4 (the drafter's "
                           "quantized weights are made on the device)")
    if args.weights != "bf16" and args.backend == "cpu":
        raise RequestError(f"bench --weights {args.weights} needs the cuda backend (the weights are made on the device)")
    if args.json is not None and not args.json.parent.is_dir():
        raise RequestError(f"--json {args.json}: no such directory {args.json.parent}")
    from cudflash.backends.tuning import parse_tuning
    from cudflash.bench import run_bench

    print(run_bench(args, parse_tuning(args.tune)))  # a bad --tune fails before anything loads


# Subcommands: name -> (help, add its arguments, run it). `serve` (the OpenAI-compatible server) registers here too.
COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], None]]] = {}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="cudflash", description="Speculative decoding with DFlash drafters.")
    parser.add_argument("--version", action="version", version=f"cudflash {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    for name, (help_text, add_arguments, _) in COMMANDS.items():
        add_arguments(sub.add_parser(name, help=help_text))
    return parser


# ---- generate: requests
# Per-line fields of a prompts file besides the prompt, and the SamplingParams field each one sets.
LINE_FIELDS = {"max_new_tokens": "max_tokens", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k",
               "seed": "seed", "stop": "stop", "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos"}
PROMPT_FIELDS = ("prompt", "prompt_ids", "messages")  # messages: a conversation, through the chat template


@dataclass(slots=True)
class Request:
    where: str  # "FILE:LINE" or "--prompt [N]": what error messages name
    prompt: str | list[int] | list[dict]  # text, token ids, or a conversation (messages)
    params: SamplingParams
    prompt_ids: list[int] | None = None  # once checked against the model

    @property
    def prompt_name(self) -> str:
        if self.where.startswith("--"):
            return self.where
        if self.conversation:
            return f"{self.where}: messages"
        return f"{self.where}: {'prompt' if isinstance(self.prompt, str) else 'prompt_ids'}"

    @property
    def conversation(self) -> bool:
        return isinstance(self.prompt, list) and bool(self.prompt) and isinstance(self.prompt[0], dict)


def _json_int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_DIGITS:
        raise ValueError(f"integer of {len(text.lstrip('-'))} digits is out of range")
    return int(text)


def _json_constant(name: str):
    raise ValueError(f"{name} is not valid JSON")


def _json_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f'field "{key}" appears twice')
        obj[key] = value
    return obj


def parse_line(line: str, where: str) -> dict[str, Any]:
    try:
        obj = json.loads(line, parse_int=_json_int, parse_constant=_json_constant, object_pairs_hook=_json_object)
    except RecursionError:
        raise RequestError(f"{where}: JSON nested too deeply") from None
    except json.JSONDecodeError as e:
        raise RequestError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except ValueError as e:
        raise RequestError(f"{where}: {e}") from None
    if not isinstance(obj, dict):
        raise RequestError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    unknown = next((k for k in obj if k not in LINE_FIELDS and k not in PROMPT_FIELDS), None)
    if unknown is not None:
        raise RequestError(f"{where}: unknown field {validate.describe(unknown)} (known: "
                           f"{', '.join(PROMPT_FIELDS + tuple(LINE_FIELDS))})")
    if sum(k in obj for k in PROMPT_FIELDS) != 1:
        raise RequestError(f'{where}: expected exactly one of "prompt", "prompt_ids" or "messages"')
    if "messages" in obj and not (isinstance(obj["messages"], list) and obj["messages"]
                                  and all(isinstance(m, dict) for m in obj["messages"])):
        raise RequestError(f'{where}: "messages" must be a non-empty list of message objects, got '
                           f'{validate.describe(obj["messages"])}')
    if "prompt" in obj and not isinstance(obj["prompt"], str):
        raise RequestError(f'{where}: "prompt" must be a string, got {validate.describe(obj["prompt"])}')
    if "prompt_ids" in obj and not isinstance(obj["prompt_ids"], list):
        raise RequestError(f'{where}: "prompt_ids" must be a list of token ids, got '
                           f'{validate.describe(obj["prompt_ids"])}')
    return obj


def read_prompts_file(path: Path) -> list[tuple[str, dict[str, Any]]]:
    """(FILE:LINE, object) of every non-blank line. UTF-8 only (a BOM is allowed)."""
    try:
        data = path.read_bytes()
    except OSError as e:
        raise RequestError(f"{path}: cannot read ({e.strerror})") from None
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        raise RequestError(f"{path}: UTF-16 text; a prompts file must be UTF-8")
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise RequestError(f"{path}:{line}: not valid UTF-8 (byte 0x{data[e.start]:02x})") from None
    # split("\n"), not splitlines(): a JSON string may hold U+2028 and other characters splitlines breaks at.
    return [(f"{path}:{n}", parse_line(line, f"{path}:{n}"))
            for n, line in enumerate(text.split("\n"), 1) if line.strip()]


def read_requests(args: argparse.Namespace) -> list[Request]:
    """Every request with its SamplingParams (the command line's, with a line's own fields on top), checked."""
    defaults = dict(max_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                    seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop,
                    stop_token_ids=[t for ids in args.stop_token_ids for t in ids])
    base = SamplingParams(**defaults)
    many = len(args.prompt) > 1
    requests = [Request(f"--prompt {i + 1}" if many else "--prompt", [{"role": "user", "content": p}] if args.chat else p,
                        base) for i, p in enumerate(args.prompt)]
    if args.prompts is not None:
        for where, obj in read_prompts_file(args.prompts):
            own = {}
            for key, field in LINE_FIELDS.items():
                if key in obj:
                    try:
                        SamplingParams(**{field: obj[key]})
                    except RequestError as e:
                        raise RequestError(f'{where}: field "{key}": {e}') from None
                    own[field] = obj[key]
            prompt = next(obj[k] for k in PROMPT_FIELDS if k in obj)
            if args.chat and isinstance(prompt, str):
                prompt = [{"role": "user", "content": prompt}]
            requests.append(Request(where, prompt, SamplingParams(**{**defaults, **own}) if own else base))
    if not requests:
        raise RequestError("no prompts: give --prompt TEXT or --prompts FILE")
    return requests


def check_requests(requests: list[Request], admission, target: str | Path) -> None:
    """Conversations rendered by the model's chat template; then prompt ids inside the vocabulary, text the
    tokenizer takes, lengths the model's positions hold."""
    template = None
    if any(r.conversation for r in requests):
        from cudflash.chat import load_chat_template

        template = load_chat_template(target)
    for r in requests:
        prompt = r.prompt
        if r.conversation:
            from cudflash.chat import chat_prompt_ids

            try:
                prompt = chat_prompt_ids(target, template, admission.tokenizer, r.prompt, where="messages")
            except CudflashError as e:
                raise type(e)(f"{r.where}: {e}") from None
        r.prompt_ids, r.params = admission.admit(prompt, r.params, r.prompt_name, r.where)


# ---- generate: output
class OrderedOutput:
    """Results in input order, each written and flushed as soon as it and every earlier one have finished. With
    --stream, the generated text goes to stdout live for the earliest unfinished request; a later request's text
    waits (buffered) until its turn, then each request's text ends with a newline."""

    def __init__(self, n: int, lines: TextIO | None, text: TextIO | None, speculative: bool):
        self.lines, self.text, self.speculative = lines, text, speculative
        self.pending: dict[int, str] = {}  # finished, waiting for an earlier one: index -> JSON line
        self.buffered = [""] * n  # --stream: text of requests behind the earliest unfinished one
        self.next = 0  # the earliest request not yet written

    def delta(self, i: int, text: str) -> None:
        if self.text is None or not text:
            return
        if i == self.next:
            self.text.write(text)
            self.text.flush()
        else:
            self.buffered[i] += text

    def finish(self, i: int, r) -> None:
        row: dict[str, Any] = {"token_ids": r.token_ids, "text": r.text, "finish_reason": r.finish_reason}
        if self.speculative:  # plain decoding has no acceptance lengths and no tau
            row.update(acceptance_lengths=r.acceptance_lengths, tau=round(r.tau, 4))
        self.pending[i] = json.dumps(row)
        while self.next in self.pending:
            line = self.pending.pop(self.next)
            if self.lines is not None:
                self.lines.write(line + "\n")
                self.lines.flush()
            self.next += 1
            if self.text is not None:
                self.text.write("\n" + (self.buffered[self.next] if self.next < len(self.buffered) else ""))
                self.text.flush()
            if self.next < len(self.buffered):
                self.buffered[self.next] = ""


class Progress:
    """A rate-limited progress line on stderr: overwritten in place on a terminal, plain lines otherwise."""

    def __init__(self, total: int, interval: float, speculative: bool, out: TextIO):
        self.total, self.interval, self.speculative, self.out = total, interval, speculative, out
        self.tty = out.isatty()
        self.start = self.last = time.perf_counter()
        self.done = self.tokens = 0
        self.taus: list[float] = []
        self.printed = False

    def line(self, seconds: float) -> str:
        text = (f"{self.done}/{self.total} requests done, {self.tokens} new tokens, "
                f"{self.tokens / max(seconds, 1e-9):.1f} tokens/s")
        if self.speculative:
            text += f", mean tau {sum(self.taus) / len(self.taus):.3f}" if self.taus else ", mean tau -"
        return text

    def update(self) -> None:
        now = time.perf_counter()
        if now - self.last < self.interval or self.done == self.total:
            return
        self.last = now
        if self.tty:
            print(f"\rprogress: {self.line(now - self.start)}\033[K", end="", file=self.out, flush=True)
        else:
            print(f"progress: {self.line(now - self.start)}", file=self.out, flush=True)
        self.printed = True

    def close(self) -> None:
        if self.tty and self.printed:
            print(file=self.out, flush=True)


def _open_output(args: argparse.Namespace) -> TextIO | None:
    if args.output is None:
        return None
    if args.prompts is not None and args.output.resolve() == args.prompts.resolve():
        raise RequestError(f"--output {args.output} is the prompts file; writing would overwrite it")
    try:
        return open(args.output, "w", encoding="utf-8")
    except OSError as e:
        raise RequestError(f"--output {args.output}: cannot write ({e.strerror})") from None


def run_generate(args: argparse.Namespace) -> None:
    from cudflash import LLM
    from cudflash.config import load_target_config
    from cudflash.engine.admission import Admission
    from cudflash.hub import resolve_model
    from cudflash.tokenizer import load_tokenizer

    # Before the weights load: the options (argparse types), the model's config and tokenizer, every request, and
    # the output file. Only whether a request fits the KV pool waits for the pool.
    requests = read_requests(args)
    target = resolve_model(args.target, "target")
    draft = resolve_model(args.draft, "draft") if args.draft is not None else None
    tokenizer = load_tokenizer(target)
    if args.stream and tokenizer is None:
        raise RequestError(f"--stream needs a tokenizer: {target} has no tokenizer.json (or `pip install tokenizers`)")
    check_requests(requests, Admission(load_target_config(target), tokenizer), target)
    output = _open_output(args)
    try:
        llm = LLM(target, draft=draft, progress=True, **engine_kwargs(args))
        index = {}
        for i, r in enumerate(requests):
            llm.admission.check_fits(r.prompt_ids, r.params, r.where)
            index[llm.add_request(r.prompt_ids, r.params)] = i
        lines = output if output is not None else (None if args.stream else sys.stdout)
        out = OrderedOutput(len(requests), lines, sys.stdout if args.stream else None, llm.speculative)
        progress = Progress(len(requests), args.progress_interval, llm.speculative, sys.stderr)
        while llm.has_unfinished():
            for step_out in llm.step():
                i = index[step_out.request_id]
                progress.tokens += len(step_out.new_token_ids)
                out.delta(i, step_out.new_text)
                if step_out.finished:
                    result = llm.result(step_out.request_id)
                    progress.done += 1
                    if result.acceptance_lengths:
                        progress.taus.append(result.tau)
                    out.finish(i, result)
            progress.update()
        progress.close()
    finally:
        if output is not None:
            output.close()
    seconds = time.perf_counter() - progress.start
    summary = f"requests {len(requests)}  new tokens {progress.tokens}  seconds {seconds:.2f}  " \
              f"tokens/s {progress.tokens / max(seconds, 1e-9):.1f}"
    if llm.speculative:
        summary += f"  mean tau {sum(progress.taus) / len(progress.taus) if progress.taus else 0.0:.3f}"
    print(f"{summary}  backend {llm.backend.name}", file=sys.stderr)


COMMANDS["generate"] = ("generate continuations for prompts (JSON lines out)", add_generate_arguments, run_generate)
COMMANDS["bench"] = ("time AR and speculative steps (CUDA events on the GPU)", add_bench_arguments, run_bench_command)
def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The engine's options, as generate takes them, and the server's own."""
    add_engine_arguments(s)
    s.add_argument("--host", default="127.0.0.1", type=_text_arg)
    s.add_argument("--port", type=_int_arg(1, "an integer in 1..65535"), default=8000)
    s.add_argument("--api-key", default=os.environ.get("CUDFLASH_API_KEY"), type=_text_arg,
                   help="require 'Authorization: Bearer KEY' on every path but /health (default: $CUDFLASH_API_KEY)")
    s.add_argument("--served-model-name", type=_text_arg,
                   help="the model id clients send (default: the target folder's name)")
    s.add_argument("--max-queued", type=_int_arg(0, "an integer >= 0"), default=256,
                   help="requests that may wait beyond --max-num-seqs; more are answered 429")


def run_serve(args: argparse.Namespace) -> None:
    from cudflash.server.command import serve  # starlette and uvicorn load only to serve

    serve(args, engine_kwargs(args))


COMMANDS["serve"] = ("an OpenAI-compatible HTTP server (needs `pip install cudflash[serve]`)", add_serve_arguments,
                     run_serve)


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    try:
        COMMANDS[args.command][2](args)
    except CudflashError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        print("cudflash: interrupted", file=sys.stderr)
        sys.exit(130)
    except BrokenPipeError:  # stdout closed early (e.g. piped into `head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)


if __name__ == "__main__":
    main()
