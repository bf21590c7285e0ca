"""Goodness of fit without scipy: Pearson's chi-square with the Wilson-Hilferty approximation of its tail."""
from __future__ import annotations

import math

import numpy as np

from cudflash.engine.sampler import sample, target_probs


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
