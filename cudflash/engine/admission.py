"""What a request must satisfy before it is queued. Everything a step could trip over is checked here, so a
request that is admitted never raises inside a step: its prompt is token ids inside the vocabulary, its
sampling parameters are validated, its stop ids are inside the vocabulary, and it fits the model's positions
(and, once the KV pool exists, the pool).

Usable without the weights (the CLI checks every line of a prompts file against the config and tokenizer
before the model loads).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from cudflash import validate
from cudflash.config import TargetConfig
from cudflash.engine.block_manager import BlockManager
from cudflash.errors import RequestError
from cudflash.sampling_params import SamplingParams
from cudflash.tokenizer import Tokenizer


def is_token_ids(prompt: Any) -> bool:
    """Whether `prompt` reads as ONE prompt of token ids: a non-empty list / tuple of integers, or a 1-D integer
    array (a list of prompts holds strs or lists, never bare integers)."""
    if isinstance(prompt, np.ndarray):
        return prompt.ndim == 1 and prompt.dtype.kind in "iu"
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(validate.is_integer(t) for t in prompt)


class Admission:
    def __init__(self, cfg: TargetConfig, tokenizer: Tokenizer | None, block_size: int = 1,
                 blocks: BlockManager | None = None, max_model_len: int | None = None):
        self.cfg, self.tokenizer, self.block_size, self.blocks = cfg, tokenizer, block_size, blocks
        self.max_model_len = max_model_len or cfg.max_position_embeddings  # the longest prompt + output served

    def prompt_ids(self, prompt: Any, name: str = "prompt") -> list[int]:
        """The prompt as token ids: text through the tokenizer, or integers checked one by one."""
        vocab = self.cfg.vocab_size
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError(
                    f"{name}: text given but no tokenizer is available for {self.cfg.path} "
                    "(needs tokenizer.json and `pip install tokenizers`); pass token ids instead"
                )
            ids = self.tokenizer.encode(validate.text(prompt, name))
            bad = next((i for i in ids if not 0 <= i < vocab), None)
            if bad is not None:
                raise RequestError(f"{name}: the tokenizer gave token id {bad}, outside the model's vocabulary "
                                   f"(0..{vocab - 1}): tokenizer.json does not match config.json")
        elif isinstance(prompt, np.ndarray) and prompt.ndim == 1 and prompt.dtype.kind in "iu":
            ids = prompt.tolist()
        elif isinstance(prompt, (list, tuple)):
            ids = [validate.integer(t, f"{name}[{i}]", what="a token id (an integer)") for i, t in enumerate(prompt)]
        else:
            raise RequestError(f"{name} must be a str or a list of token ids, got {validate.describe(prompt)}")
        if not ids:
            raise RequestError(f"{name}: empty prompt")
        bad = next((j for j, i in enumerate(ids) if not 0 <= i < vocab), None)
        if bad is not None:
            raise RequestError(f"{name}: token id {validate.describe(ids[bad])} outside the vocabulary "
                               f"(0..{vocab - 1}) at index {bad}")
        return ids

    def params(self, params: Any, name: str = "params") -> SamplingParams:
        """A validated copy of the request's SamplingParams (the default ones for None), checked against the model."""
        if params is None:
            params = SamplingParams()
        elif not isinstance(params, SamplingParams):
            raise RequestError(f"{name} must be a SamplingParams, got {validate.describe(params)}")
        params = params.copy()  # re-validates: the caller may have changed a field since construction
        vocab = self.cfg.vocab_size
        bad = next((t for t in params.stop_token_ids if t >= vocab), None)
        if bad is not None:
            raise RequestError(f"{name}: stop_token_ids: token id {validate.describe(bad)} outside the "
                               f"vocabulary (0..{vocab - 1})")
        if params.stop and self.tokenizer is None:
            raise RequestError(f"{name}: stop strings need a tokenizer (tokenizer.json and `pip install "
                               "tokenizers`)")
        return params

    def check_fits(self, ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        limit = self.max_model_len
        if len(ids) + params.max_tokens > limit:
            what = "the model's max_position_embeddings" if limit == self.cfg.max_position_embeddings \
                else "max_model_len"
            raise RequestError(
                f"{name}: prompt ({len(ids)} tokens) + max_tokens ({validate.describe(params.max_tokens)}) exceeds "
                f"{what} ({limit})"
            )
        if self.blocks is None:
            return
        worst = len(ids) + params.max_tokens + self.block_size + 1
        if self.blocks.blocks_for(worst) > self.blocks.num_blocks:
            raise RequestError(f"{name}: request of {len(ids)} + {params.max_tokens} tokens can never fit the KV "
                               f"pool ({self.blocks.num_blocks} blocks of {self.blocks.block_size})")

    def admit(self, prompt: Any, params: Any, prompt_name: str = "prompt",
              params_name: str = "params") -> tuple[list[int], SamplingParams]:
        ids, params = self.prompt_ids(prompt, prompt_name), self.params(params, params_name)
        self.check_fits(ids, params, prompt_name)
        return ids, params
