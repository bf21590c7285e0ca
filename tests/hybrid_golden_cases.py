"""The tiny hybrid checkpoints and prompts of the transformers goldens (tests/data/hybrid_goldens.json): shared by
scripts/hybrid_goldens.py, which writes the goldens with transformers, and tests/test_hybrid_goldens.py, which
rebuilds the same checkpoints from the same seeds and compares cudflash's greedy tokens. No torch here."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cudflash.tiny_hybrid import HybridShape

GOLDENS = "hybrid_goldens.json"  # under tests/data/
MAX_NEW = 24


@dataclass(frozen=True)
class GoldenCase:
    name: str
    shape: HybridShape
    seed: int
    prompt_lens: tuple[int, ...] = (5, 64, 70, 150)  # within, at and past one GDN chunk (64), and past two

    def prompts(self) -> list[list[int]]:
        rng = np.random.default_rng(1000 + self.seed)
        top = self.shape.vocab_size - 4  # the conditional class's multimodal token ids sit above
        return [[int(t) for t in rng.integers(2, top, n)] for n in self.prompt_lens]


CASES = [
    GoldenCase("conditional-sharded", HybridShape(checkpoint_class="conditional", shards=2), seed=11),
    GoldenCase("causal-tied", HybridShape(checkpoint_class="causal", tie_word_embeddings=True, num_layers=6,
                                          embed_std=0.2, std=0.15,
                                          layer_types=["linear_attention", "full_attention", "linear_attention",
                                                       "linear_attention", "linear_attention", "full_attention"]),
               seed=12),
    GoldenCase("conditional-interval", HybridShape(checkpoint_class="conditional", num_layers=8,
                                                   linear_num_key_heads=1, linear_num_value_heads=3,
                                                   linear_key_head_dim=24, linear_value_head_dim=8),
               seed=13, prompt_lens=(3, 129)),
]
