"""The heads DFlash's descendants add to its backbone (definitions: docs/drafters.md, sections 2 and 3).

- `DynamicConv` (DFlash2): a grouped dynamic depthwise convolution along the block's rows around each
  sublayer. `prepare` runs on the normed sublayer input: one GEMM gives the dynamic coefficients of both
  applications, the first is applied there; `finish` applies the second to the sublayer output, before the
  residual add. Taps stop at the block boundary.
- `CandidateSelector` (DFlash2): per row t the top-K candidates of the unary logits U_t; pair score
  S_t(a, b) = U_t(b) + <A(a) * H(h_t), B(b)>; a walk from the anchor picks one candidate per row (argmax, or a
  sample from softmax(S_t(prev, .) / T) whose distribution goes to verification).
- `MarkovHead` (DSpark, vanilla): draft_k = argmax(U_k + W2 W1[draft_{k-1}]), left to right, the anchor
  first; W1 is indexed by target ids, W2 produces drafter-vocabulary logits.
- `ConfidenceHead` (DSpark): c_k = sigmoid(w . [h_k ; W1[x_{k-1}]] + b), the probability that row k is
  accepted when every earlier row was.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from cudflash.backends.base import Backend
from cudflash.models.weights import WeightLoader


class DynamicConv:
    def __init__(self, loader: WeightLoader, name: str, hidden: int, taps: int, group: int):
        self.taps, self.groups = taps, hidden // group
        self.base = loader.get(name + ".base_kernel", (2, taps, hidden))  # [2 (input, output), K, H]
        self.proj = loader.get(name + ".kernel_projection.weight", (2 * taps * self.groups, hidden))  # [2 K G, H]

    def prepare(self, b: Backend, x: Any, block: int) -> tuple[Any, Any]:
        """(convolved sublayer input, the coefficients `finish` needs); x is the normed input [T, H]."""
        coeff = b.linear(x, self.proj)  # [T, 2 K G]: (application, tap, group)
        half = self.taps * self.groups
        return b.block_conv(x, coeff[:, :half], self.base[0], block), coeff[:, half:]

    def finish(self, b: Backend, y: Any, coeff: Any, block: int) -> Any:
        return b.block_conv(y, coeff, self.base[1], block)


def softmax(x: np.ndarray, temperature: float) -> np.ndarray:
    z = x.astype(np.float64) / temperature
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


class CandidateSelector:
    def __init__(self, loader: WeightLoader, vocab: int, hidden: int, rank: int, top_k: int):
        self.top_k = top_k
        self.pred = loader.get("candidate_selector.predecessor_codebook", (vocab, rank))  # A [V, r]
        self.succ = loader.get("candidate_selector.successor_codebook", (vocab, rank))  # B [V, r]
        self.hidden_proj = loader.get("candidate_selector.hidden_projection.weight", (rank, hidden))  # H [r, hidden]

    def lattice(self, b: Backend, logits: Any, h: Any, anchors: Any, pred_rows: Any,
                to_target: Callable[[Any], Any]) -> tuple[Any, Any]:
        """Pair scores of every row, on the backend: (float32 [n S, K, K] indexed (row, predecessor candidate,
        candidate), int32 [n S, K] candidate target ids); rows are sequence-major. anchors: int32 [n]; pred_rows
        (HeadRows.pred): each row's predecessor among [the n S rows' candidates ; the n anchors repeated K times],
        so that slot 0's predecessor is the anchor. No host copy: a CUDA graph can hold it."""
        k = self.top_k
        unary, cand = b.topk(logits, k)  # [n S, K]
        cand = to_target(cand)
        anchor_rows = b.cat([anchors.reshape(-1, 1)] * k, axis=1)  # [n, K]
        pred = b.take_rows(b.cat([cand, anchor_rows], axis=0), pred_rows)
        return b.pair_scores(unary, cand, pred, b.linear(h, self.hidden_proj), self.pred, self.succ), cand

    @staticmethod
    def walk(scores: np.ndarray, cand: np.ndarray, temperature: float,
             rng: np.random.Generator | None) -> tuple[np.ndarray, np.ndarray | None]:
        """One sequence's path: tokens [S] and, when sampling, q [S, K] (the distribution each token was drawn from
        over that row's candidates). Greedy (temperature 0) takes the first maximum and returns q None."""
        slots, k = cand.shape
        idx, prev, qs = np.zeros(slots, dtype=np.int64), 0, []
        for e in range(slots):
            row = scores[e, prev]  # slot 0: every predecessor row is the anchor
            if temperature == 0.0:
                prev = int(np.argmax(row))
            else:
                q = softmax(row, temperature)
                prev = min(int(np.searchsorted(np.cumsum(q), rng.random() * q.sum(), side="right")), k - 1)
                qs.append(q)
            idx[e] = prev
        return cand[np.arange(slots), idx], (np.stack(qs) if qs else None)


class MarkovHead:
    def __init__(self, loader: WeightLoader, vocab: int, draft_vocab: int, rank: int):
        self.w1 = loader.get("markov_head.markov_w1.weight", (vocab, rank))  # W1 [V, r], indexed by target ids
        self.w2 = loader.get("markov_head.markov_w2.weight", (draft_vocab, rank))  # W2 [Vd, r]: r -> drafter vocab

    def walk(self, b: Backend, logits: Any, anchors: Any, by_slot: Any, seq_major: Any,
             to_target: Callable[[Any], Any]) -> Any:
        """Greedy left-to-right drafts, target ids int32 [n S] sequence-major, on the backend (no host copy: a CUDA
        graph can hold it); logits [n S, Vd] are the rows in sequence order, anchors int32 [n], by_slot and seq_major
        (HeadRows) the row of each (slot, sequence) and the way back from slot-major order."""
        prev, out = anchors, []
        for e in range(by_slot.shape[0]):
            bias = b.linear(b.embedding(prev, self.w1), self.w2, out_f32=True)  # [n, Vd] float32, as the logits
            prev = to_target(b.argmax(b.add(b.take_rows(logits, by_slot[e]), bias), nonfinite=0))  # always a token
            out.append(prev)
        return b.take_rows(b.cat(out, axis=0), seq_major)


class ConfidenceHead:
    def __init__(self, loader: WeightLoader, hidden: int, markov_rank: int):
        self.with_markov = markov_rank > 0
        self.proj = loader.get("confidence_head.proj.weight", (1, hidden + markov_rank))  # [1, H (+ r)], h first
        bias = loader.get("confidence_head.proj.bias", (1,))  # [1]
        self.bias = float(loader.backend.to_numpy(bias)[0])  # added on the host: the GEMM has one output column

    def __call__(self, b: Backend, h: Any, prev: np.ndarray, markov: MarkovHead | None) -> np.ndarray:
        """float64 [rows]: sigmoid of the head for each row h [rows, H], whose previous tokens are prev [rows]."""
        x = h
        if self.with_markov:
            x = b.cat([h, b.embedding(b.asarray(prev.astype(np.int32), "i32"), markov.w1)], axis=1)
        z = b.to_numpy(b.linear(x, self.proj, out_f32=True))[:, 0].astype(np.float64) + self.bias
        return 1.0 / (1.0 + np.exp(-z))
