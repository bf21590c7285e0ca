"""Goodness of fit without scipy: Pearson's chi-square with the Wilson-Hilferty approximation of its tail; and the
small model the sampling tests share, with the exact distribution of its first generated tokens."""
from __future__ import annotations

import itertools
import math

import numpy as np

from cudflash.engine.sampler import sample, target_probs
from cudflash.tiny import TinyShape

# A tiny random target with 16 tokens: the exact marginals of its first three tokens are cheap to enumerate.
VOCAB, PROMPT = 16, [3, 7, 2, 9, 4]


def small_shape(block: int) -> TinyShape:
    return TinyShape(vocab_size=VOCAB, hidden_size=32, num_layers=2, intermediate_size=64, target_layer_ids=[0, 1],
                     block_size=block, mask_token_id=15, eos_token_id=0)


def exact_first_tokens(llm, params) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact marginals of the 1st, 2nd and 3rd tokens generated after PROMPT under the target with these params."""
    from tests.conftest import last_logits

    p1 = target_probs(last_logits(llm, PROMPT), params)
    p2_given = np.stack([target_probs(last_logits(llm, PROMPT + [a]), params) for a in range(VOCAB)])
    p3_given = {(a, b): target_probs(last_logits(llm, PROMPT + [a, b]), params)
                for a, b in itertools.product(range(VOCAB), repeat=2) if p1[a] * p2_given[a, b] > 1e-9}
    p2 = p1 @ p2_given
    p3 = sum(p1[a] * p2_given[a, b] * p for (a, b), p in p3_given.items())
    return p1, p2, p3


def first_token_pvalues(tokens: np.ndarray, exact) -> list[float]:
    """tokens [runs, 3] against exact_first_tokens: one p-value per position."""
    return [chi_square_pvalue(np.bincount(tokens[:, i], minlength=VOCAB), exact[i]) for i in range(3)]


def chi_square_pvalue(observed: np.ndarray, expected_probs: np.ndarray, min_expected: float = 5.0) -> float:
    """p-value that `observed` counts come from `expected_probs`; cells expected below min_expected are pooled."""
    observed = np.asarray(observed, dtype=np.float64)
    n = observed.sum()
    expected = np.asarray(expected_probs, dtype=np.float64) * n
    small = expected < min_expected
    if small.any():
        observed = np.append(observed[~small], observed[small].sum())
        expected = np.append(expected[~small], expected[small].sum())
        if expected[-1] == 0:
            if observed[-1] > 0:
                return 0.0  # mass where the target puts none
            observed, expected = observed[:-1], expected[:-1]
    stat = float(((observed - expected) ** 2 / expected).sum())
    k = len(expected) - 1
    if k <= 0:
        return 1.0
    z = ((stat / k) ** (1 / 3) - (1 - 2 / (9 * k))) / math.sqrt(2 / (9 * k))
    return 0.5 * math.erfc(z / math.sqrt(2))


def wrong_rejection_sample(rows, drafts, q, params, rng) -> list[int]:
    """A deliberately wrong acceptance rule for the tests to catch: accept with min(1, p/q) as it should, but
    after a rejection resample from p instead of the residual max(p - q, 0), which over-weights drafts."""
    out = []
    for j, d in enumerate(drafts):
        p = target_probs(rows[j], params)
        q_d = 1.0 if q is None else float(q[j][d])
        if rng.random() * q_d < p[d]:
            out.append(int(d))
            continue
        out.append(sample(p, rng))
        return out
    out.append(sample(target_probs(rows[len(drafts)], params), rng))
    return out
