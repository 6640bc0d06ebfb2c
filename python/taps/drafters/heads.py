"""What the EAGLE-style feature heads share: the batched group's cache bookkeeping and the group key.

A feature head's committed entry t pairs token t + 1 with a feature of the target at position t (the
prompt shifted left by one, the root after each prompt's last token); its output at the last committed
entry is the *root feature*, read out as ``root_logits``. A draft node at depth 1 reads the root
feature, a deeper node its parent's output feature (``frontier``: the last expanded level's outputs).

:class:`FeatureHeadGroup` keeps that bookkeeping (per-layer caches ``kv [G * B, Hkv, S, D]``,
``root_feature [G * B, H]``, the appends, the expansion's frontier) for any head arithmetic; a kind
builds its weights (``fc``, ``layers``, ``embed_weight``, ``dtype``, ``rope``, ``token_map``) and
defines :meth:`FeatureHeadGroup.features`, :meth:`FeatureHeadGroup._logits` and
:meth:`FeatureHeadGroup._node_features` (EAGLE-1/2 and HASS: :mod:`taps.drafters.eagle`; EAGLE-3:
:mod:`taps.drafters.eagle3`). :func:`head_key` is what two heads must share to run in one group.
"""

from __future__ import annotations

import json
from typing import Optional

import torch
from torch import Tensor, nn

from ..kv import cache_attend
from .base import DraftGroup

__all__ = ["FeatureHeadGroup", "head_key"]


class FeatureHeadGroup(DraftGroup):
    """EAGLE-style heads of one kind and shape, bound to one target, run as one batched forward (see the
    module docstring)."""

    needs_hidden = True
    lean_attention = True

    def __init__(self, drafters):
        super().__init__(drafters)
        self.root_feature: Optional[Tensor] = None
        self.frontier: Optional[Tensor] = None

    def features(self, tokens: Tensor, hidden: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """[G * B, T, H] output features of committed entries: tokens [G * B, T] with the target's features
        at the positions before them [G * B, T, H'], rows group-major."""
        raise NotImplementedError

    def _logits(self, feature: Tensor) -> Tensor:
        """Draft-vocabulary logits [..., V'] of output features [..., H]."""
        raise NotImplementedError

    def _node_features(self, tokens: Tensor, feats: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """Output features of draft nodes, which read their parent's output feature `feats`."""
        raise NotImplementedError

    def _append(self, tokens: Tensor, hidden: Tensor, num_new: Tensor, num_new_host) -> None:
        positions, attend = self._append_attend(self.layers, tokens.shape[1])
        out = self.features(self._rows(tokens), self._rows(hidden), positions, attend)
        self.root_feature = self._last(out, num_new, num_new_host)
        self.root_logits = self._logits(self.root_feature)
        self._commit(num_new, num_new_host)

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        if hidden is None:
            raise ValueError("EagleDrafter.start: needs the target's hidden states")
        batch, longest = input_ids.shape
        device = self.fc.weight.device
        first = self.layers[0]
        shape = (self.groups * batch, first.kv_heads, max_len, first.head_dim)
        self.kv = [[torch.zeros(shape, dtype=self.dtype, device=device),
                    torch.zeros(shape, dtype=self.dtype, device=device)] for _ in self.layers]
        self.rope.ensure(max_len, device)
        self.lengths_b = torch.zeros(batch, dtype=torch.int64, device=device)
        self.host_lengths = [0] * batch
        lens = prompt_lens.to(device)
        # Pair h_t with token t + 1: the prompt shifted left, the root after each prompt's last token.
        shifted = torch.zeros((batch, longest), dtype=torch.int64, device=device)
        shifted[:, :longest - 1] = input_ids[:, 1:].clamp_min(0)
        shifted[torch.arange(batch, device=device), lens - 1] = root.to(device)
        self._append(shifted, hidden, lens, prompt_lens_host)

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        if hidden is None:
            raise ValueError("EagleDrafter.advance: needs the target's hidden states")
        self._append(tokens.clamp_min(0), hidden, num_new, num_new_host)

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        if level == 1:
            feats = self.root_feature.unsqueeze(1).expand(-1, tokens.shape[1], -1)
        else:
            prev = self.frontier
            feats = prev.gather(1, parent_slot.unsqueeze(-1).expand(-1, -1, prev.shape[-1]))
        out = self._node_features(tokens, feats, self._node_positions(rope_pos, level),
                                  cache_attend(self.kv, self.layers, mask, start=write_start))
        self.frontier = out
        return self._logits(out)

    #: (the frontier is scratch of one draft(), written at level 1 before it is read)
    _row_state = ("root_logits", "root_feature")

    def release(self) -> None:
        super().release()
        self.kv = []
        self.root_feature = self.frontier = None

    def _share_tables(self, other) -> None:
        self.rope = other.rope

    def _ensure_rope(self, length: int) -> None:
        self.rope.ensure(length, self.lengths_b.device)


def head_key(head: nn.Module) -> tuple:
    """What an EAGLE-style head (``fc``, ``config``, ``draft_vocab``, bound to a target) must share with
    another to run in one batched group: parameter names and shapes, dtype, device, the target embedding
    it reads, rotary settings, norm epsilon and draft vocabulary."""
    p = head.fc.weight
    shapes = tuple((k, tuple(v.shape)) for k, v in head.state_dict().items())
    cfg = head.config
    rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": getattr(cfg, "rope_theta", None),
                                                      "rope_scaling": getattr(cfg, "rope_scaling", None)}
    vocab = None if head.draft_vocab is None else tuple(head.draft_vocab.tolist())
    return (shapes, p.dtype, p.device, id(head.embedding_weight()), json.dumps(rope, sort_keys=True, default=str),
            float(getattr(cfg, "rms_norm_eps", 1e-6)), vocab)
