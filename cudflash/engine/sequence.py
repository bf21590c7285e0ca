from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto

import numpy as np

from cudflash.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


@dataclass(eq=False)
class Sequence:
    """One request. KV bookkeeping invariant (target and drafter caches share the block table):

    | positions               | target KV            | drafter context K/V |
    |-------------------------|----------------------|---------------------|
    | 0 .. num_cached-1       | valid                | valid               |
    | num_cached (= last tok) | not yet computed     | not yet computed    |
    | beyond                  | scratch (lookahead)  | scratch (block K/V) |

    After prefill and after every step, `num_cached == len(token_ids) - 1`: the last token (the target's
    bonus / first sampled token) is pending; the next step feeds it at position num_cached.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    acceptance_lengths: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    rng: np.random.Generator = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = np.random.default_rng(self.params.seed)

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def last_token(self) -> int:
        return self.output_ids[-1] if self.output_ids else self.prompt_ids[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED
