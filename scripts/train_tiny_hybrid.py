"""Train the tiny hybrid pair, not part of cudflash: a small Qwen3.5 text target (Gated DeltaNet + gated attention
layers, `Qwen3_5ForCausalLM`) on Python source, and a DFlash drafter for it, with torch + transformers >= 5.2.

    python3 scripts/train_tiny_hybrid.py --tokenizer DIR --out tests/data/tiny-hybrid-pair \
        [--target-seconds 240] [--draft-seconds 150] [--device cuda]

The corpus is the Python standard library of the interpreter that runs this (every *.py under sysconfig's stdlib,
site-packages excluded), split by file: a file whose path hashes into the last 1/16 is held out, and the dev
prompts are cut from held-out files only. The tokenizer is the byte-level BPE of ../shared/models/tiny-code-pair
(vocab 8192, id 0 <|endoftext|>, id 1 <|mask|>), copied beside the target.

- Target: trained on random 256-token windows, next-token loss, bf16 autocast; saved as bf16 safetensors in the
  released `Qwen3_5ForCausalLM` layout (model.layers.*.linear_attn / self_attn, tied embeddings), sharded.
- Drafter: z-lab's DFlash (`DFlashDraftModel`: fc, hidden_norm, Qwen3 layers whose K/V take the fused target context,
  norm; the target's embedding and LM head borrowed), trained on the target's own greedy continuations of train
  prompts: per sequence, blocks anchored at random positions in the generated part, block = [token at anchor,
  mask x 15], slot j predicts the token at anchor + j from the target's hidden states strictly before the anchor
  (taps: the residual stream after `target_layer_ids`) and the block bidirectionally; the loss of slot j is weighted
  exp(-(j - 1) / 7).
- Goldens: the target in float32, greedy, 128 new tokens on each dev prompt (`golden_dev.jsonl`, `ar_ids`).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import shutil
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

MASK_ID, EOS_ID = 1, 0
BLOCK = 16
TARGET_LAYER_IDS = [1, 3]
PROMPT_LEN, NEW_TOKENS, NUM_PROMPTS = 128, 128, 32

TARGET = dict(  # 6 layers: linear, linear, full, linear, linear, full (interval 3)
    vocab_size=8192, hidden_size=192, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=48,
    linear_value_head_dim=48, linear_conv_kernel_dim=4, full_attention_interval=3, max_position_embeddings=4096,
    rms_norm_eps=1e-6, tie_word_embeddings=True, attn_output_gate=True, eos_token_id=EOS_ID, bos_token_id=EOS_ID,
    rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [2, 3, 3], "mrope_interleaved": True},
)
DRAFT = dict(hidden_size=192, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             intermediate_size=384, rms_norm_eps=1e-6, rope_theta=1000000.0)


# ------------------------------------------------------------------------------------------------ corpus

def corpus(tok: Tokenizer) -> tuple[np.ndarray, list[np.ndarray]]:
    """(train tokens as one stream with eos between files, the held-out files' tokens)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts)
    train, dev = [], []
    for p in files:
        text = p.read_text(errors="ignore")
        if len(text) < 200:
            continue
        held_out = hashlib.sha256(str(p.relative_to(root)).encode()).digest()[0] % 16 == 15
        ids = np.asarray(tok.encode(text).ids, dtype=np.int32)
        (dev if held_out else train).append(ids)
    stream = np.concatenate([np.append(ids, EOS_ID) for ids in train])
    print(f"corpus {root}: {len(train)} train files ({stream.size / 1e6:.1f}M tokens), {len(dev)} held out",
          flush=True)
    return stream, dev


def dev_prompts(dev: list[np.ndarray]) -> list[list[int]]:
    """NUM_PROMPTS prompts of PROMPT_LEN tokens from the held-out files: the files taken in a random order, one
    window each, and round after round more non-overlapping windows of the files long enough when the held-out
    files are fewer than NUM_PROMPTS (a small stdlib, as on a minimal Linux install)."""
    rng = np.random.default_rng(0)
    span = PROMPT_LEN + NEW_TOKENS
    order = [dev[i] for i in rng.permutation(len(dev)) if dev[i].size >= span]
    if not order:
        raise SystemExit(f"no held-out file has {span} tokens: the corpus is too small")
    out: list[list[int]] = []
    for turn in range(NUM_PROMPTS):
        for ids in order:
            if len(out) == NUM_PROMPTS:
                return out
            if (turn + 1) * span <= ids.size:  # window `turn` lies in the file's segment `turn` of span tokens
                start = turn * span + int(rng.integers(0, span - PROMPT_LEN + 1))
                out.append([int(t) for t in ids[start:start + PROMPT_LEN]])
    raise SystemExit(f"the held-out files give only {len(out)} prompts of {PROMPT_LEN} tokens")


def windows(stream: np.ndarray, n: int, length: int, rng: np.random.Generator, device: str) -> torch.Tensor:
    starts = rng.integers(0, stream.size - length, n)
    return torch.from_numpy(np.stack([stream[s:s + length] for s in starts]).astype(np.int64)).to(device)


def lr_at(step: float, peak: float) -> float:
    """Linear warm-up over the first 3%, cosine to 10% of the peak; `step` is the fraction of the time budget."""
    if step < 0.03:
        return peak * step / 0.03
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (step - 0.03) / 0.97))))


# ------------------------------------------------------------------------------------------------ target

def train_target(stream: np.ndarray, seconds: float, device: str) -> Qwen3_5ForCausalLM:
    torch.manual_seed(0)
    model = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TARGET)).to(device)
    print(f"target: {sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
    rng = np.random.default_rng(1)
    t0, step = time.time(), 0
    while (elapsed := time.time() - t0) < seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / seconds, 2e-3)
        x = windows(stream, 64, 256, rng, device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % 100 == 0:
            print(f"target step {step} {elapsed:.0f}s loss {loss.item():.3f}", flush=True)
        step += 1
    return model.eval()


@torch.no_grad()
def held_out_loss(model: Qwen3_5ForCausalLM, dev: list[np.ndarray], device: str) -> float:
    losses = []
    for ids in dev[:64]:
        x = torch.from_numpy(ids[:512].astype(np.int64))[None].to(device)
        if x.shape[1] > 1:
            losses.append(model(input_ids=x, labels=x).loss.item())
    return float(np.mean(losses))


# ------------------------------------------------------------------------------------------------ drafter

class RMSNorm(nn.Module):
    def __init__(self, n: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(n)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE over the full head dim: x [B, heads, T, D], pos [B, T]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    ang = pos.float()[:, None, :, None] * inv  # [B, 1, T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1), torch.cat([ang.sin(), ang.sin()], -1)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return (x.float() * cos + torch.cat([-x2, x1], -1).float() * sin).to(x.dtype)


class DraftLayer(nn.Module):
    def __init__(self, c: dict):
        super().__init__()
        H, nh, nkv, D, I = c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"], \
            c["intermediate_size"]
        self.nh, self.nkv, self.D, self.theta = nh, nkv, D, c["rope_theta"]
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(H, c["rms_norm_eps"]), RMSNorm(H, c["rms_norm_eps"])
        self.self_attn = nn.Module()
        a = self.self_attn
        a.q_proj, a.k_proj, a.v_proj = nn.Linear(H, nh * D, bias=False), nn.Linear(H, nkv * D, bias=False), \
            nn.Linear(H, nkv * D, bias=False)
        a.o_proj = nn.Linear(nh * D, H, bias=False)
        a.q_norm, a.k_norm = RMSNorm(D, c["rms_norm_eps"]), RMSNorm(D, c["rms_norm_eps"])
        self.mlp = nn.Module()
        self.mlp.gate_proj, self.mlp.up_proj = nn.Linear(H, I, bias=False), nn.Linear(H, I, bias=False)
        self.mlp.down_proj = nn.Linear(I, H, bias=False)

    def heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(x.shape[0], x.shape[1], n, self.D).transpose(1, 2)

    def forward(self, x, ctx, pos_q, pos_c, mask):
        a = self.self_attn
        h = self.input_layernorm(x)
        q = rope(a.q_norm(self.heads(a.q_proj(h), self.nh)), pos_q, self.theta)
        k = torch.cat([rope(a.k_norm(self.heads(a.k_proj(ctx), self.nkv)), pos_c, self.theta),
                       rope(a.k_norm(self.heads(a.k_proj(h), self.nkv)), pos_q, self.theta)], 2)
        v = torch.cat([self.heads(a.v_proj(ctx), self.nkv), self.heads(a.v_proj(h), self.nkv)], 2)
        rep = self.nh // self.nkv
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                           attn_mask=mask)
        x = x + a.o_proj(o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1))
        m = self.mlp
        h = self.post_attention_layernorm(x)
        return x + m.down_proj(F.silu(m.gate_proj(h)) * m.up_proj(h))


class DFlashDrafter(nn.Module):
    """Tensor names as z-lab's checkpoints: fc, hidden_norm, layers.*, norm."""

    def __init__(self, c: dict):
        super().__init__()
        H = c["hidden_size"]
        self.fc = nn.Linear(len(TARGET_LAYER_IDS) * H, H, bias=False)
        self.hidden_norm, self.norm = RMSNorm(H, c["rms_norm_eps"]), RMSNorm(H, c["rms_norm_eps"])
        self.layers = nn.ModuleList(DraftLayer(c) for _ in range(c["num_hidden_layers"]))

    def forward(self, block_emb, taps, pos_q, pos_c, mask):
        ctx = self.hidden_norm(self.fc(taps))
        x = block_emb
        for layer in self.layers:
            x = layer(x, ctx, pos_q, pos_c, mask)
        return self.norm(x)


@torch.no_grad()
def target_taps(model: Qwen3_5ForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """The residual stream after each of TARGET_LAYER_IDS, concatenated: [B, T, len(ids) * H]."""
    got: dict[int, torch.Tensor] = {}
    hooks = [model.model.layers[i].register_forward_hook(
        lambda _m, _in, out, i=i: got.__setitem__(i, out[0] if isinstance(out, tuple) else out))
        for i in TARGET_LAYER_IDS]
    try:
        model.model(input_ids=ids)
    finally:
        for h in hooks:
            h.remove()
    return torch.cat([got[i] for i in TARGET_LAYER_IDS], -1)


@torch.no_grad()
def greedy(model: Qwen3_5ForCausalLM, prompts: torch.Tensor, new: int) -> torch.Tensor:
    out = model.generate(input_ids=prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new,
                         min_new_tokens=new, do_sample=False, eos_token_id=None, pad_token_id=EOS_ID)
    return out[:, prompts.shape[1]:]


def train_drafter(target: Qwen3_5ForCausalLM, stream: np.ndarray, seconds: float, device: str) -> DFlashDrafter:
    torch.manual_seed(1)
    target.requires_grad_(False)  # its embedding and LM head are borrowed, frozen
    drafter = DFlashDrafter(DRAFT).to(device)
    print(f"drafter: {sum(p.numel() for p in drafter.parameters()) / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(drafter.parameters(), lr=1.5e-3, betas=(0.9, 0.95), weight_decay=0.05)
    embed, head = target.model.embed_tokens, target.lm_head
    rng = np.random.default_rng(2)
    P, n_anchor, B = 64, 8, 64
    # A pool of the target's greedy continuations, generated in large batches for the first quarter of the budget.
    t0, pool = time.time(), []
    while time.time() - t0 < seconds / 4 or not pool:
        prompts = windows(stream, 512, P, rng, device)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            pool.append(torch.cat([prompts, greedy(target, prompts, 128)], 1))  # [512, T]: target-greedy after P
    pool = torch.cat(pool)
    print(f"drafter data: {pool.shape[0]} target continuations of {pool.shape[1] - P} tokens", flush=True)
    weights = torch.exp(-torch.arange(BLOCK - 1, device=device, dtype=torch.float32) / 7.0)
    t0, step, seconds = time.time(), 0, seconds - (time.time() - t0)
    while (elapsed := time.time() - t0) < seconds:
        for g in opt.param_groups:
            g["lr"] = lr_at(elapsed / seconds, 1.5e-3)
        seq = pool[torch.from_numpy(rng.integers(0, pool.shape[0], B)).to(device)]
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=device == "cuda"):
            T = seq.shape[1]
            taps = target_taps(target, seq)
            # Anchors: the anchor token is known, slots 1..15 predict target-greedy tokens (positions >= P).
            anchors = torch.stack([torch.from_numpy(rng.choice(np.arange(P - 1, T - BLOCK + 1), n_anchor,
                                                                replace=False)) for _ in range(B)]).to(device)
            offs = torch.arange(BLOCK, device=device)
            pos_q = (anchors[:, :, None] + offs).reshape(B, -1)  # [B, n * BLOCK]
            block_ids = torch.full((B, n_anchor, BLOCK), MASK_ID, device=device, dtype=torch.long)
            block_ids[:, :, 0] = torch.gather(seq, 1, anchors)
            labels = torch.gather(seq, 1, pos_q).view(B, n_anchor, BLOCK)[:, :, 1:]
            # Mask [B, 1, n * BLOCK, T + n * BLOCK]: context strictly before the block's anchor, its own block.
            ctx_ok = torch.arange(T, device=device)[None, None, :] < anchors.repeat_interleave(BLOCK, 1)[:, :, None]
            blk = torch.arange(n_anchor, device=device).repeat_interleave(BLOCK)
            blk_ok = (blk[:, None] == blk[None, :]).expand(B, -1, -1)
            mask = torch.cat([ctx_ok, blk_ok], 2)[:, None]
            pos_c = torch.arange(T, device=device)[None].expand(B, -1)
            out = drafter(embed(block_ids.view(B, -1)), taps, pos_q, pos_c, mask)
            logits = head(out.view(B, n_anchor, BLOCK, -1)[:, :, 1:]).float()
        ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
        loss = (ce.view(B, n_anchor, BLOCK - 1) * weights).sum() / (weights.sum() * B * n_anchor)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        opt.step()
        if step % 25 == 0:
            acc = (logits.argmax(-1) == labels).float().mean(dim=(0, 1))
            print(f"drafter step {step} {elapsed:.0f}s loss {loss.item():.3f} slot acc 1/4/8/15 "
                  f"{acc[0]:.2f} {acc[3]:.2f} {acc[7]:.2f} {acc[14]:.2f}", flush=True)
        step += 1
    return drafter.eval()


def drafter_config() -> dict:
    c = DRAFT
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "block_size": BLOCK,
        "dflash_config": {"mask_token_id": MASK_ID, "target_layer_ids": TARGET_LAYER_IDS},
        "hidden_size": c["hidden_size"], "num_hidden_layers": c["num_hidden_layers"],
        "num_attention_heads": c["num_attention_heads"], "num_key_value_heads": c["num_key_value_heads"],
        "head_dim": c["head_dim"], "intermediate_size": c["intermediate_size"], "hidden_act": "silu",
        "rms_norm_eps": c["rms_norm_eps"], "rope_theta": c["rope_theta"], "rope_scaling": None,
        "max_position_embeddings": TARGET["max_position_embeddings"],
        "num_target_layers": TARGET["num_hidden_layers"], "vocab_size": TARGET["vocab_size"],
        "layer_types": ["full_attention"] * c["num_hidden_layers"], "sliding_window": None,
        "tie_word_embeddings": False, "attention_bias": False, "dtype": "bfloat16",
    }


# ------------------------------------------------------------------------------------------------ main

def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokenizer", type=Path, required=True, help="folder with tokenizer.json, tokenizer_config.json")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--target-seconds", type=float, default=240)
    ap.add_argument("--draft-seconds", type=float, default=150)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    stream, dev = corpus(tok)
    prompts = dev_prompts(dev)

    target = train_target(stream, args.target_seconds, args.device)
    print(f"target held-out loss {held_out_loss(target, dev, args.device):.3f} nats/token", flush=True)
    drafter = train_drafter(target, stream, args.draft_seconds, args.device)

    out_t, out_d = args.out / "target", args.out / "drafter"
    shutil.rmtree(args.out, ignore_errors=True)
    target.to(torch.bfloat16).save_pretrained(out_t, max_shard_size="4MB")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / name, out_t / name)
    out_d.mkdir(parents=True)
    from safetensors.torch import save_file
    save_file({n: p.detach().to(torch.bfloat16).contiguous() for n, p in drafter.state_dict().items()},
              str(out_d / "model.safetensors"))
    (out_d / "config.json").write_text(json.dumps(drafter_config(), indent=2) + "\n")

    # Goldens: the saved (bf16) target's weights in float32, greedy.
    golden = Qwen3_5ForCausalLM.from_pretrained(out_t, dtype=torch.float32).to(args.device).eval()
    (args.out / "prompts_dev.json").write_text(json.dumps({"prompts": prompts}) + "\n")
    with (args.out / "golden_dev.jsonl").open("w") as f:
        for p in prompts:
            ar = greedy(golden, torch.tensor([p], device=args.device), NEW_TOKENS)[0].tolist()
            f.write(json.dumps({"prompt_ids": p, "ar_ids": ar}) + "\n")
    size = sum(p.stat().st_size for p in args.out.rglob("*") if p.is_file())
    print(f"wrote {args.out} ({size / 1e6:.2f} MB)", flush=True)


if __name__ == "__main__":
    main()
