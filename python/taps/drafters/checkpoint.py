"""Drafter checkpoint folders: the files the EAGLE-style heads read and write.

A head's folder holds ``config.json`` (Llama config fields plus the head's own, see each kind) and its
weights in ``model.safetensors`` or ``pytorch_model.bin`` (one file, unprefixed names; a ``model.``
prefix, as some exports write it, is dropped on reading). :func:`weight_names` lists the names of any
folder's weights without reading the tensors, sharded Hugging Face models included, so that
:func:`taps.drafters.load_drafter` can tell the layouts apart.

This module knows no drafter kind: :mod:`taps.drafters.eagle` and :mod:`taps.drafters.eagle3` read and
write through it.
"""

from __future__ import annotations

import json
import os
from typing import Dict, List, Tuple

import torch
from torch import Tensor

__all__ = ["WEIGHT_FILES", "load_weights", "weight_names", "read_checkpoint", "write_checkpoint",
           "config_from_dict"]

#: the weight files a head's folder may hold, in the order they are looked for
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
_SHARD_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")


def load_weights(path: str) -> Dict[str, Tensor]:
    """The state dict in folder `path` (the first of :data:`WEIGHT_FILES`; FileNotFoundError without one)."""
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.exists(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights ({' or '.join(WEIGHT_FILES)}) in {path}")


def weight_names(path: str) -> List[str]:
    """The names of the weights in folder `path` (one weight file, or a sharded model's index), without
    reading the tensors; FileNotFoundError when it holds none."""
    for name in _SHARD_INDEXES:
        file = os.path.join(path, name)
        if os.path.exists(file):
            with open(file) as f:
                return sorted(json.load(f)["weight_map"])
    for name in WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.exists(file):
            if name.endswith(".safetensors"):
                from safetensors import safe_open
                with safe_open(file, framework="pt") as f:
                    return sorted(f.keys())
            return sorted(torch.load(file, map_location="cpu", weights_only=True, mmap=True))
    raise FileNotFoundError(f"no weights ({' or '.join(WEIGHT_FILES + _SHARD_INDEXES)}) in {path}")


def read_checkpoint(path: str) -> Tuple[dict, Dict[str, Tensor]]:
    """(config.json as a dict, the weights with a ``model.`` prefix dropped) of a head's folder."""
    with open(os.path.join(path, "config.json")) as f:
        raw = json.load(f)
    state = load_weights(path)
    return raw, {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}


def write_checkpoint(path: str, config: dict, state: Dict[str, Tensor], safe_serialization: bool = True) -> None:
    """Write `config` as config.json and `state` (copied to the CPU) as model.safetensors (or
    pytorch_model.bin) into folder `path`, made when missing."""
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2, sort_keys=True, default=str)
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    if safe_serialization:
        from safetensors.torch import save_file
        save_file(state, os.path.join(path, "model.safetensors"))
    else:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))


def config_from_dict(d: dict):
    """A ``LlamaConfig`` of a head's config.json (the entries that name the architecture or dtype dropped)."""
    from transformers import LlamaConfig
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version",
                                                    "torch_dtype", "dtype")}
    return LlamaConfig(**d)
