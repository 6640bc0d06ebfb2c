"""The target's forward passes in the decoding loop: prefill, the tree-verification forward, logits.

:class:`TargetForward` runs them on the lean path (:mod:`taps.lean`: the model's own weights, a minimum
of operations, tree attention through ``taps_ops.tree_attention``) when the architecture allows
(:func:`taps.lean.lean_support`), else through the Hugging Face module with the ``"taps"`` attention
(:mod:`taps.hf`). Both read and write the same :class:`taps.hf.TreeKVCache` with the same layout, so a
cache filled by one can be continued by the other, and both give the same logits up to float rounding
(tests/test_lean.py).

The caller keeps the longest committed length on the host (``longest``), so no forward needs a device
sync to size its masks.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor, nn

import taps_ops

from . import hf
from .lean import LeanCausalLM, cache_attend, causal_append, lean_support

__all__ = ["TargetForward"]


class TargetForward:
    """Forward passes of a target causal LM for the decoding loop.

    Args:
        model: the target (switched to the ``"taps"`` attention for the Hugging Face path).
        lean: True: require the lean path (ValueError when the architecture is not covered); False: always
            the Hugging Face path; None (default): lean when covered.
    """

    def __init__(self, model: nn.Module, lean: Optional[bool] = None):
        self.model = model
        why = lean_support(model)
        if lean and why is not None:
            raise ValueError(f"TargetForward: the lean path does not cover this model: {why}")
        self.lean: Optional[LeanCausalLM] = LeanCausalLM(model) if (lean is not False and why is None) else None
        self.head = model.get_output_embeddings()

    def new_cache(self, batch: int, max_len: int) -> hf.TreeKVCache:
        """A cache of `max_len` positions per request."""
        cache = hf.TreeKVCache.for_model(self.model, batch, max_len)
        if self.lean is not None:
            self.lean.rope.ensure(max_len, cache.lengths.device)
        return cache

    def prefill(self, cache: hf.TreeKVCache, input_ids: Tensor, num_new: Tensor, longest: int,
                return_hidden: bool = False) -> hf.ForwardOutput:
        """Append right-padded input_ids [B, T] (num_new [B] real tokens per row; ``longest`` =
        max(cache.lengths) on the host). Returns the logits after each row's last real token [B, V] and,
        when asked, the final hidden states [B, T, H]; cache.lengths advances by num_new."""
        if self.lean is None:
            return hf.prefill(self.model, cache, input_ids, num_new, return_hidden=return_hidden)
        batch, num = input_ids.shape
        if longest + num > cache.max_len:
            raise ValueError(f"TargetForward.prefill: {longest + num} positions needed, the cache holds {cache.max_len}")
        positions, mask = causal_append(cache.lengths, longest, num)
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        hidden = self.lean.hidden(input_ids.clamp_min(0), positions,
                                  cache_attend(kv, self.lean.layers, mask, positions=positions)).view(batch, num, -1)
        cache.lengths.add_(num_new)
        last = hidden[torch.arange(batch, device=hidden.device), (num_new - 1).clamp_min(0)]
        return hf.ForwardOutput(self.head(last), hidden if return_hidden else None)

    def tree(self, cache: hf.TreeKVCache, tokens: Tensor, tree_mask: Tensor, depth: Tensor, longest: int) -> Tensor:
        """The verification forward over trees [B, N] (node i of request b written at cache position
        lengths[b] + i, rotary position lengths[b] + depth[b, i]; ``longest`` = max(cache.lengths) on the
        host). Returns the final hidden states [B, N, H]; cache.lengths is unchanged."""
        batch, num = tokens.shape
        if longest + num > cache.max_len:
            raise ValueError(f"TargetForward.tree: {longest + num} positions needed, the cache holds {cache.max_len}")
        if self.lean is None:
            return hf.tree_verify_forward(self.model, cache, tokens, tree_mask, depth, compute_logits=False).hidden_states
        prefix = cache.lengths
        positions = prefix.unsqueeze(1) + depth.clamp_min(0)
        write = prefix.unsqueeze(1) + torch.arange(num, device=prefix.device)
        kv_lens = prefix + num
        rows = torch.arange(batch, device=prefix.device).unsqueeze(1)
        layers = self.lean.layers

        def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
            layer = cache.layers[i]
            layer.keys[rows, :, write] = k
            layer.values[rows, :, write] = v
            return taps_ops.tree_attention(q.transpose(1, 2), layer.keys, layer.values, tree_mask, kv_lens,
                                           layers[i].scale, validate=False)

        return self.lean.hidden(tokens.clamp_min(0), positions, attend).view(batch, num, -1)

    def logits(self, hidden: Tensor) -> Tensor:
        """The lm_head over hidden [..., H]."""
        return self.head(hidden)
