"""Goldens for the Qwen3.5 hybrid target, not part of cudflash: transformers' float32 greedy tokens on tiny random
checkpoints that cudflash's writer makes from fixed seeds (tests/hybrid_golden_cases.py), written to
tests/data/hybrid_goldens.json for tests/test_hybrid_goldens.py. Needs torch + transformers >= 5.2 with qwen3_5.

    python3 scripts/hybrid_goldens.py [--out tests/data/hybrid_goldens.json]

Runs on the CPU in float32 (tiny models; the torch fallbacks of the GDN kernels, the same chunked prefill and
recurrent decode cudflash computes). Each checkpoint is loaded through its own class (Qwen3_5ForConditionalGeneration
or Qwen3_5ForCausalLM) with loading info checked: no language-model tensor missing or unused, the vision tower
loaded from the file, only mtp.* left unused. Per prompt it records the greedy tokens and the smallest top-2 logit
gap along them (a near-tie there would say a float32 flip is possible).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import Qwen3_5ForCausalLM, Qwen3_5ForConditionalGeneration  # noqa: E402

from cudflash.tiny_hybrid import write_hybrid_target  # noqa: E402
from tests.hybrid_golden_cases import CASES, GOLDENS, MAX_NEW  # noqa: E402


def load(directory: Path, cls: str):
    model_cls = Qwen3_5ForConditionalGeneration if cls == "conditional" else Qwen3_5ForCausalLM
    model, info = model_cls.from_pretrained(directory, dtype=torch.float32, output_loading_info=True,
                                            attn_implementation="eager")
    missing = [k for k in info["missing_keys"] if k != "lm_head.weight"]  # lm_head: tied checkpoints omit it
    unexpected = [k for k in info["unexpected_keys"] if not k.startswith("mtp.")]
    if missing or unexpected or info.get("mismatched_keys"):
        raise SystemExit(f"{directory}: transformers loaded the checkpoint with missing {missing[:5]}, unexpected "
                         f"{unexpected[:5]}, mismatched {info.get('mismatched_keys', [])[:5]}: the writer's layout is "
                         f"not the released one")
    model.generation_config.eos_token_id = None  # run to max_new_tokens: the goldens are pure argmax
    return model.eval()


def greedy(model, prompt: list[int]) -> tuple[list[int], float]:
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                             eos_token_id=None, pad_token_id=0, output_scores=True, return_dict_in_generate=True)
    tokens = out.sequences[0, len(prompt):].tolist()
    gaps = []
    for scores in out.scores:  # greedy without processors: the raw float32 logits of each step
        top2 = torch.topk(scores[0], 2).values
        gaps.append(float((top2[0] - top2[1]) / top2[0].abs().clamp_min(1e-6)))
    return tokens, min(gaps)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "data" / GOLDENS)
    args = parser.parse_args()
    torch.manual_seed(0)  # the vision tower is read from the file; nothing random should remain, but be sure
    cases = []
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            directory = write_hybrid_target(Path(tmp) / case.name, case.shape, seed=case.seed)
            model = load(directory, case.shape.checkpoint_class)
            runs = []
            for prompt in case.prompts():
                tokens, gap = greedy(model, prompt)
                runs.append({"prompt_ids": prompt, "greedy_ids": tokens, "min_top2_gap": gap})
                print(f"{case.name}: prompt {len(prompt)} -> {tokens[:8]}... (min top-2 gap {gap:.2e})")
            cases.append({"name": case.name, "seed": case.seed, "runs": runs})
    doc = {"transformers": transformers.__version__, "torch": torch.__version__, "dtype": "float32",
           "max_new": MAX_NEW, "cases": cases}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
