"""One loader for every drafter checkpoint folder: :func:`load_drafter` tells the layouts apart by the names
of the folder's weights (read without the tensors, :func:`taps.drafters.checkpoint.weight_names`):

- an EAGLE-3 head (:func:`taps.drafters.eagle3.is_eagle3_state`: ``midlayer.*``, ``d2t``, ...):
  :meth:`Eagle3Drafter.from_pretrained`;
- an EAGLE-1/2 or HASS head (``fc.weight``): :meth:`EagleDrafter.from_pretrained`;
- any other folder with a ``config.json``: a Hugging Face causal LM, :meth:`ModelDrafter.from_pretrained`.

A ``model.`` prefix on the names (as some head exports write them) is ignored, as the heads' loaders
ignore it.
"""

from __future__ import annotations

import os
from typing import Optional

from torch import nn

from .base import Drafter
from .checkpoint import weight_names
from .eagle import EagleDrafter
from .eagle3 import Eagle3Drafter, is_eagle3_state
from .small_lm import ModelDrafter

__all__ = ["load_drafter", "checkpoint_kind"]


def checkpoint_kind(path: str) -> type:
    """The drafter class whose layout folder `path` holds (see the module docstring); FileNotFoundError
    without a config.json or weights."""
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise FileNotFoundError(f"no drafter in {path}: it has no config.json")
    names = {k[len("model."):] if k.startswith("model.") else k for k in weight_names(path)}
    if is_eagle3_state(names):
        return Eagle3Drafter
    if "fc.weight" in names:
        return EagleDrafter
    return ModelDrafter


def load_drafter(path, target: Optional[nn.Module] = None, **kwargs) -> Drafter:
    """The drafter saved in folder `path`, of the class its layout names (:func:`checkpoint_kind`), bound
    to `target` when given.

    Keyword arguments go to that class's ``from_pretrained``: ``dtype`` for the heads (default: the stored
    dtype); for a causal LM ``tokenizer`` and those of ``AutoModelForCausalLM.from_pretrained`` (``dtype``
    among them).
    """
    path = str(path)
    kind = checkpoint_kind(path)
    if kind is ModelDrafter:
        drafter = ModelDrafter.from_pretrained(path, **kwargs)
        if target is not None:
            drafter.bind(target)
        return drafter
    return kind.from_pretrained(path, target=target, **kwargs)
