"""Checkpoint averaging: the weight-space mean of drafters of one kind and shape (the baseline that
combining drafters at inference time beats; see :mod:`taps.strategies`)."""

from __future__ import annotations

from typing import Optional, Sequence

import torch

from .base import Drafter

__all__ = ["average_drafters"]


def average_drafters(drafters: Sequence[Drafter], weights: Optional[Sequence[float]] = None) -> Drafter:
    """Weight-space (checkpoint) average of drafters of the same kind and shapes: a new drafter.

    Args:
        drafters: two or more drafters of one class with identical parameter names and shapes.
        weights: optional mixing weights (normalised to sum 1); default the plain mean.
    Returns:
        a new drafter (a clone of the first) holding ``sum_i w_i * params_i``.
    """
    drafters = list(drafters)
    if not drafters:
        raise ValueError("average_drafters: no drafters given")
    first = drafters[0]
    kinds = {type(d).__name__ for d in drafters}
    if len(kinds) > 1:
        raise ValueError(f"average_drafters: drafters of different kinds {sorted(kinds)} cannot be averaged")
    states = [d.state_dict() for d in drafters]
    for i, s in enumerate(states[1:], 1):
        if set(s) != set(states[0]):
            raise ValueError(f"average_drafters: drafter {i} has different parameters than drafter 0")
        for k, v in s.items():
            if v.shape != states[0][k].shape:
                raise ValueError(f"average_drafters: drafter {i} parameter {k} has shape {tuple(v.shape)}, "
                                 f"drafter 0 {tuple(states[0][k].shape)}")
            if not v.is_floating_point() and not torch.equal(v, states[0][k]):
                raise ValueError(f"average_drafters: drafter {i} has another {k} than drafter 0 (integer "
                                 "state such as a draft vocabulary map must be equal)")
    if weights is None:
        weights = [1.0] * len(drafters)
    if len(weights) != len(drafters):
        raise ValueError("average_drafters: one weight per drafter")
    total = float(sum(weights))
    mixed = {}
    for k, v in states[0].items():
        if v.is_floating_point():
            acc = sum(float(w) / total * s[k].double() for w, s in zip(weights, states))
            mixed[k] = acc.to(v.dtype)
        else:
            mixed[k] = v
    out = first.clone()
    out.load_state_dict(mixed)
    return out
