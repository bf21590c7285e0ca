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

    def room(self, prompt_len: int) -> int:
        """The most new tokens a prompt of `prompt_len` tokens can ever get (<= 0: none): what max_model_len leaves
        and, once the KV pool exists, what the pool can hold beside the prompt. `check_fits` refuses exactly the
        requests asking for more, so a server's default max_tokens (the rest of the context) is `room`."""
        room = self.max_model_len - prompt_len
        if self.blocks is not None:
            # A sequence holds at most prompt + max_tokens + lookahead + 1 slots: its draft block (or tree) and
            # the pending token past its last committed token.
            room = min(room, self.blocks.num_blocks * self.blocks.block_size - prompt_len - self.block_size - 1)
        return room

    def check_fits(self, ids: list[int], params: SamplingParams, name: str = "prompt") -> None:
        n, wanted = len(ids), params.max_tokens
        room = self.room(n)
        if wanted <= room:
            return
        limit = self.max_model_len
        if n + wanted > limit:
            what = "the model's max_position_embeddings" if limit == self.cfg.max_position_embeddings \
                else "max_model_len"
            context = f"this model's maximum context length is {limit} tokens"
            if n >= limit:  # no max_tokens could help: say so rather than name a max_tokens the caller may not have set
                raise RequestError(f"{name}: prompt ({n} tokens) leaves no room for a new token within {what} "
                                   f"({limit}): {context}; shorten the prompt")
            raise RequestError(f"{name}: prompt ({n} tokens) + max_tokens ({validate.describe(wanted)}) exceeds "
                               f"{what} ({limit}): {context}, so max_tokens can be at most {limit - n}")
        pool = f"the KV pool ({self.blocks.num_blocks} blocks of {self.blocks.block_size})"
        if room < 1:
            raise RequestError(f"{name}: prompt of {n} tokens can never fit {pool}")
        raise RequestError(f"{name}: request of {n} + {wanted} tokens can never fit {pool}: max_tokens can be at "
                           f"most {room} for this prompt")

    def admit(self, prompt: Any, params: Any, prompt_name: str = "prompt",
              params_name: str = "params") -> tuple[list[int], SamplingParams]:
        ids, params = self.prompt_ids(prompt, prompt_name), self.params(params, params_name)
        self.check_fits(ids, params, prompt_name)
        return ids, params
