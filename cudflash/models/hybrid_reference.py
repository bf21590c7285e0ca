"""Plain loops over HybridTargetModel on one sequence: greedy decoding (prefill chunked, decode token by token) and a
speculative greedy loop that verifies proposed drafts and rolls the hybrid state back, for tests and goldens.

Neither is the engine (the engine's tests compare against these): one sequence, state slot 0, KV in contiguous
blocks, no scheduler. The speculative loop is the engine's verify / accept / commit in miniature, so its output
equals greedy decoding for any drafts exactly when the rollback is exact.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from cudflash.backends.base import build_meta
from cudflash.models.batch import ForwardBatch
from cudflash.models.hybrid import HybridCache, HybridTargetModel, mode_use

KV_BLOCK = 16


class OneSequence:
    """One sequence's cache (KV blocks 0.. in order, state slot 0) and the forward calls on it."""

    def __init__(self, model: HybridTargetModel, max_len: int):
        self.model, self.b = model, model.b
        if model.rope_cos is None or model.rope_cos.shape[0] < max_len:
            model.set_rope(max_len)
        self.blocks = -(-max_len // KV_BLOCK)
        self.cache: HybridCache = model.new_cache(self.blocks, KV_BLOCK, state_slots=1)
        self.slots = np.zeros(1, np.int32)  # host; the state slot of the one sequence
        self.slots_device = self.b.asarray(self.slots, "i32")
        self.length = 0  # tokens whose KV and state are committed

    def run(self, ids: list[int], mode: str, tap_layers: list[int] | None = None):
        """Forward of `ids` at positions length.. (rows [T]): (logits [T, V] float32 host, taps, tape)."""
        b, n = self.b, len(ids)
        pos = np.arange(self.length, self.length + n, dtype=np.int32)
        meta = b.prepare_meta(build_meta([n], [self.length + n], [list(range(self.blocks))]))
        batch = ForwardBatch(b.asarray(np.asarray(ids, np.int32), "i32"), b.asarray(pos, "i32"),
                             b.asarray(pos, "i32"), meta)  # contiguous blocks: a position's slot is the position
        use = mode_use(b, self.slots, meta.cu_seqlens_q, mode)
        hidden, taps, tape = self.model.forward(batch, self.cache, use, tap_layers)
        return b.to_numpy(self.model.logits(hidden)), taps, tape


def greedy(model: HybridTargetModel, prompt: list[int], max_new: int, prefill_chunk: int | None = None) -> list[int]:
    """Greedy continuation of `prompt`: the prompt prefilled (chunked form; in pieces of prefill_chunk tokens if
    given), then one token per decode step (recurrent form)."""
    seq = OneSequence(model, len(prompt) + max_new)
    step = prefill_chunk or len(prompt)
    for lo in range(0, len(prompt), step):
        logits, _, _ = seq.run(prompt[lo:lo + step], "prefill")
        seq.length += len(prompt[lo:lo + step])
    out = [int(np.argmax(logits[-1]))]
    while len(out) < max_new:
        logits, _, _ = seq.run([out[-1]], "decode")
        seq.length += 1
        out.append(int(np.argmax(logits[-1])))
    return out


def speculative_greedy(model: HybridTargetModel, prompt: list[int], max_new: int, block: int,
                       propose: Callable[[list[int], int], list[int]]) -> tuple[list[int], list[int]]:
    """Greedy decoding by verify + rollback: each step verifies [pending, d1..d(block-1)] (drafts from
    propose(tokens so far, count)), accepts the longest prefix that greedy agrees with, and commits the hybrid state
    by the pending token and the accepted drafts. Returns (tokens, acceptance lengths)."""
    seq = OneSequence(model, len(prompt) + max_new + block)
    logits, _, _ = seq.run(prompt, "prefill")
    seq.length = len(prompt)
    out, accept_lens = [int(np.argmax(logits[-1]))], []
    while len(out) < max_new:
        drafts = propose(prompt + out, block - 1)
        logits, _, tape = seq.run([out[-1]] + drafts, "verify")
        best = np.argmax(logits, axis=-1)
        a = 0
        while a < len(drafts) and drafts[a] == best[a]:
            a += 1
        model.commit(tape, seq.cache, seq.slots_device, [a + 1])  # the pending token and a drafts
        seq.length += a + 1  # KV past here is stale and is overwritten by the next verify
        out += [int(t) for t in best[: a + 1]]
        accept_lens.append(a + 1)
    return out[:max_new], accept_lens
