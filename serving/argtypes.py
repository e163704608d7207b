"""argparse value types shared by the command-line tools (agent, recorder, simulator, demo)."""

from __future__ import annotations

import argparse
import math


def positive_float(text: str) -> float:
    """A finite number > 0."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (v > 0 and math.isfinite(v)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text!r}")
    return v


def positive_int(text: str) -> int:
    """An integer >= 1."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return v


def non_negative_int(text: str) -> int:
    """An integer >= 0 (seeds, offsets)."""
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {text!r}")
    return v
