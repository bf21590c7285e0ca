"""Calibration, not part of cudflash: how often does the Hugging Face reference itself, run in bf16 on the GPU,
reproduce the float32 goldens of the tiny pair? (Needs torch + transformers: the GPU machine has them.)

Prints exact-match counts for greedy AR decoding in bf16 and float32, and the relative logit error of bf16
against float32 on the prompts, to compare with cudflash's own numbers from tests/gpu/test_engine.py.
"""
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

pair = Path(sys.argv[1] if len(sys.argv) > 1 else ".cache/tiny-code-pair")
goldens = [json.loads(line) for line in (pair / "golden_dev.jsonl").read_text().splitlines()]
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False

for dtype in (torch.float32, torch.bfloat16):
    model = AutoModelForCausalLM.from_pretrained(pair / "target", dtype=dtype).cuda().eval()
    exact, errs = 0, []
    for g in goldens:
        ids = torch.tensor([g["prompt_ids"]], device="cuda")
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=128, do_sample=False, min_new_tokens=128, eos_token_id=None,
                                 pad_token_id=0)
        exact += out[0, ids.shape[1]:].tolist() == g["ar_ids"]
    print(f"HF {dtype}: {exact}/32 prompts reproduce ar_ids exactly")
