"""Exact-type checks for values a user passes in (API arguments, CLI options, JSON fields).

Each check returns the value normalised to a plain Python type or raises RequestError naming the argument: no
float is truncated to an int, no bool counts as a number, no string as a number; numpy scalars are accepted
where their kind fits (an np.int64 token id, an np.float32 temperature).
"""
from __future__ import annotations

import math
import numbers
from typing import Any

import numpy as np

from cudflash.errors import RequestError


def describe(value: Any) -> str:
    """A short, safe rendering of a bad value for an error message (huge ints and long strings abbreviated)."""
    if isinstance(value, bool):
        return repr(value)
    if isinstance(value, numbers.Integral):
        v = int(value)
        return repr(v) if v.bit_length() <= 128 else f"an integer of {v.bit_length()} bits"
    if isinstance(value, str):
        text = value if len(value) <= 40 else value[:37] + "..."
        return ascii(text)  # ascii(): a lone surrogate prints as an escape, not as an unprintable character
    if isinstance(value, (int, float, complex, np.generic)) or value is None:
        return repr(value)
    if isinstance(value, np.ndarray):
        return f"a {value.ndim}-D array of {value.dtype}"
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"


def is_integer(value: Any) -> bool:
    """An int or numpy integer, never a bool (numpy's bool_ is not an Integral either)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, (bool, np.bool_))


def integer(value: Any, name: str, minimum: int | None = None, maximum: int | None = None,
            what: str = "an integer") -> int:
    """`value` as an int within [minimum, maximum] (either bound optional)."""
    if not is_integer(value):
        raise RequestError(f"{name} must be {what}, got {describe(value)}")
    v = int(value)
    if (minimum is not None and v < minimum) or (maximum is not None and v > maximum):
        raise RequestError(f"{name} must be {what}, got {describe(v)}")
    return v


def real(value: Any, name: str, what: str = "a finite number") -> float:
    """`value` as a finite float (ints accepted; bools, strings and NaN / infinity are not)."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise RequestError(f"{name} must be {what}, got {describe(value)}")
    try:
        v = float(value)
    except OverflowError:  # an int beyond the float range
        raise RequestError(f"{name} must be {what}, got {describe(value)}") from None
    if not math.isfinite(v):
        raise RequestError(f"{name} must be {what}, got {v}")
    return v


def boolean(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise RequestError(f"{name} must be true or false, got {describe(value)}")
    return bool(value)


def text(value: Any, name: str) -> str:
    """A str that UTF-8 can encode (a lone surrogate, e.g. from undecodable bytes, cannot be tokenized)."""
    if not isinstance(value, str):
        raise RequestError(f"{name} must be a string, got {describe(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{name} holds a lone surrogate {value[e.start]!a} at character {e.start}: not valid "
                           "Unicode text") from None
    return str(value)


def sequence(value: Any, name: str, what: str) -> list:
    """A list or tuple (not a str, dict or generator) as a new list."""
    if not isinstance(value, (list, tuple)):
        raise RequestError(f"{name} must be {what}, got {describe(value)}")
    return list(value)
