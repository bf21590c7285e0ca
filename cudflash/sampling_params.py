"""Per-request sampling settings, validated on construction (vLLM's SamplingParams conventions where they fit)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from cudflash import validate
from cudflash.errors import RequestError

# Below this a temperature only rescales logits toward overflow (1 / 1e-310 is infinite) while sampling no
# differently from greedy; vLLM treats such temperatures as greedy, cudflash asks for 0 instead.
MIN_TEMPERATURE = 1e-5
SEED_MIN, SEED_MAX = -2**63, 2**64 - 1  # any seed a 64-bit signed or unsigned integer can hold


@dataclass(slots=True)
class SamplingParams:
    """`max_tokens` new tokens at most; `temperature` 0 is greedy; `top_k` 0 and `top_p` 1 are off; `seed` makes
    sampling reproducible (a negative seed is taken modulo 2**64); `stop` strings end the output and are not part
    of its text (one str or a list); `stop_token_ids` end it too and are part of it. None for `stop` or
    `stop_token_ids` means none."""

    max_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.max_tokens = validate.integer(self.max_tokens, "max_tokens", minimum=1, what="a positive integer")
        t = validate.real(self.temperature, "temperature", "a finite number >= 0")
        if t < 0 or 0 < t < MIN_TEMPERATURE:
            raise RequestError(f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {t}")
        self.temperature = t
        self.top_k = validate.integer(self.top_k, "top_k", minimum=0, what="an integer >= 0 (0 = off)")
        p = validate.real(self.top_p, "top_p", "a number in (0, 1]")
        if not 0.0 < p <= 1.0:
            raise RequestError(f"top_p must be a number in (0, 1], got {p}")
        self.top_p = p
        if self.seed is not None:
            self.seed = validate.integer(self.seed, "seed", SEED_MIN, SEED_MAX,
                                         what="an integer in [-2**63, 2**64) or None")
        self.ignore_eos = validate.boolean(self.ignore_eos, "ignore_eos")
        ids = self._list(self.stop_token_ids, "stop_token_ids", "a list of token ids")
        self.stop_token_ids = [validate.integer(t, f"stop_token_ids[{i}]", minimum=0, what="a token id (integer >= 0)")
                               for i, t in enumerate(ids)]
        stop = [self.stop] if isinstance(self.stop, str) else self._list(self.stop, "stop", "a string or a list of "
                                                                                            "strings")
        self.stop = [validate.text(s, f"stop[{i}]") for i, s in enumerate(stop)]
        empty = next((i for i, s in enumerate(self.stop) if not s), None)
        if empty is not None:
            raise RequestError(f"stop[{empty}] is empty: stop strings must be non-empty")

    @staticmethod
    def _list(value: object, name: str, what: str) -> list:
        return [] if value is None else validate.sequence(value, name, what)

    def copy(self) -> SamplingParams:
        """A validated copy: what a request keeps, so that changing the caller's object later changes nothing."""
        return dataclasses.replace(self)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def rng_seed(self) -> int | None:
        """The seed as numpy's generators take it: non-negative, the same 64-bit pattern for -1 and 2**64 - 1."""
        return None if self.seed is None else self.seed % 2**64
