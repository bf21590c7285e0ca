"""How a drafter checkpoint is laid out beyond the DFlash backbone, and the guarantee that nothing in it is dropped.

- Names may carry a `model.` prefix (vLLM-style exports); `lm_head.weight` may sit outside it.
- `embed_tokens.weight` / `lm_head.weight` are optional: DeepSpec ships copies of the target's; without them the
  drafter borrows the target's. A smaller drafter vocabulary (`draft_vocab_size`) needs its own `lm_head`
  [Vd, H] and `d2t` (or `draft_id_to_target_id`) [Vd]: offsets, target id = draft id + d2t[draft id] (the
  EAGLE-3 / speculators convention, as vLLM reads it). `t2d` (a training-time mask) is ignored.
- A head tensor the config does not declare, or any tensor nothing reads, is an error.
With `RandomWeights` (synthetic benchmarks) there is no file: optional tensors are absent and nothing is checked.
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cudflash.backends.base import Backend
from cudflash.draft_config import DraftConfig
from cudflash.errors import CheckpointError, ConfigError
from cudflash.models.weights import RandomWeights, WeightLoader

# Tensor-name fragments of optional heads, and the config field that must declare each.
_HEAD_TENSORS = {".attention_conv.": "conv_kernel_size", ".mlp_conv.": "conv_kernel_size",
                 "candidate_selector.": "selector_rank", "markov_head.": "markov_rank",
                 "confidence_head.": "enable_confidence_head", "d2t": "draft_vocab_size",
                 "draft_id_to_target_id": "draft_vocab_size"}
_IGNORED = ("t2d", "rotary_emb.inv_freq")  # training-only target->draft mask; a recomputed RoPE buffer


class _TrackingLoader(WeightLoader):
    """Records every tensor read, so that a tensor nothing reads is reported instead of silently dropped."""

    def __init__(self, base: WeightLoader, prefix: str, used: set[str]):
        super().__init__(base.ckpt, base.backend, prefix, base.progress, base.check_weights, base.quant, base.quantize)
        self.memory = base.memory  # one account for the drafter's weights
        self.used = used

    def read(self, name: str, shape: tuple[int, ...], quantize: bool | None = None) -> Any:
        self.used.add(self.prefix + name)
        return super().read(name, shape, quantize)


class DraftCheckpoint:
    def __init__(self, cfg: DraftConfig, loader: WeightLoader | RandomWeights, backend: Backend):
        self.cfg, self.backend, self.used = cfg, backend, set()
        self.real = isinstance(loader, WeightLoader)
        if self.real:
            ckpt = loader.ckpt
            prefix = "model." if "fc.weight" not in ckpt and "model.fc.weight" in ckpt else ""
            self.loader: WeightLoader | RandomWeights = _TrackingLoader(loader, prefix, self.used)
            self.top = _TrackingLoader(loader, "", self.used)  # names outside the prefix
            self._check_declared()
        else:
            self.loader = loader
        self.vocab = self._vocab()  # the target vocabulary as the drafter sees it (None: it borrows everything)

    def _check_declared(self) -> None:
        c = self.cfg
        declared = {"conv_kernel_size": c.conv_kernel_size, "selector_rank": c.selector_rank,
                    "markov_rank": c.markov_rank, "enable_confidence_head": c.confidence_head,
                    "draft_vocab_size": c.draft_vocab_size}
        for name in self.loader.ckpt.names:
            for key, field in _HEAD_TENSORS.items():
                if key in name and not declared[field]:
                    raise ConfigError(f"{c.path}: checkpoint has tensor '{name}' but config.json declares no "
                                      f"'{field}' (refusing to drop a head silently)")

    def _find(self, name: str) -> str | None:
        if not self.real:
            return None
        return next((n for n in (self.loader.prefix + name, name) if n in self.loader.ckpt), None)

    def _vocab(self) -> int | None:
        """From the config, else from the first vocabulary-indexed tensor the checkpoint has."""
        c = self.cfg
        if c.vocab_size is not None:
            return c.vocab_size
        names = ["embed_tokens.weight", "markov_head.markov_w1.weight", "candidate_selector.successor_codebook"]
        for name in names + (["lm_head.weight"] if c.draft_vocab_size is None else []):
            full = self._find(name)
            if full is not None:
                return self.loader.ckpt.info(full).shape[0]
        if c.draft_vocab_size is not None or c.markov_rank or c.selector_rank:
            raise ConfigError(f"{c.path}/config.json: missing field 'vocab_size'")
        return None

    def optional(self, name: str, shape: tuple[int, ...]) -> Any | None:
        """A tensor the checkpoint may or may not carry (under the prefix or at the top level)."""
        full = self._find(name)
        if full is None:
            return None
        return (self.loader if full != name or not self.loader.prefix else self.top).get(name, shape)

    def d2t(self, draft_vocab: int, vocab: int) -> np.ndarray:
        """int64 [Vd]: the target id of each drafter id."""
        if not self.real:
            return np.arange(draft_vocab, dtype=np.int64)
        name = next((n for n in (self._find("d2t"), self._find("draft_id_to_target_id")) if n), None)
        if name is None:
            raise CheckpointError(f"{self.cfg.path}: draft_vocab_size {draft_vocab} < vocab_size {vocab} needs a "
                                  "'d2t' (or 'draft_id_to_target_id') tensor")
        info = self.loader.ckpt.info(name)
        self.used.add(name)
        if info.dtype not in ("I64", "I32") or info.shape != (draft_vocab,):
            raise CheckpointError(f"{info.file}: tensor '{name}' should be an integer [{draft_vocab}], got "
                                  f"{info.dtype} {list(info.shape)}")
        target = np.arange(draft_vocab, dtype=np.int64) + self.loader.ckpt.array(name)
        if target.min() < 0 or target.max() >= vocab or len(np.unique(target)) != draft_vocab:
            raise CheckpointError(f"{info.file}: tensor '{name}' does not map drafter ids one-to-one onto target ids "
                                  f"0..{vocab - 1} (read as offsets: target id = draft id + d2t)")
        return target

    def finish(self) -> None:
        """Every tensor of the checkpoint was read (or is known to be unneeded)."""
        if not self.real:
            return
        unused = [n for n in self.loader.ckpt.names if n not in self.used and not n.endswith(_IGNORED)]
        if unused:
            more = f" and {len(unused) - 3} more" if len(unused) > 3 else ""
            raise ConfigError(f"{self.cfg.path}: checkpoint tensors this {self.cfg.kind} drafter would not use: "
                              f"{', '.join(unused[:3])}{more} (refusing to drop them silently)")
