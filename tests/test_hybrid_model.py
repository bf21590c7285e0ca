"""The hybrid target on the numpy backend: both checkpoint classes load as written (vision tower and mtp head
skipped), the model equals a direct transcription of transformers' layer math, chunked prefill carries state, and
speculative verify + rollback reproduces greedy decoding exactly."""
from __future__ import annotations

import numpy as np
import pytest

from cudflash.backends.numpy_backend import NumpyBackend
from cudflash.checkpoint import Checkpoint
from cudflash.config import load_target_config
from cudflash.models.hybrid import HybridTargetModel, skipped_tensors
from cudflash.models.hybrid_reference import OneSequence, greedy, speculative_greedy
from cudflash.models.weights import WeightLoader
from cudflash.tiny_hybrid import HybridShape, write_hybrid_target

B = NumpyBackend()


class Recording(WeightLoader):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.names_read: list[str] = []

    def read(self, name, shape):  # get and fused both read through here
        self.names_read.append(name)
        return super().read(name, shape)


def load(directory):
    cfg = load_target_config(directory)
    loader = Recording(Checkpoint(directory), B)
    return HybridTargetModel(cfg, loader, B), loader


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid")
    cond = write_hybrid_target(root / "cond", HybridShape(checkpoint_class="conditional", shards=3), seed=11)
    causal = write_hybrid_target(root / "causal", HybridShape(checkpoint_class="causal"), seed=11)
    return {"conditional": (cond, *load(cond)), "causal": (causal, *load(causal))}


PROMPT = [int(x) for x in np.random.default_rng(1).integers(2, 250, 75)]  # longer than one GDN chunk


def test_released_layouts_load_and_skip_the_vision_tower_and_mtp(models):
    for cls, (directory, model, loader) in models.items():
        ckpt = Checkpoint(directory)
        skipped = skipped_tensors(ckpt, model.cfg)
        assert any(n.startswith("mtp.") for n in skipped)
        assert any(n.startswith("model.visual.") for n in skipped) is (cls == "conditional")
        assert not set(skipped) & set(loader.names_read)  # never uploaded
        assert set(loader.names_read) == set(ckpt.names) - set(skipped)  # everything else is read, once each
        assert len(loader.names_read) == len(set(loader.names_read))


def test_both_classes_hold_one_language_model(models):
    a = greedy(models["conditional"][1], PROMPT, 12)
    assert a == greedy(models["causal"][1], PROMPT, 12)
    assert len(set(a)) > 2  # not a degenerate repetition


def test_chunked_prefill_in_pieces_equals_one_prefill(models):
    model = models["causal"][1]
    whole = greedy(model, PROMPT, 8)
    assert greedy(model, PROMPT, 8, prefill_chunk=30) == whole  # pieces across and inside a GDN chunk
    assert greedy(model, PROMPT, 8, prefill_chunk=1) == whole  # token by token through the chunked form


def test_decode_logits_equal_prefill_logits(models):
    """Row t of a prefill over prompt + continuation equals the decode step that produced it (recurrent vs
    chunked form, through the whole model)."""
    model = models["causal"][1]
    cont = greedy(model, PROMPT, 6)
    seq = OneSequence(model, 100)
    full, _, _ = seq.run(PROMPT + cont[:-1], "prefill")
    seq2 = OneSequence(model, 100)
    logits, _, _ = seq2.run(PROMPT, "prefill")
    seq2.length = len(PROMPT)
    rows = [logits[-1]]
    for t in cont[:-1]:
        logits, _, _ = seq2.run([t], "decode")
        seq2.length += 1
        rows.append(logits[-1])
    np.testing.assert_allclose(np.stack(rows), full[len(PROMPT) - 1:], rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("drafts", ["oracle", "random", "half"])
def test_speculative_verify_and_rollback_reproduce_greedy(models, drafts):
    model = models["conditional"][1]
    want = greedy(model, PROMPT, 30)
    rng = np.random.default_rng(0)

    def propose(tokens: list[int], n: int) -> list[int]:
        done = len(tokens) - len(PROMPT)
        truth = (want + [0] * 16)[done:done + n]
        if drafts == "oracle":
            return truth
        if drafts == "random":
            return [int(t) for t in rng.integers(2, 250, n)]
        return truth[: n // 2] + [int(t) for t in rng.integers(2, 250, n - n // 2)]

    got, lens = speculative_greedy(model, PROMPT, 30, block=6, propose=propose)
    assert got == want
    if drafts == "oracle":
        assert lens == [6] * len(lens)
    if drafts == "half":
        assert max(lens) > 1 and min(lens) < 6  # both partial acceptance and rejection happened


# ------------------------------------------------------------------ a direct transcription of the reference

def _reference_logits(directory, cfg, ids: list[int]) -> np.ndarray:
    """transformers' Qwen3.5 text forward written out from the checkpoint's tensors (no KV cache, no permutation,
    no fused weights): RMSNorm (1 + w); q_proj viewed [heads, 2 D] and split into query and gate; partial rotary on
    the first rotary_dim channels; GDN via the per-token rule; gated norm w * silu(z)."""
    ck, h, T = Checkpoint(directory), cfg.hybrid, len(ids)
    P = h.tensor_prefix
    w = lambda n: ck.float32(n)  # noqa: E731
    eps = cfg.rms_norm_eps

    def rms(x, weight, offset=1.0):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * (offset + weight)

    silu = lambda x: x / (1 + np.exp(-x))  # noqa: E731
    x = w(P + "embed_tokens.weight")[ids]
    r, D = h.rotary_dim, cfg.head_dim
    inv = 1.0 / (cfg.rope.theta ** (np.arange(0, r, 2, dtype=np.float32) / r))
    ang = np.arange(T)[:, None] * inv[None]
    cos, sin = np.cos(np.concatenate([ang, ang], -1)), np.sin(np.concatenate([ang, ang], -1))

    def rope(t):  # [T, heads, D]
        rot, rest = t[..., :r], t[..., r:]
        half = np.concatenate([-rot[..., r // 2:], rot[..., : r // 2]], -1)
        return np.concatenate([rot * cos[:, None] + half * sin[:, None], rest], -1)

    for i, kind in enumerate(h.layer_types):
        p = f"{P}layers.{i}."
        y = rms(x, w(p + "input_layernorm.weight"))
        if kind == "full_attention":
            a = p + "self_attn."
            qg = (y @ w(a + "q_proj.weight").T).reshape(T, cfg.num_heads, 2 * D)
            q, gate = qg[..., :D], qg[..., D:].reshape(T, -1)
            k = (y @ w(a + "k_proj.weight").T).reshape(T, cfg.num_kv_heads, D)
            v = (y @ w(a + "v_proj.weight").T).reshape(T, cfg.num_kv_heads, D)
            q, k = rope(rms(q, w(a + "q_norm.weight"))), rope(rms(k, w(a + "k_norm.weight")))
            rep = cfg.num_heads // cfg.num_kv_heads
            k, v = np.repeat(k, rep, 1), np.repeat(v, rep, 1)
            s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(D) + np.triu(np.full((T, T), -np.inf), 1)
            pr = np.exp(s - s.max(-1, keepdims=True))
            pr /= pr.sum(-1, keepdims=True)
            o = np.einsum("hqk,khd->qhd", pr, v).reshape(T, -1) * (1 / (1 + np.exp(-gate)))
            mixed = o @ w(a + "o_proj.weight").T
        else:
            a = p + "linear_attn."
            hk, hv, dk, dv = h.linear_num_key_heads, h.linear_num_value_heads, h.linear_key_head_dim, \
                h.linear_value_head_dim
            qkv = y @ w(a + "in_proj_qkv.weight").T
            conv = w(a + "conv1d.weight")[:, 0]  # [C, K]
            K = conv.shape[1]
            padded = np.concatenate([np.zeros((K - 1, qkv.shape[1])), qkv])
            qkv = silu(np.stack([(padded[t:t + K] * conv.T).sum(0) for t in range(T)]))
            q = qkv[:, : hk * dk].reshape(T, hk, dk)
            k = qkv[:, hk * dk: 2 * hk * dk].reshape(T, hk, dk)
            v = qkv[:, 2 * hk * dk:].reshape(T, hv, dv)
            l2 = lambda t: t / np.sqrt((t * t).sum(-1, keepdims=True) + 1e-6)  # noqa: E731
            q, k = np.repeat(l2(q), hv // hk, 1) / np.sqrt(dk), np.repeat(l2(k), hv // hk, 1)
            beta = 1 / (1 + np.exp(-(y @ w(a + "in_proj_b.weight").T)))
            g = -np.exp(w(a + "A_log")) * np.log1p(np.exp(y @ w(a + "in_proj_a.weight").T + w(a + "dt_bias")))
            S = np.zeros((hv, dk, dv))
            o = np.zeros((T, hv, dv))
            for t in range(T):
                S = S * np.exp(g[t])[:, None, None]
                delta = (v[t] - np.einsum("hkv,hk->hv", S, k[t])) * beta[t][:, None]
                S = S + k[t][:, :, None] * delta[:, None, :]
                o[t] = np.einsum("hkv,hk->hv", S, q[t])
            z = (y @ w(a + "in_proj_z.weight").T).reshape(T, hv, dv)
            o = rms(o, w(a + "norm.weight"), offset=0.0) * silu(z)
            mixed = o.reshape(T, -1) @ w(a + "out_proj.weight").T
        x = x + mixed
        y = rms(x, w(p + "post_attention_layernorm.weight"))
        x = x + (silu(y @ w(p + "mlp.gate_proj.weight").T) * (y @ w(p + "mlp.up_proj.weight").T)) \
            @ w(p + "mlp.down_proj.weight").T
    head = w("lm_head.weight") if "lm_head.weight" in ck else w(P + "embed_tokens.weight")
    return rms(x, w(P + "norm.weight")) @ head.T


@pytest.mark.parametrize("tied", [False, True])
def test_model_equals_a_direct_transcription_of_the_reference(tmp_path, tied):
    d = write_hybrid_target(tmp_path / "t", HybridShape(checkpoint_class="conditional", tie_word_embeddings=tied,
                                                        layer_types=["linear_attention", "full_attention"] * 2),
                            seed=3)
    model, _ = load(d)
    ids = PROMPT[:70]
    want = _reference_logits(d, model.cfg, ids)
    got, _, _ = OneSequence(model, 80).run(ids, "prefill")
    assert np.abs(want).max() > 1.0
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=5e-4)  # float32 against float64: ~1e-4 apart


@pytest.mark.parametrize("tied", [False, True])
def test_quantize_lm_head_on_a_hybrid_converts_the_head_alone(tmp_path, tied):
    """A hybrid's LM head (under model.language_model for a tied one) in block-scaled FP8: the exact dequantized
    values, the embedding kept as stored."""
    from cudflash import LLM
    from cudflash.checkpoint import Checkpoint
    from cudflash.quant import dequantize, quantize_fp8_block

    d = write_hybrid_target(tmp_path / "t", HybridShape(checkpoint_class="conditional", tie_word_embeddings=tied),
                            seed=4)
    ck = Checkpoint(d)
    head = "model.language_model.embed_tokens.weight" if tied else "lm_head.weight"
    t = LLM(d, backend="cpu", quantize_lm_head=True).runner.target
    plain = LLM(d, backend="cpu").runner.target
    assert np.array_equal(t.lm_head, dequantize(quantize_fp8_block(ck.float32(head))))
    assert not np.array_equal(t.lm_head, plain.lm_head) and np.array_equal(t.embed_tokens, plain.embed_tokens)
