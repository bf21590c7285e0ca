from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum, auto
from typing import NamedTuple

import numpy as np

from cudflash.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class StepMark(NamedTuple):
    """A sequence's request-level state before a step (Sequence.mark / restore)."""

    num_output: int
    num_steps: int
    text: str
    detok_offsets: tuple[int, int]
    text_visible: int
    rng_state: dict | None  # None for greedy requests: their steps draw nothing
    status: SequenceStatus
    finish_reason: str | None


@dataclass(eq=False)
class Sequence:
    """One request. KV bookkeeping invariant (target and drafter caches share the block table):

    | positions                | target KV           | drafter context K/V |
    |--------------------------|---------------------|---------------------|
    | 0 .. num_cached-1        | valid               | valid               |
    | num_cached .. (pending)  | not yet computed    | not yet computed    |
    | beyond the last token    | scratch (lookahead) | scratch (block K/V) |

    While decoding, `num_cached == num_tokens - 1`: the last token (the target's bonus / first sampled token)
    is pending and the next step feeds it at position num_cached. A sequence is prefilling while
    `num_cached < prefill_end` (after a preemption it recomputes its whole history, sampling nothing).
    Only blocks whose positions all lie below num_cached are ever hashed for prefix sharing.
    """

    seq_id: int
    prompt_ids: list[int]
    params: SamplingParams
    output_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    num_hashed_blocks: int = 0  # leading blocks of block_table registered in the prefix cache
    state_slot: int = -1  # hybrid targets: the GDN state slot (engine/state_pool.py) while admitted; -1: none
    acceptance_lengths: list[int] = field(default_factory=list)
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: str | None = None
    text: str = ""  # detokenised output so far (when a tokenizer is present)
    detok_offsets: tuple[int, int] = (0, 0)  # (window start, tokens already in `text`) for incremental decoding
    # Characters of `text` that outputs may show: all of it once finished, else all but the last (longest stop
    # string - 1), which could still turn out to start a stop string and be cut. Never decreases.
    text_visible: int = 0
    # What this request's own consumer (its stream) has been given: the outputs it has not yet been given are
    # output_ids[tokens_delivered:] and text[text_delivered:text_visible], whoever stepped the engine.
    tokens_delivered: int = 0
    text_delivered: int = 0
    end_delivered: bool = False
    rng: np.random.Generator = field(default=None)  # type: ignore[assignment]

    def __post_init__(self) -> None:
        if self.rng is None:
            self.rng = np.random.default_rng(self.params.rng_seed)

    def mark(self) -> StepMark:
        """The request-level state an engine step changes, to put back if the step fails (see `restore`)."""
        return StepMark(len(self.output_ids), len(self.acceptance_lengths), self.text, self.detok_offsets,
                        self.text_visible, None if self.params.greedy else self.rng.bit_generator.state,
                        self.status, self.finish_reason)

    def restore(self, mark: StepMark) -> None:
        """Undo what a failed step did to this request's tokens, text and random stream (its KV is dropped
        separately: the caller frees its blocks)."""
        del self.output_ids[mark.num_output:], self.acceptance_lengths[mark.num_steps:]
        self.text, self.detok_offsets, self.text_visible = mark.text, mark.detok_offsets, mark.text_visible
        self.status, self.finish_reason = mark.status, mark.finish_reason
        if mark.rng_state is not None:
            self.rng.bit_generator.state = mark.rng_state

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
    def prefill_end(self) -> int:
        """Positions that must hold KV before decoding: the prompt, or all but the pending token."""
        return self.num_tokens - 1 if self.output_ids else len(self.prompt_ids)

    @property
    def is_prefilling(self) -> bool:
        return self.num_cached < self.prefill_end

    @property
    def finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]
