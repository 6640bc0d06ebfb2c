"""Drafters: models that propose a tree of candidate tokens for the target to verify.

Every drafter has the same small interface (:class:`Drafter`) and keeps its own KV cache of the
committed context. A drafter used on its own is driven as follows (B requests, ragged)::

    drafter.bind(target)                                  # checks + moves to the target's device/dtype
    drafter.start(prompt_ids, prompt_lens, root, hidden, max_len)   # after the target's prefill
    cand = drafter.draft(depth, top_k)                    # EAGLE-2 expansion (taps.expansion)
    ...  target verification ...
    drafter.advance(new_tokens, num_new, hidden)          # accepted drafts + bonus (the next root)

Cache convention: ``drafter.lengths[b]`` entries are committed, and the last of them is the current
root (the last token the target committed or sampled, which the target itself has not cached yet).
``drafter.root_logits [B, V]`` is the drafter's prediction after the root: the depth-1 candidates.

Drafter groups. The decoding loop runs drafters through *groups* (:meth:`Drafter.make_group`): the
drafters of one kind and shape (same :meth:`Drafter.group_key`) become one :class:`DraftGroup` that runs
them as one batched forward (their weights stacked, see :mod:`taps.lean`), with rows group-major (row
g * B + b is request b of drafter g). A drafter used on its own runs through a group of one, so both
paths are the same code. Drafter subclasses written elsewhere that only implement the interface above
run through :class:`_InterfaceGroup`, one at a time.

- :class:`ModelDrafter`: an independent small Hugging Face causal LM sharing the target's tokenizer;
  its entry t is token t.
- :class:`EagleDrafter`: the EAGLE-1/2 feature head. Entry t pairs the target's final hidden state at
  position t with token t + 1: ``fc([embed(token_{t+1}), h_t])`` -> Llama decoder layer(s) -> a predicted
  feature, read out by the target's lm_head. Checkpoints in the public EAGLE / HASS layout
  (``config.json`` + ``pytorch_model.bin`` or ``model.safetensors`` with ``fc.*`` and ``layers.0.*``
  weights) load unchanged with :meth:`EagleDrafter.from_pretrained`.

Reduced draft vocabulary. :meth:`Drafter.set_draft_vocab` restricts what a drafter may propose to a
subset of the target's vocabulary (for example its most frequent tokens, :mod:`taps.vocab`): the head
then computes logits for those rows only, which is most of a small drafter's cost. The trees still
hold target token ids; verification is unchanged, so decoding stays lossless.
"""

from __future__ import annotations

import copy
import json
import os
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import hf
from .expansion import DraftCandidates, expand
from .kv import NodeMask, cache_attend, causal_append, causal_bits
from .lean import LayerWeights, LeanCausalLM, Linear, Positions, RopeTable, as_dtype, decoder_layer, lean_support

__all__ = ["DraftCandidates", "Drafter", "DraftGroup", "ModelDrafter", "EagleDrafter", "average_drafters",
           "make_groups", "target_vocab_size", "target_hidden_size"]


def target_vocab_size(model: nn.Module) -> int:
    """Rows of the model's lm_head (the logits width)."""
    return int(model.get_output_embeddings().weight.shape[0])


def target_hidden_size(model: nn.Module) -> int:
    """Width of the model's final hidden states (the lm_head input)."""
    return int(model.get_output_embeddings().weight.shape[1])


class Drafter(nn.Module):
    """Base class of drafters (see the module docstring for the call sequence).

    Subclasses implement :meth:`bind`, :meth:`start`, :meth:`advance`, :meth:`forward_nodes` and
    :meth:`clone` (or, for batched execution, :meth:`group_key` and :meth:`make_group`); :meth:`draft`
    (the EAGLE-2 expansion) is shared.
    """

    #: True for feature drafters that consume the target's hidden states.
    needs_hidden: bool = False

    def __init__(self) -> None:
        super().__init__()
        self.tokenizer = None
        self._lengths: Optional[Tensor] = None
        self._root_logits: Optional[Tensor] = None
        self.draft_vocab: Optional[Tensor] = None

    # -- properties the expansion reads ----------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        raise NotImplementedError

    @property
    def lengths(self) -> Tensor:
        """[B] int64 committed cache entries per request (the root included)."""
        if self._lengths is None:
            raise RuntimeError(f"{type(self).__name__}: call start() first")
        return self._lengths

    @property
    def root_logits(self) -> Tensor:
        """[B, V'] the drafter's logits for the token after the current root (V' = the draft vocabulary)."""
        if self._root_logits is None:
            raise RuntimeError(f"{type(self).__name__}: call start() first")
        return self._root_logits

    @property
    def token_map(self) -> Optional[Tensor]:
        """None, or [V'] int64: the target id of each draft-vocabulary entry (see :meth:`set_draft_vocab`)."""
        return self.draft_vocab

    @property
    def target_features(self):
        """What the drafter reads of the target's hidden states (the ``hidden`` argument of
        :meth:`start` / :meth:`advance`): None (nothing), ``"final"`` (the final normalised hidden states
        [B, T, H], the lm_head input; EAGLE-1/2 and HASS heads) or a tuple of decoder layer indices (the
        inputs of those layers concatenated, [B, T, len * H]; EAGLE-3 heads)."""
        return "final" if self.needs_hidden else None

    @property
    def scratch_start(self) -> int:
        """Cache column where the expansion writes its scratch entries (>= every request's length)."""
        return int(self.lengths.max())

    # -- the interface ---------------------------------------------------------------------------
    def bind(self, target: nn.Module) -> None:
        """Check compatibility with `target` (raises ValueError) and move to its device and dtype."""
        raise NotImplementedError

    def start(self, input_ids: Tensor, prompt_lens: Tensor, root: Tensor, hidden: Optional[Tensor],
              max_len: int) -> None:
        """Allocate the cache and consume the prompts.

        Args:
            input_ids: [B, T] int64 right-padded prompts (padding ignored).
            prompt_lens: [B] int64 real tokens per row (>= 1).
            root: [B] int64 the first token the target produced after each prompt.
            hidden: [B, T, H] target final hidden states over the prompts (feature drafters), or None.
            max_len: cache positions per request (committed context plus scratch for the expansion).
        """
        raise NotImplementedError

    def advance(self, tokens: Tensor, num_new: Tensor, hidden: Optional[Tensor]) -> None:
        """Commit one verification step.

        Args:
            tokens: [B, K] int64: the accepted draft tokens then the bonus token (the next root),
                padded; num_new[b] of row b are real.
            num_new: [B] int64 accepted + 1 (>= 1).
            hidden: [B, K, H] the target's hidden states at the previous root and the accepted nodes
                (row b: root, a_1 .. a_A), or None.
        """
        raise NotImplementedError

    def forward_nodes(self, tokens: Tensor, parent_slot: Tensor, write_pos: Tensor, rope_pos: Tensor,
                      mask: Tensor, level: int) -> Tensor:
        """Run the drafter on one frontier of the expansion (scratch entries, not committed).

        Args:
            tokens: [B, K] int64 frontier tokens (nodes at depth `level`).
            parent_slot: [B, K] int64 index of each node's parent in the previous frontier (-1: the root).
            write_pos: [B, K] int64 cache positions to write (past ``lengths``), or an int: the first of
                K consecutive columns, the same for every request.
            rope_pos: [B, K] int64 rotary positions.
            mask: [B, 1, K, S] bool, keys visible to each node (its prefix and its scratch ancestors).
            level: depth of the frontier nodes (1-based).
        Returns:
            logits [B, K, V'].
        """
        raise NotImplementedError

    def clone(self) -> "Drafter":
        """An independent copy of the weights (bound to the same target)."""
        raise NotImplementedError

    def release(self) -> None:
        """Free the KV cache."""
        self._lengths = None
        self._root_logits = None

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        """EAGLE-2 candidates after the current root: see :func:`taps.expansion.expand`."""
        return expand(self, depth, top_k, profiler, with_entropy)

    # -- reduced draft vocabulary -------------------------------------------------------------------
    def set_draft_vocab(self, token_ids: Optional[Tensor]) -> "Drafter":
        """Propose only these target token ids (a 1-D int64 tensor of distinct ids; None: the whole
        vocabulary). Returns self."""
        if token_ids is not None:
            token_ids = torch.as_tensor(token_ids, dtype=torch.int64).flatten()
            vocab = self.vocab_size
            if token_ids.numel() == 0 or int(token_ids.min()) < 0 or int(token_ids.max()) >= vocab:
                raise ValueError(f"{type(self).__name__}.set_draft_vocab: ids must be in [0, {vocab}) and non-empty")
            if token_ids.unique().numel() != token_ids.numel():
                raise ValueError(f"{type(self).__name__}.set_draft_vocab: ids must be distinct")
        self.draft_vocab = token_ids
        return self

    # -- batched execution -------------------------------------------------------------------------
    def group_key(self) -> Optional[Hashable]:
        """Drafters with equal non-None keys can run as one batched group (:meth:`make_group`)."""
        return None

    @classmethod
    def make_group(cls, drafters: Sequence["Drafter"]) -> "DraftGroup":
        """A :class:`DraftGroup` running `drafters` (equal :meth:`group_key`) together."""
        if len(drafters) != 1:
            raise ValueError(f"{cls.__name__} drafters run one at a time")
        return _InterfaceGroup(drafters[0])


def make_groups(drafters: Sequence[Drafter]) -> List["DraftGroup"]:
    """Partition drafters into batched groups (equal :meth:`Drafter.group_key`, order of first
    appearance); each group's ``members`` lists the indices of its drafters in `drafters`."""
    buckets: Dict[Hashable, List[int]] = {}
    order: List[Hashable] = []
    for i, d in enumerate(drafters):
        key = d.group_key()
        key = ("solo", i) if key is None else key
        if key not in buckets:
            buckets[key] = []
            order.append(key)
        buckets[key].append(i)
    groups = []
    for key in order:
        idx = buckets[key]
        group = type(drafters[idx[0]]).make_group([drafters[i] for i in idx])
        group.members = idx
        groups.append(group)
    return groups


# ---------------------------------------------------------------------------------------------------
# Groups
# ---------------------------------------------------------------------------------------------------

class DraftGroup:
    """G drafters run together over B requests (rows group-major: row g * B + b).

    State shared by the group: every drafter commits the same tokens, so the per-request lengths are
    one [B] tensor (``lengths_b``) with a host copy (``host_lengths``; the decoding loop passes the
    accepted counts it already has on the host, so no step needs a device sync for them).
    ``sampling`` (set by the decoder for a generation) says whether verification samples (a temperature
    above 0), for drafters whose proposals suit greedy and sampled verification differently.
    """

    needs_hidden = False
    sampling = False
    #: attention runs through taps.kv.cache_attend, which takes taps.kv.NodeMask masks as well
    lean_attention = False
    #: appends of up to this many tokens per row attend through a causal NodeMask (tree_attention)
    node_mask_append_limit = 256

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        self.groups = len(self.drafters)
        self.target_features = self.drafters[0].target_features
        self.members: List[int] = list(range(self.groups))
        self.lengths_b: Optional[Tensor] = None
        self.host_lengths: List[int] = []
        self.root_logits: Optional[Tensor] = None
        self.token_map: Optional[Tensor] = None

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    @property
    def lengths(self) -> Tensor:
        """[G * B] committed entries per row."""
        return self.lengths_b.repeat(self.groups) if self.groups > 1 else self.lengths_b

    @property
    def scratch_start(self) -> int:
        return max(self.host_lengths)

    @property
    def node_masks(self) -> bool:
        """Whether :meth:`forward_nodes` takes the expansion's masks as :class:`taps.kv.NodeMask` (ancestor
        bits, one taps_ops.tree_attention call per layer instead of a dense bool mask and SDPA): lean groups
        whose requests all hold the same number of entries, so that the scratch entries follow every
        row's prefix with no gap."""
        return self.lean_attention and self._shared_length() is not None

    def _rows(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """[B, ...] -> [G * B, ...] (every drafter reads the same request data)."""
        if t is None or self.groups == 1:
            return t
        return t.repeat(self.groups, *([1] * (t.dim() - 1)))

    def _commit(self, num_new: Tensor, num_new_host: Optional[Sequence[int]]) -> None:
        if num_new_host is None:
            num_new_host = num_new.tolist()
        self.lengths_b += num_new
        self.host_lengths = [a + int(n) for a, n in zip(self.host_lengths, num_new_host)]

    def _append_attend(self, layers, num_tokens: int):
        """(positions [G * B, T], an ``attend`` over this group's caches) for appending T tokens to every
        row: each row's K/V go to its own positions, or, when every request holds the same number of
        entries (always at batch 1), to one column range of all rows (a plain copy, no scatter)."""
        longest = max(self.host_lengths)
        if self._shared_length() is not None:  # rotary rows as views, K/V as one column range
            if self.lean_attention and num_tokens <= self.node_mask_append_limit:  # causal bits, no dense mask
                rows, device = self.groups * self.batch, self.lengths_b.device
                mask = NodeMask(causal_bits(num_tokens, device).expand(rows, -1, -1),
                                torch.full((rows,), longest + num_tokens, dtype=torch.int64, device=device),
                                num_tokens)
            else:
                mask = self._rows(causal_append(self.lengths_b, longest, num_tokens)[1])
            return range(longest, longest + num_tokens), cache_attend(self.kv, layers, mask, start=longest)
        positions, mask = causal_append(self.lengths_b, longest, num_tokens)
        positions = self._rows(positions)
        if self.lean_attention and num_tokens <= self.node_mask_append_limit:
            # each row's new entries follow its own prefix, so causal bits over them and kv_lens = its
            # length + T describe the row (tree_attention), its K/V scattered to its own columns
            rows = positions.shape[0]
            mask = NodeMask(causal_bits(num_tokens, positions.device).expand(rows, -1, -1),
                            self._rows(self.lengths_b) + num_tokens, num_tokens)
        else:
            mask = self._rows(mask)
        return positions, cache_attend(self.kv, layers, mask, positions=positions)

    def _shared_length(self) -> Optional[int]:
        """The number of committed entries when every request holds the same (always at batch 1), else
        None."""
        first = self.host_lengths[0]
        return first if min(self.host_lengths) == first == max(self.host_lengths) else None

    def _node_positions(self, rope_pos: Tensor, level: int) -> Positions:
        """Rotary positions of the expansion's level-`level` nodes: one shared position when every row
        holds the same number of entries (served as views), else rope_pos [R, K]."""
        shared = self._shared_length()
        return rope_pos if shared is None else range(shared + level - 1, shared + level)

    def _last(self, out: Tensor, num_new: Tensor) -> Tensor:
        """Row r's entry num_new[r % B] - 1 of out [G * B, T, ...] (the last real token of each row)."""
        last = self._rows((num_new - 1).clamp_min(0))
        return out[torch.arange(out.shape[0], device=out.device), last]

    def start(self, input_ids: Tensor, prompt_lens: Tensor, root: Tensor, hidden: Optional[Tensor], max_len: int,
              prompt_lens_host: Optional[Sequence[int]] = None) -> None:
        raise NotImplementedError

    def advance(self, tokens: Tensor, num_new: Tensor, hidden: Optional[Tensor],
                num_new_host: Optional[Sequence[int]] = None,
                tokens_host: Optional[Sequence[Sequence[int]]] = None) -> None:
        """As :meth:`Drafter.advance`, for every drafter of the group; num_new[b] may be 0 (a finished
        request whose cache stays as it is). ``num_new_host`` / ``tokens_host``: the same counts and
        tokens as host lists, when the caller has them (saves device syncs)."""
        raise NotImplementedError

    def forward_nodes(self, tokens: Tensor, parent_slot: Tensor, write_start: int, rope_pos: Tensor, mask: Tensor,
                      level: int) -> Tensor:
        raise NotImplementedError

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        """EAGLE-2 candidates of every drafter, rows group-major ([G * B, M])."""
        return expand(self, depth, top_k, profiler, with_entropy)

    def tree_depth(self, depth: int, top_k: int) -> int:
        """The deepest node :meth:`draft` ``(depth, top_k)`` can propose (the expansion's depth)."""
        return depth

    def release(self) -> None:
        self.lengths_b = None
        self.root_logits = None

    #: per-row state ([G * B, ...] tensors) that :meth:`subset` carries over
    _row_state: Tuple[str, ...] = ("root_logits",)

    def subset(self, keep: Sequence[int]) -> Optional["DraftGroup"]:
        """The group of drafters ``keep`` (positions in this group), with their caches and state, for
        the rest of a generation (routing that dropped the others); None when `keep` is empty."""
        keep = list(keep)
        if not keep:
            self.release()
            return None
        if keep == list(range(self.groups)):
            return self
        new = type(self)([self.drafters[i] for i in keep])
        new.members = [self.members[i] for i in keep]
        new.sampling = self.sampling
        batch = self.batch
        device = self.lengths_b.device
        rows = torch.cat([torch.arange(i * batch, (i + 1) * batch, device=device) for i in keep])
        new.lengths_b, new.host_lengths = self.lengths_b, list(self.host_lengths)
        for name in self._row_state:
            value = getattr(self, name)
            setattr(new, name, None if value is None else value.index_select(0, rows))
        new.kv = [[t.index_select(0, rows) for t in layer] for layer in self.kv]
        new._share_tables(self)
        self.release()
        return new

    def _share_tables(self, other: "DraftGroup") -> None:
        """Reuse `other`'s precomputed tables (rotary rows) after :meth:`subset`."""


class _InterfaceGroup(DraftGroup):
    """One drafter driven only through the public :class:`Drafter` interface."""

    def __init__(self, drafter: Drafter):
        super().__init__([drafter])
        self.needs_hidden = drafter.needs_hidden

    @property
    def lengths(self) -> Tensor:
        return self.drafters[0].lengths

    @property
    def root_logits(self) -> Tensor:
        return self.drafters[0].root_logits

    @root_logits.setter
    def root_logits(self, value) -> None:
        pass  # read from the drafter

    @property
    def token_map(self) -> Optional[Tensor]:
        return self.drafters[0].token_map

    @token_map.setter
    def token_map(self, value) -> None:
        pass

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        self.drafters[0].start(input_ids, prompt_lens, root, hidden, max_len)
        self.host_lengths = self.drafters[0].lengths.tolist()

    def advance(self, tokens, num_new, hidden, num_new_host=None, tokens_host=None):
        d = self.drafters[0]
        finished = num_new == 0
        d.advance(tokens, num_new.clamp_min(1), hidden)
        d.lengths.sub_(finished.long())  # the interface commits at least one token; finished rows stay
        self.host_lengths = d.lengths.tolist()

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        k = tokens.shape[1]
        write_pos = write_start + torch.arange(k, device=tokens.device).expand(tokens.shape[0], k)
        return self.drafters[0].forward_nodes(tokens, parent_slot, write_pos, rope_pos, mask, level)

    def release(self) -> None:
        self.drafters[0].release()


class _SoloMixin:
    """Drafter methods of the interface, run by a group of one built on :meth:`start` (so a drafter on
    its own and a drafter in a batched group run the same code)."""

    _solo: Optional[DraftGroup] = None

    def _group(self) -> DraftGroup:
        if self._solo is None:
            raise RuntimeError(f"{type(self).__name__}: call start() first")
        return self._solo

    @property
    def lengths(self) -> Tensor:
        return self._group().lengths_b

    @property
    def root_logits(self) -> Tensor:
        return self._group().root_logits

    @property
    def scratch_start(self) -> int:
        return self._group().scratch_start

    def start(self, input_ids, prompt_lens, root, hidden, max_len):
        self._solo = type(self).make_group([self])
        self._solo.start(input_ids, prompt_lens, root, hidden, max_len)

    def advance(self, tokens, num_new, hidden):
        self._group().advance(tokens, num_new.to(self._group().lengths_b.device), hidden)

    def forward_nodes(self, tokens, parent_slot, write_pos, rope_pos, mask, level):
        group = self._group()
        if isinstance(write_pos, Tensor):
            start = int(write_pos[:, 0].min())
            expected = start + torch.arange(tokens.shape[1], device=write_pos.device).expand_as(write_pos)
            if not torch.equal(write_pos, expected):
                raise ValueError(f"{type(self).__name__}.forward_nodes: write positions must be the same "
                                 "consecutive columns for every request")
            write_pos = start
        return group.forward_nodes(tokens, parent_slot, write_pos, rope_pos, mask, level)

    def draft(self, depth: int, top_k: int, profiler=None, with_entropy: bool = True) -> DraftCandidates:
        return self._group().draft(depth, top_k, profiler, with_entropy)

    def release(self) -> None:
        Drafter.release(self)
        if self._solo is not None:
            self._solo.release()
        self._solo = None


# ---------------------------------------------------------------------------------------------------
# An independent causal LM
# ---------------------------------------------------------------------------------------------------

class ModelDrafter(_SoloMixin, Drafter):
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


def _head_rows(weight: Tensor, bias: Optional[Tensor], vocab: Optional[Tensor]) -> Linear:
    """A head Linear over all rows, or only the draft vocabulary's rows (copied)."""
    if vocab is None:
        return Linear(weight, bias)
    vocab = vocab.to(weight.device)
    return Linear(weight.detach()[vocab].contiguous(), None if bias is None else bias.detach()[vocab].contiguous())


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
            self.lean.head = _head_rows(self.lean.head.weight, self.lean.head.bias, vocab).pack()
            self.token_map = vocab.to(self.lean.head.weight.device)
        self.kv: List[List[Tensor]] = []

    def _run(self, ids: Tensor, positions: Tensor, attend) -> Tensor:
        hidden = self.lean.hidden(ids, positions, attend)                # [G, R * T, H]
        return self.lean.logits(hidden).view(ids.shape[0], ids.shape[1], -1)

    def _append(self, ids: Tensor, num_new: Tensor, num_new_host) -> None:
        positions, attend = self._append_attend(self.lean.layers, ids.shape[1])
        logits = self._run(self._rows(ids), positions, attend)
        self.root_logits = self._last(logits, num_new)
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


# ---------------------------------------------------------------------------------------------------
# The EAGLE feature head
# ---------------------------------------------------------------------------------------------------

class _EagleAttention(nn.Module):
    """Llama self-attention weights of an EAGLE head (run by :func:`taps.lean.decoder_layer`)."""

    def __init__(self, config, bias: bool):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        hidden = config.hidden_size
        self.q_proj = nn.Linear(hidden, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, hidden, bias=False)


class _EagleLayer(nn.Module):
    """A Llama decoder layer's weights (EAGLE-1/2 drop the input norm of layer 0)."""

    def __init__(self, config, bias: bool, input_norm: bool):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP, LlamaRMSNorm
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.self_attn = _EagleAttention(config, bias)
        self.mlp = LlamaMLP(config)
        if input_norm:
            self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=eps)


def _config_from_dict(d: dict):
    from transformers import LlamaConfig
    d = {k: v for k, v in d.items() if k not in ("architectures", "model_type", "transformers_version",
                                                    "torch_dtype", "dtype")}
    return LlamaConfig(**d)


_WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")


class EagleDrafter(_SoloMixin, Drafter):
    """EAGLE-1/2 (and HASS) feature head: ``fc`` over [token embedding, target hidden state], then
    ``num_hidden_layers`` Llama decoder layers (one in EAGLE), read out by the target's lm_head.

    Args:
        config: a ``LlamaConfig`` (hidden_size must equal the target's; vocab_size the target's).
        bias: whether ``fc`` (and the q/k/v projections, when `attention_bias`) carry a bias; default
            ``config.bias`` if present, else True (the EAGLE default).
        input_norm_first_layer: whether layer 0 has an ``input_layernorm`` (False in EAGLE-1/2).
        own_embedding: give the head its own ``embed_tokens`` (some checkpoints ship one); by default
            it uses the target's embeddings, like its lm_head, after :meth:`bind`.

    The parameters it owns (and saves) are ``fc.*``, ``layers.{i}.*`` and optionally ``embed_tokens.*``.
    Heads of one shape bound to one target run as one batched group in the decoding loop.
    """

    needs_hidden = True

    def __init__(self, config, *, bias: Optional[bool] = None, input_norm_first_layer: bool = False,
                 own_embedding: bool = False):
        super().__init__()
        self.config = config
        if bias is None:
            bias = bool(getattr(config, "bias", True))
        self.fc_bias = bias
        hidden = config.hidden_size
        attention_bias = bool(getattr(config, "attention_bias", False))
        self.fc = nn.Linear(2 * hidden, hidden, bias=bias)
        self.layers = nn.ModuleList(
            _EagleLayer(config, attention_bias, input_norm=(i > 0 or input_norm_first_layer))
            for i in range(config.num_hidden_layers))
        if own_embedding:
            self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        # In a tuple: not a submodule, so .to(dtype) keeps its inverse frequencies in float32.
        self._rotary = (LlamaRotaryEmbedding(config=config),)
        self._bound: tuple = ()  # (embedding, lm_head) of the target; a tuple so they are not submodules

    # -- checkpoints -----------------------------------------------------------------------------
    @classmethod
    def from_pretrained(cls, path: str, target: Optional[nn.Module] = None,
                        dtype: Optional[torch.dtype] = None) -> "Drafter":
        """Load an EAGLE / HASS checkpoint directory (config.json + model.safetensors or
        pytorch_model.bin with ``fc.*``, ``layers.0.*`` [, ``embed_tokens.weight``]) as it is; an
        EAGLE-3 checkpoint (``midlayer.*``, ``d2t``, ...) loads as a :class:`taps.eagle3.Eagle3Drafter`.

        The layout (fc bias, layer-0 input norm, own embedding) is read from the weight names; unknown
        weight names raise ValueError. Binds to `target` when given. Weights keep their stored dtype
        unless `dtype` is given.
        """
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
        state = _load_weights(path)
        state = {k[len("model."):] if k.startswith("model.") else k: v for k, v in state.items()}
        from .eagle3 import Eagle3Drafter, is_eagle3_state
        if is_eagle3_state(state):
            return Eagle3Drafter.from_state(raw, state, target=target, dtype=dtype, where=path)
        config = _config_from_dict(raw)
        state.pop("lm_head.weight", None)  # some exports repeat the target's head; ours is the target's
        if "fc.weight" not in state:
            raise ValueError(f"EagleDrafter.from_pretrained: {path} has no fc.weight; not an EAGLE checkpoint "
                             f"(weights: {sorted(state)[:8]}...)")
        layer_ids = {int(k.split(".")[1]) for k in state if k.startswith("layers.")}
        if layer_ids and max(layer_ids) + 1 != config.num_hidden_layers:
            config.num_hidden_layers = max(layer_ids) + 1
        drafter = cls(config, bias="fc.bias" in state,
                      input_norm_first_layer="layers.0.input_layernorm.weight" in state,
                      own_embedding="embed_tokens.weight" in state)
        if state.get("layers.0.self_attn.q_proj.bias") is not None and not getattr(config, "attention_bias", False):
            config.attention_bias = True
            drafter = cls(config, bias="fc.bias" in state,
                          input_norm_first_layer="layers.0.input_layernorm.weight" in state,
                          own_embedding="embed_tokens.weight" in state)
        expected = set(drafter.state_dict())
        unknown, missing = set(state) - expected, expected - set(state)
        if unknown or missing:
            raise ValueError(f"EagleDrafter.from_pretrained: weights do not match the EAGLE layout of "
                             f"{path}: unexpected {sorted(unknown)}, missing {sorted(missing)}")
        if dtype is None:
            dtype = state["fc.weight"].dtype
        drafter.to(dtype)
        drafter.load_state_dict(state)
        if target is not None:
            drafter.bind(target)
        return drafter

    def save_pretrained(self, path: str, safe_serialization: bool = True) -> None:
        """Write config.json and the owned weights (EAGLE layout names) to directory `path`."""
        os.makedirs(path, exist_ok=True)
        d = self.config.to_dict()
        d["bias"] = self.fc_bias
        d["architectures"] = ["LlamaForCausalLM"]
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(d, f, indent=2, sort_keys=True, default=str)
        state = {k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()}
        if safe_serialization:
            from safetensors.torch import save_file
            save_file(state, os.path.join(path, "model.safetensors"))
        else:
            torch.save(state, os.path.join(path, "pytorch_model.bin"))

    def clone(self) -> "EagleDrafter":
        twin = EagleDrafter(self.config, bias=self.fc_bias,
                            input_norm_first_layer=hasattr(self.layers[0], "input_layernorm"),
                            own_embedding=hasattr(self, "embed_tokens"))
        param = self.fc.weight
        twin.to(device=param.device, dtype=param.dtype)
        twin.load_state_dict(self.state_dict())
        twin._bound = self._bound
        twin.draft_vocab = self.draft_vocab
        return twin

    # -- binding ---------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        if self._bound:
            return int(self._bound[1].weight.shape[0])
        return int(self.config.vocab_size)

    @property
    def hidden_size(self) -> int:
        return int(self.config.hidden_size)

    def bind(self, target: nn.Module, move: bool = True) -> None:
        """Use `target`'s input embeddings and lm_head; move to the target's device and dtype (unless
        ``move`` is False: training keeps its own)."""
        h = target_hidden_size(target)
        if h != self.hidden_size:
            raise ValueError(f"EagleDrafter: built for hidden size {self.hidden_size}, the target's is {h}")
        v = target_vocab_size(target)
        if hasattr(self, "embed_tokens") and self.embed_tokens.weight.shape[0] != v:
            raise ValueError(f"EagleDrafter: its embedding has {self.embed_tokens.weight.shape[0]} tokens, "
                             f"the target's vocabulary {v}")
        if int(self.config.vocab_size) != v:
            raise ValueError(f"EagleDrafter: config vocab_size {self.config.vocab_size}, the target's is {v}")
        if move:
            param = next(target.parameters())
            self.to(device=param.device, dtype=param.dtype)
        self._bound = (target.get_input_embeddings(), target.get_output_embeddings())

    @property
    def rotary(self) -> nn.Module:
        """The head's rotary-embedding module (kept out of the submodules, so its frequencies stay fp32)."""
        return self._rotary[0]

    def _require_bound(self) -> None:
        if not self._bound:
            raise RuntimeError("EagleDrafter: bind(target) first (it uses the target's embeddings and lm_head)")

    def lm_head(self) -> nn.Module:
        """The lm_head the head's features are read out with: the target's (after :meth:`bind`)."""
        self._require_bound()
        return self._bound[1]

    def embedding_weight(self) -> Tensor:
        """The token embedding the head reads: its own, else the target's (after :meth:`bind`)."""
        if hasattr(self, "embed_tokens"):
            return self.embed_tokens.weight
        self._require_bound()
        return self._bound[0].weight

    # -- running ---------------------------------------------------------------------------------
    @property
    def root_feature(self) -> Tensor:
        """[B, H] the head's predicted feature at the current root (what the depth-1 nodes read)."""
        return self._group().root_feature

    def features(self, tokens: Tensor, hidden: Tensor, write_pos: Tensor, rope_pos: Tensor, mask: Tensor,
                 kv: Optional[List[List[Tensor]]] = None) -> Tensor:
        """Predicted features [B, T, H] for input pairs (tokens [B, T], target/predicted features
        [B, T, H]); K/V written at write_pos [B, T] into `kv` (per layer [keys, values] [B, Hkv, S, D];
        default a fresh cache of S = mask.shape[-1] positions); mask [B, 1, T, S] bool."""
        group = _EagleGroup([self])
        if kv is None:
            attn = self.layers[0].self_attn
            shape = (tokens.shape[0], attn.num_kv_heads, int(mask.shape[-1]), attn.head_dim)
            kv = [[hidden.new_zeros(shape, dtype=group.dtype), hidden.new_zeros(shape, dtype=group.dtype)]
                  for _ in self.layers]
        group.rope.ensure(int(rope_pos.max()) + 1, tokens.device)
        return group.features(tokens, hidden, rope_pos, cache_attend(kv, group.layers, mask, positions=write_pos))

    def group_key(self) -> Optional[Hashable]:
        if not self._bound or hasattr(self, "embed_tokens"):
            return None
        return ("eagle", id(self._bound[1])) + head_key(self)

    @classmethod
    def make_group(cls, drafters: Sequence["EagleDrafter"]) -> DraftGroup:
        return _EagleGroup(drafters)


class _EagleGroup(DraftGroup):
    """EAGLE heads of one shape, bound to one target, run as one batched forward."""

    needs_hidden = True
    lean_attention = True

    def __init__(self, drafters: Sequence[EagleDrafter]):
        super().__init__(drafters)
        first = drafters[0]
        first._require_bound()
        self.fc = Linear([d.fc.weight for d in drafters], [d.fc.bias for d in drafters]).pack()
        self.layers = [LayerWeights([d.layers[i] for d in drafters]).pack() for i in range(len(first.layers))]
        self.embed_weight = first.embedding_weight()
        head = first.lm_head()
        self.head = _head_rows(head.weight, head.bias, first.draft_vocab).pack()
        if first.draft_vocab is not None:
            self.token_map = first.draft_vocab.to(head.weight.device)
        self.dtype = first.fc.weight.dtype
        self.rope = RopeTable(first.rotary, self.dtype)
        self.kv: List[List[Tensor]] = []
        self.root_feature: Optional[Tensor] = None
        self.frontier: Optional[Tensor] = None

    def features(self, tokens: Tensor, hidden: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """[G * B, T, H] predicted features of (token, feature) pairs, rows group-major."""
        rows, num = tokens.shape
        emb = as_dtype(F.embedding(tokens, self.embed_weight), self.dtype)
        x = self.fc(torch.cat([emb, as_dtype(hidden, self.dtype)], dim=-1).view(self.groups, -1, 2 * emb.shape[-1]))
        cos, sin = self.rope(rope_pos, (rows, num))
        for i, w in enumerate(self.layers):
            x = decoder_layer(w, i, x, cos, sin, attend, rows // self.groups, num)
        return x.view(rows, num, -1)

    def _logits(self, feature: Tensor) -> Tensor:
        return self.head(as_dtype(feature, self.head.weight.dtype))

    def _append(self, tokens: Tensor, hidden: Tensor, num_new: Tensor, num_new_host) -> None:
        positions, attend = self._append_attend(self.layers, tokens.shape[1])
        out = self.features(self._rows(tokens), self._rows(hidden), positions, attend)
        self.root_feature = self._last(out, num_new)
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

    def _node_features(self, tokens: Tensor, feats: Tensor, rope_pos: Tensor, attend) -> Tensor:
        """Output features of draft nodes, which read their parent's output feature (EAGLE-1/2: through
        ``fc``, as committed entries read the target's)."""
        return self.features(tokens, feats, rope_pos, attend)

    _row_state = ("root_logits", "root_feature", "frontier")

    def release(self) -> None:
        super().release()
        self.kv = []
        self.root_feature = self.frontier = None

    def _share_tables(self, other) -> None:
        self.rope = other.rope


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


def _load_weights(path: str) -> Dict[str, Tensor]:
    for name in _WEIGHT_FILES:
        file = os.path.join(path, name)
        if os.path.exists(file):
            if name.endswith(".safetensors"):
                from safetensors.torch import load_file
                return load_file(file)
            return torch.load(file, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights ({' or '.join(_WEIGHT_FILES)}) in {path}")


# ---------------------------------------------------------------------------------------------------
# Checkpoint averaging
# ---------------------------------------------------------------------------------------------------

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
