"""An independent transcription of the drafter formulas (docs/drafters.md) in plain numpy, for tests.

Nothing here calls the engine's model or proposer code: the target and drafter forwards are written out from
the Hugging Face / z-lab definitions, over the whole context at once (no paged cache), and the heads from the
DFlash2 / DSpark definitions. Only the safetensors reader is shared (to see exactly the stored values).
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from cudflash.checkpoint import Checkpoint, SafetensorsFile

F = np.float32


def read(path: Path) -> tuple[dict, dict[str, np.ndarray]]:
    cfg = json.loads((path / "config.json").read_text())
    ckpt = Checkpoint(path)
    w = {}
    for name in ckpt.names:
        info = ckpt.info(name)
        w[name] = ckpt.float32(name) if info.dtype in ("BF16", "F16", "F32") else SafetensorsFile(info.file).array(info)
    return cfg, w


def rms(x: np.ndarray, w: np.ndarray, eps: float = 1e-6) -> np.ndarray:
    return (w * (x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + F(eps)))).astype(F)


def rope(x: np.ndarray, pos: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE on [T, heads, D] at positions pos [T]."""
    d = x.shape[-1]
    inv = F(1.0) / np.power(F(theta), np.arange(0, d, 2).astype(F) / F(d), dtype=F)
    ang = (pos.astype(F)[:, None] * inv[None, :])[:, None, :]
    c, s = np.cos(ang), np.sin(ang)
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1).astype(F)


def attend(q: np.ndarray, k: np.ndarray, v: np.ndarray, visible: np.ndarray) -> np.ndarray:
    """q [Tq, Hq, D], k/v [Tk, Hk, D], visible [Tq, Tk] -> [Tq, Hq * D] (grouped-query attention)."""
    group = q.shape[1] // k.shape[1]
    k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(F(q.shape[-1]))
    s = np.where(visible[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    return np.einsum("hqk,khd->qhd", p, v).reshape(q.shape[0], -1).astype(F)


def mlp(x: np.ndarray, w: dict, p: str) -> np.ndarray:
    g, u = x @ w[p + "mlp.gate_proj.weight"].T, x @ w[p + "mlp.up_proj.weight"].T
    return ((g / (1 + np.exp(-g))) * u) @ w[p + "mlp.down_proj.weight"].T


def target_taps(cfg: dict, w: dict, ids: list[int], layer_ids: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Qwen3 causal forward: (taps [T, K * H], the residual stream after each layer in layer_ids; logits [T, V])."""
    D, theta = cfg["head_dim"], cfg["rope_parameters"]["rope_theta"]
    pos = np.arange(len(ids))
    x = w["model.embed_tokens.weight"][ids]
    taps = {}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        h = rms(x, w[p + "input_layernorm.weight"])
        a = p + "self_attn."
        q = rope(rms((h @ w[a + "q_proj.weight"].T).reshape(len(ids), -1, D), w[a + "q_norm.weight"]), pos, theta)
        k = rope(rms((h @ w[a + "k_proj.weight"].T).reshape(len(ids), -1, D), w[a + "k_norm.weight"]), pos, theta)
        v = (h @ w[p + "self_attn.v_proj.weight"].T).reshape(len(ids), -1, D)
        x = x + attend(q, k, v, pos[None, :] <= pos[:, None]) @ w[p + "self_attn.o_proj.weight"].T
        x = x + mlp(rms(x, w[p + "post_attention_layernorm.weight"]), w, p)
        taps[i] = x
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    return np.concatenate([taps[i] for i in layer_ids], axis=1), rms(x, w["model.norm.weight"]) @ head.T


def conv(x: np.ndarray, coeff: np.ndarray, base: np.ndarray, group: int) -> np.ndarray:
    """out[t, c] = sum_{tau <= t} (base[tau, c] + coeff[t, tau, c // group]) * x[t - tau, c], within one block."""
    taps = base.shape[0]
    coeff = coeff.reshape(x.shape[0], taps, -1)
    out = np.zeros_like(x)
    for t in range(x.shape[0]):
        for tau in range(min(taps, t + 1)):
            out[t] += (base[tau] + np.repeat(coeff[t, tau], group)) * x[t - tau]
    return out


def draft_hidden(cfg: dict, w: dict, taps: np.ndarray, block_ids: list[int], target_w: dict,
                 windows: list[int], causal: list[bool] | None = None) -> np.ndarray:
    """The drafter's final-normed hidden states of the block [B, H]; context = taps of positions 0..L-1."""
    dc = cfg.get("dflash_config") or {}
    D = cfg["head_dim"]
    theta = (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg["rope_theta"]
    taps_k = dc.get("conv_kernel_size", 0)
    group = dc.get("conv_group_size", 1)
    L, B = taps.shape[0], len(block_ids)
    ctx = rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    ctx_pos, blk_pos = np.arange(L), np.arange(L, L + B)
    all_pos = np.concatenate([ctx_pos, blk_pos])
    x = w.get("embed_tokens.weight", target_w["model.embed_tokens.weight"])[block_ids]
    for i in range(cfg["num_hidden_layers"]):
        p, a = f"layers.{i}.", f"layers.{i}.self_attn."
        h = rms(x, w[p + "input_layernorm.weight"])
        if taps_k:
            c_attn = h @ w[p + "attention_conv.kernel_projection.weight"].T
            h = conv(h, c_attn[:, : c_attn.shape[1] // 2], w[p + "attention_conv.base_kernel"][0], group)
        q = rope(rms((h @ w[a + "q_proj.weight"].T).reshape(B, -1, D), w[a + "q_norm.weight"]), blk_pos, theta)
        kv_in = np.concatenate([ctx, h])  # context rows never pass through the convolution
        k = rope(rms((kv_in @ w[a + "k_proj.weight"].T).reshape(L + B, -1, D), w[a + "k_norm.weight"]), all_pos, theta)
        v = (kv_in @ w[a + "v_proj.weight"].T).reshape(L + B, -1, D)
        visible = np.ones((B, L + B), dtype=bool)  # non-causal
        if causal and causal[i]:  # block row j sees the context and block rows 0..j
            visible &= all_pos[None, :] <= blk_pos[:, None]
        if windows[i]:
            visible &= all_pos[None, :] > blk_pos[:, None] - windows[i]
        o = attend(q, k, v, visible) @ w[a + "o_proj.weight"].T
        if taps_k:
            o = conv(o, c_attn[:, c_attn.shape[1] // 2:], w[p + "attention_conv.base_kernel"][1], group)
        x = x + o
        h = rms(x, w[p + "post_attention_layernorm.weight"])
        if taps_k:
            c_mlp = h @ w[p + "mlp_conv.kernel_projection.weight"].T
            h = conv(h, c_mlp[:, : c_mlp.shape[1] // 2], w[p + "mlp_conv.base_kernel"][0], group)
        m = mlp(h, w, p)
        if taps_k:
            m = conv(m, c_mlp[:, c_mlp.shape[1] // 2:], w[p + "mlp_conv.base_kernel"][1], group)
        x = x + m
    return rms(x, w["norm.weight"])


def softmax(x: np.ndarray, t: float = 1.0) -> np.ndarray:
    e = np.exp((x - x.max()) / t)
    return e / e.sum()


def layer_causal(cfg: dict, dc: dict, types: list[str]) -> list[bool]:
    """z-lab dflash/model.py, Qwen3DFlashAttention: `is_causal = layer_type == "sliding_attention"` unless the config
    sets `is_causal` (vLLM also reads `dflash_config.causal`); DSpark checkpoints are not z-lab's modeling code and
    stay bidirectional unless told."""
    if cfg.get("is_causal") is not None:
        return [bool(cfg["is_causal"])] * len(types)
    if dc.get("causal") is not None:
        return [bool(dc["causal"])] * len(types)
    zlab = set(cfg["architectures"]) & {"DFlashDraftModel", "DFlash2DraftModel"} and "markov_rank" not in dc
    return [bool(zlab) and t == "sliding_attention" for t in types]


class Reference:
    """Drafts of one step, for one sequence whose committed tokens are `tokens[:-1]` and anchor `tokens[-1]`."""

    def __init__(self, target_dir: Path, draft_dir: Path, windows: list[int] | None = None):
        self.tcfg, self.tw = read(target_dir)
        self.cfg, self.w = read(draft_dir)
        dc = self.cfg.get("dflash_config") or {}
        field = lambda k, d=None: dc.get(k, self.cfg.get(k, d))  # noqa: E731  (nested or top level)
        self.kind = ("dspark" if "markov_rank" in dc or "markov_rank" in self.cfg else
                     "dflash2" if "selector_rank" in dc or "conv_kernel_size" in dc else "dflash")
        self.block, self.mask = field("block_size"), field("mask_token_id")
        self.layer_ids = field("target_layer_ids")
        self.top_k = field("selector_top_k")
        self.markov_rank = field("markov_rank", 0)
        self.with_markov = field("confidence_head_with_markov", False)
        types, sw = self.cfg["layer_types"], self.cfg.get("sliding_window")
        self.windows = windows or [sw if t == "sliding_attention" else 0 for t in types]
        self.causal = layer_causal(self.cfg, dc, types)
        self.head = self.w.get("lm_head.weight", self.tw.get("lm_head.weight", self.tw["model.embed_tokens.weight"]))
        d2t = self.w.get("d2t")
        self.to_target = (lambda i: i) if d2t is None else (lambda i: int(i + d2t[i]))  # noqa: E731

    def hidden(self, tokens: list[int], block: int) -> np.ndarray:
        taps, _ = target_taps(self.tcfg, self.tw, tokens[:-1], self.layer_ids)
        return draft_hidden(self.cfg, self.w, taps, [tokens[-1]] + [self.mask] * (block - 1), self.tw, self.windows,
                            self.causal)

    def draft_rows(self, tokens: list[int], block: int) -> tuple[np.ndarray, np.ndarray]:
        """(hidden [S, H], drafter logits [S, Vd]) of the rows that predict positions L+1 .. L+block-1."""
        h = self.hidden(tokens, block)
        h = h[:-1] if self.kind == "dspark" else h[1:]  # DSpark rows are shifted: row j predicts L + j + 1
        return h, h @ self.head.T

    def drafts(self, tokens: list[int], block: int) -> list[int]:
        h, logits = self.draft_rows(tokens, block)
        if self.kind == "dflash2":
            return self.selector_walk(tokens[-1], h, logits)[0]
        if self.kind == "dspark" and self.markov_rank:
            out, prev = [], tokens[-1]
            for u in logits:
                prev = self.to_target(int(np.argmax(u + self.w["markov_head.markov_w2.weight"]
                                                    @ self.w["markov_head.markov_w1.weight"][prev])))
                out.append(prev)
            return out
        return [self.to_target(int(np.argmax(u))) for u in logits]

    def candidates(self, u: np.ndarray) -> np.ndarray:
        return np.argsort(-u, kind="stable")[: self.top_k]

    def pair(self, a: int, h: np.ndarray, cand_t: list[int]) -> np.ndarray:
        A, Bc = self.w["candidate_selector.predecessor_codebook"], self.w["candidate_selector.successor_codebook"]
        hp = self.w["candidate_selector.hidden_projection.weight"] @ h
        return np.array([float(np.sum(A[a] * hp * Bc[b])) for b in cand_t])

    def selector_walk(self, anchor: int, h: np.ndarray, logits: np.ndarray, path: list[int] | None = None,
                      temperature: float = 1.0) -> tuple[list[int], list[np.ndarray]]:
        """Greedy walk (path None), or the q rows along a given path of target ids: softmax(S_t(prev, .) / T)."""
        out, qs, prev = [], [], anchor
        for t, u in enumerate(logits):
            cand = self.candidates(u)
            cand_t = [self.to_target(int(c)) for c in cand]
            scores = u[cand] + self.pair(prev, h[t], cand_t)
            if path is None:
                prev = cand_t[int(np.argmax(scores))]
            else:
                q = np.zeros(len(self.tw["model.embed_tokens.weight"]))
                q[cand_t] = softmax(scores, temperature)
                qs.append(q)
                prev = path[t]
            out.append(prev)
        return out, qs

    def confidence(self, tokens: list[int], block: int, drafts: list[int]) -> np.ndarray:
        h, _ = self.draft_rows(tokens, block)
        prev = [tokens[-1]] + list(drafts[:-1])
        x = h
        if self.with_markov:
            x = np.concatenate([h, self.w["markov_head.markov_w1.weight"][prev]], axis=1)
        z = x @ self.w["confidence_head.proj.weight"][0] + self.w["confidence_head.proj.bias"][0]
        return 1 / (1 + np.exp(-z.astype(np.float64)))
