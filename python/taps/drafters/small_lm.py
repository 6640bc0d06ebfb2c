"""Small language models as drafters: an independent causal LM that shares the target's tokenizer.

:class:`ModelDrafter` wraps any Hugging Face causal LM; its committed entry t is token t (the prompt, then
the root after it), and ``root_logits`` are the model's logits after the root. Models the lean path covers
(:func:`taps.lean.lean_support`: Llama, Mistral, Qwen2, Qwen3) run as :class:`_LeanLMGroup`, drafters of one
shape as one batched forward with per-layer caches ``kv [G * B, Hkv, S, D]``; any other causal LM runs on
its own as :class:`_HFLMGroup` through :mod:`taps.hf` and a :class:`taps.kv.TreeKVCache`.
"""

from __future__ import annotations

import copy
import json
from typing import Hashable, List, Optional, Sequence

import torch
from torch import Tensor, nn

from .. import hf
from ..kv import cache_attend
from ..lean import LeanCausalLM, lean_support
from .base import DraftGroup, Drafter, SoloMixin, head_rows, join_rows, target_vocab_size

__all__ = ["ModelDrafter"]


class ModelDrafter(SoloMixin, Drafter):
    """A small Hugging Face causal LM as a drafter (it must share the target's tokenizer).

    Args:
        model: a causal LM; switched to the ``"taps"`` attention. It may be the target itself (a perfect
            drafter, for tests). Llama, Mistral, Qwen2 and Qwen3 models run on the lean path
            (:mod:`taps.lean`; drafters of one shape as one batched forward), others through
            :mod:`taps.hf`.
        tokenizer: optional; when given, the decoder checks it against the target's.
    """

    def __init__(self, model: nn.Module, tokenizer=None):
        super().__init__()
        if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
            raise ValueError("ModelDrafter: the model must be a causal LM with an lm_head")
        self.model = hf.use_taps_attention(model.eval())
        self.tokenizer = tokenizer

    @classmethod
    def from_pretrained(cls, path: str, tokenizer=None, **kwargs) -> "ModelDrafter":
        """Load with ``AutoModelForCausalLM.from_pretrained(path, **kwargs)`` (and its tokenizer when
        `tokenizer` is True)."""
        from transformers import AutoModelForCausalLM, AutoTokenizer
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        if tokenizer is True:
            tokenizer = AutoTokenizer.from_pretrained(path)
        return cls(model, tokenizer)

    @property
    def vocab_size(self) -> int:
        return target_vocab_size(self.model)

    def bind(self, target: nn.Module) -> None:
        if self.vocab_size != target_vocab_size(target):
            raise ValueError(f"ModelDrafter: the drafter's vocabulary has {self.vocab_size} tokens, the "
                             f"target's {target_vocab_size(target)}; a drafter must share the target's tokenizer")
        param = next(target.parameters())
        self.model.to(device=param.device)

    def clone(self) -> "ModelDrafter":
        return ModelDrafter(copy.deepcopy(self.model), self.tokenizer)

    def group_key(self) -> Optional[Hashable]:
        if lean_support(self.model) is not None:
            return None
        cfg = self.model.config
        param = next(self.model.parameters())
        vocab = None if self.draft_vocab is None else tuple(self.draft_vocab.tolist())
        return ("lm", type(self.model).__name__, param.dtype, param.device, vocab,
                json.dumps(cfg.to_dict(), sort_keys=True, default=str))

    @classmethod
    def make_group(cls, drafters: Sequence["ModelDrafter"]) -> DraftGroup:
        if lean_support(drafters[0].model) is None:
            return _LeanLMGroup(drafters)
        if len(drafters) != 1:
            raise ValueError("ModelDrafter: only lean-path models run as a batched group")
        return _HFLMGroup(drafters[0])


class _LeanLMGroup(DraftGroup):
    """ModelDrafters of one lean-path shape run as one batched forward (:class:`taps.lean.LeanCausalLM`)."""

    lean_attention = True

    def __init__(self, drafters: Sequence[ModelDrafter]):
        super().__init__(drafters)
        self.lean = LeanCausalLM([d.model for d in drafters]).pack()
        vocab = drafters[0].draft_vocab
        if vocab is not None:
            if self.groups > 1:
                raise ValueError("ModelDrafter: a reduced draft vocabulary is supported for one drafter at a time")
            self.lean.head = head_rows(self.lean.head.weight, self.lean.head.bias, vocab).pack().choose_small_layout(
                stacked=False)
            self.token_map = vocab.to(self.lean.head.weight.device)

    def _run(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        hidden = self.lean.hidden(ids, positions, attend)                # [G, R * T, H]
        return self.lean.logits(hidden).view(ids.shape[0], ids.shape[1], -1)

    def _ensure_rope(self, length: int) -> None:
        self.lean.rope.ensure(length, self.lengths_b.device)

    def _append(self, ids: Tensor, num_new: Tensor, num_new_host) -> None:
        positions, attend = self._append_attend(self.lean.layers, ids.shape[1])
        logits = self._run(self._rows(ids), positions, attend)
        self.root_logits = self._last(logits, num_new, num_new_host)
        self._commit(num_new, num_new_host)

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        batch, longest = input_ids.shape
        param = self.lean.embed_weight
        device = param.device
        first = self.lean.layers[0]
        shape = (self.groups * batch, first.kv_heads, max_len, first.head_dim)
        self.kv = [[torch.zeros(shape, dtype=self.lean.dtype, device=device),
                    torch.zeros(shape, dtype=self.lean.dtype, device=device)] for _ in self.lean.layers]
        self.lean.rope.ensure(max_len, device)
        ids = torch.zeros((batch, longest + 1), dtype=torch.int64, device=device)
        ids[:, :longest] = input_ids.clamp_min(0)
        lens = prompt_lens.to(device)
        ids[torch.arange(batch, device=device), lens] = root.to(device)  # the root after each prompt
        self.lengths_b = torch.zeros(batch, dtype=torch.int64, device=device)
        self.host_lengths = [0] * batch
        host = prompt_lens_host if prompt_lens_host is not None else prompt_lens.tolist()
        self._append(ids, lens + 1, [int(n) + 1 for n in host])

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        self._append(tokens.clamp_min(0), num_new, num_new_host)

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        return self._run(tokens, self._node_positions(rope_pos, level),
                         cache_attend(self.kv, self.lean.layers, mask, start=write_start))

    def release(self) -> None:
        super().release()
        self.kv = []

    def _share_tables(self, other) -> None:
        self.lean.rope = other.lean.rope


class _HFLMGroup(DraftGroup):
    """One ModelDrafter whose architecture the lean path does not cover, run through :mod:`taps.hf`."""

    def __init__(self, drafter: ModelDrafter):
        super().__init__([drafter])
        if drafter.draft_vocab is not None:
            raise ValueError("ModelDrafter: a reduced draft vocabulary needs a lean-path architecture "
                             f"({lean_support(drafter.model)})")
        self.model = drafter.model
        self.cache: Optional[hf.TreeKVCache] = None

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        batch, longest = input_ids.shape
        device = next(self.model.parameters()).device
        self.cache = hf.TreeKVCache.for_model(self.model, batch, max_len)
        ids = torch.zeros((batch, longest + 1), dtype=torch.int64, device=device)
        ids[:, :longest] = input_ids.clamp_min(0)
        lens = prompt_lens.to(device)
        ids[torch.arange(batch, device=device), lens] = root.to(device)  # the root after each prompt
        self.root_logits = hf.prefill(self.model, self.cache, ids, lens + 1).logits
        self.lengths_b = self.cache.lengths
        self.host_lengths = self.lengths_b.tolist()

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        self.root_logits = hf.prefill(self.model, self.cache, tokens.clamp_min(0), num_new).logits
        self.host_lengths = self.lengths_b.tolist()

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        k = tokens.shape[1]
        write_pos = write_start + torch.arange(k, device=tokens.device).expand(tokens.shape[0], k)
        hidden = hf.masked_forward(self.model, self.cache, tokens, write_pos, rope_pos, mask)
        return self.model.get_output_embeddings()(hidden)

    def release(self) -> None:
        super().release()
        self.cache = None

    def _select_state(self, keep, index, rows):
        super()._select_state(keep, index, rows)
        self._set_cache([[layer.keys.index_select(0, index), layer.values.index_select(0, index)]
                         for layer in self.cache.layers], self.cache.max_len)

    def _join_state(self, other):
        super()._join_state(other)
        mine, theirs = self.cache, other.cache
        self._set_cache([[join_rows(a.keys, b.keys, 1), join_rows(a.values, b.values, 1)]
                         for a, b in zip(mine.layers, theirs.layers)], max(mine.max_len, theirs.max_len))

    def _set_cache(self, kv: List[List[Tensor]], max_len: int) -> None:
        """A new cache of capacity `max_len` holding `kv` (per layer [keys, values] [B, Hkv, S, D], S <=
        max_len) and lengths ``lengths_b``, which become its lengths (the Hugging Face path updates them in
        place)."""
        cache = hf.TreeKVCache.for_model(self.model, int(self.lengths_b.numel()), max_len)
        for layer, (keys, values) in zip(cache.layers, kv):
            layer.keys[:, :, :keys.shape[2]] = keys
            layer.values[:, :, :values.shape[2]] = values
        cache.lengths.copy_(self.lengths_b)
        self.cache, self.lengths_b = cache, cache.lengths
