"""RoPE frequency tables: default, llama3 and yarn, as the Hugging Face implementations compute them.

The tables are built once on the host in float32 (angles = position * inv_freq in float32, as the reference
does) and uploaded; every backend's RoPE op only looks them up.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from cudflash.config import RopeConfig


def inv_freq_and_scale(rope: RopeConfig, head_dim: int) -> tuple[np.ndarray, float]:
    """inv_freq [head_dim // 2] (float32) and the factor that multiplies cos and sin."""
    exponents = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    pos_freqs = np.power(np.float32(rope.theta), exponents, dtype=np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    if rope.kind == "default":
        return inv_freq, 1.0
    if rope.kind in ("llama3", "yarn") and not rope.original_max_position_embeddings:
        raise ValueError(f"{rope.kind} RoPE needs original_max_position_embeddings (parse_rope fills it)")
    if rope.kind == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, head_dim, pos_freqs)
    raise ValueError(f"unknown RoPE kind {rope.kind}")


def _yarn(rope: RopeConfig, head_dim: int, pos_freqs: np.ndarray) -> tuple[np.ndarray, float]:
    factor = rope.factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attention_factor = rope.attention_factor
    if attention_factor is None:
        if rope.mscale and rope.mscale_all_dim:
            attention_factor = mscale(factor, rope.mscale) / mscale(factor, rope.mscale_all_dim)
        else:
            attention_factor = mscale(factor)

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))) / (
            2 * math.log(rope.theta)
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = np.clip((np.arange(head_dim // 2, dtype=np.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    inv_freq = interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
    return inv_freq.astype(np.float32), float(attention_factor)


def rope_tables(rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin: [max_positions, head_dim // 2] float32."""
    inv_freq, scale = inv_freq_and_scale(rope, head_dim)
    angles = np.arange(max_positions, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(angles), np.sin(angles)
    if scale != 1.0:
        cos, sin = cos * np.float32(scale), sin * np.float32(scale)
    return cos.astype(np.float32), sin.astype(np.float32)


def device_rope_tables(backend: Any, rope: RopeConfig, head_dim: int, max_positions: int) -> tuple[Any, Any]:
    """rope_tables on the backend (float32), for the positions a run can reach: sized by the serving length
    (ModelRunner.max_positions), never by the config's max_position_embeddings alone."""
    cos, sin = rope_tables(rope, head_dim, max_positions)
    return backend.asarray(cos, "f32"), backend.asarray(sin, "f32")


def partial_rope_tables(rope: RopeConfig, head_dim: int, rotary_dim: int,
                        max_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, head_dim // 2] for heads whose first `rotary_dim` channels RoPE rotates (rotate-half
    within them) and whose other channels pass through, *after* the channel permutation `partial_rotary_order`: the
    pair (i, i + rotary_dim / 2) then sits at (i, i + head_dim / 2), which the full-width rotate-half op rotates with
    column i of the tables, and every other column is cos = 1, sin = 0 (x * 1 - y * 0 == x exactly). So the op set's
    RoPE serves partial rotary unchanged; q and k are permuted alike, which leaves q . k as it was."""
    cos, sin = rope_tables(rope, rotary_dim, max_positions)  # [P, rotary_dim / 2]: the frequencies of dim rotary_dim
    full_cos = np.ones((max_positions, head_dim // 2), dtype=np.float32)
    full_sin = np.zeros((max_positions, head_dim // 2), dtype=np.float32)
    full_cos[:, : rotary_dim // 2], full_sin[:, : rotary_dim // 2] = cos, sin
    return full_cos, full_sin


def partial_rotary_order(head_dim: int, rotary_dim: int) -> np.ndarray:
    """The channel order of one head that partial_rope_tables assumes: [rot first half | pass first half | rot second
    half | pass second half], as indices into the checkpoint's order [rot (rotary_dim) | pass]."""
    r, p = rotary_dim // 2, (head_dim - rotary_dim) // 2
    rot1, rot2 = np.arange(r), np.arange(r, 2 * r)
    pass1, pass2 = np.arange(2 * r, 2 * r + p), np.arange(2 * r + p, head_dim)
    return np.concatenate([rot1, pass1, rot2, pass2])


def mrope_angles(inv_freq: np.ndarray, positions: np.ndarray, section: list[int], interleaved: bool) -> np.ndarray:
    """Multimodal RoPE angles [T, len(inv_freq)] from positions [3, T] (temporal, height, width): frequency j takes
    the position of its axis. Interleaved (Qwen3.5): j % 3 == 1 (j < 3 * section[1]) is height, j % 3 == 2
    (j < 3 * section[2]) width, the rest temporal; otherwise consecutive blocks of section[0], [1], [2]. The reference
    for text-only positions, where every axis has the same position and this is plain RoPE."""
    angles = positions.astype(np.float32)[:, :, None] * inv_freq[None, None, :]  # [3, T, F]
    axis = np.zeros(len(inv_freq), dtype=np.int64)
    j = np.arange(len(inv_freq))
    if interleaved:
        axis[(j % 3 == 1) & (j < 3 * section[1])] = 1
        axis[(j % 3 == 2) & (j < 3 * section[2])] = 2
    else:
        axis[section[0]:section[0] + section[1]] = 1
        axis[section[0] + section[1]:] = 2
    return np.take_along_axis(angles, axis[None, None, :].repeat(angles.shape[1], 1), axis=0)[0]
