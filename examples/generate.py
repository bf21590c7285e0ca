"""The smallest complete use of cudflash.

    python examples/generate.py [TARGET_DIR DRAFT_DIR] [PROMPT]

With no directories it uses the trained tiny pair in ../shared/models/tiny-code-pair when it is there, and
otherwise writes a tiny random pair into a temporary folder (its output is then noise, but every part of the
engine runs). The backend is the GPU when CuPy finds one, else numpy on the CPU.
"""
import sys
import tempfile
from pathlib import Path

from cudflash import LLM, SamplingParams
from cudflash.tiny import write_random_pair

TINY_PAIR = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "tiny-code-pair"


def pick_models(args: list[str]) -> tuple[str, str, str]:
    if len(args) >= 2:
        return args[0], args[1], args[2] if len(args) > 2 else "Hello"
    if (TINY_PAIR / "target" / "config.json").is_file():
        print(f"using the trained tiny pair in {TINY_PAIR.resolve()}", file=sys.stderr)
        return str(TINY_PAIR / "target"), str(TINY_PAIR / "drafter"), "def fibonacci(n):"
    folder = tempfile.mkdtemp(prefix="cudflash-tiny-")
    target, draft = write_random_pair(folder)
    print(f"no checkpoint given: wrote a tiny random pair to {folder} (output will be noise)", file=sys.stderr)
    return str(target), str(draft), [5, 6, 7, 8]  # token ids: the random pair has no tokenizer


def main() -> None:
    target, draft, prompt = pick_models(sys.argv[1:])
    llm = LLM(target, draft=draft)
    out = llm.generate([prompt], SamplingParams(max_tokens=64))[0]
    print(f"backend: {llm.backend.name}   block size: {llm.block_size}")
    print(f"prompt:  {prompt!r}")
    print(f"output:  {out.text if out.text is not None else out.token_ids}")
    print(f"tokens:  {len(out.token_ids)} ({out.finish_reason}), mean acceptance length tau = {out.tau:.2f}")


if __name__ == "__main__":
    main()
