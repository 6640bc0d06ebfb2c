"""The drafter interface and drafter groups, which every drafter kind of :mod:`taps.drafters` builds on.

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
g * B + b is request b of drafter g). A drafter used on its own runs through a group of one
(:class:`SoloMixin`), so both paths are the same code. Drafter subclasses written elsewhere that only
implement the interface above run through :class:`_InterfaceGroup`, one at a time.

Request rows. A continuous-batching loop changes a group's requests between steps without restarting
it: :meth:`DraftGroup.spawn` gives a group of the same drafters (sharing the weights and tables) to start
on newly arrived requests, :meth:`DraftGroup.append_requests` moves its requests after this group's, and
:meth:`DraftGroup.select_requests` keeps a subset (finished requests leave). Both re-index every per-row
tensor (``kv``, ``lengths_b``, ``host_lengths``, the ``_row_state`` tensors and each kind's own state), so
that the group drafts for its requests what a group started on them alone would. A drafter driven
through :class:`_InterfaceGroup` takes part when it implements :meth:`Drafter.select_requests` and
:meth:`Drafter.append_requests`.

Reduced draft vocabulary. :meth:`Drafter.set_draft_vocab` restricts what a drafter may propose to a
subset of the target's vocabulary (for example its most frequent tokens, :mod:`taps.vocab`): the head
then computes logits for those rows only, which is most of a small drafter's cost. The trees still
hold target token ids; verification is unchanged, so decoding stays lossless.
"""

from __future__ import annotations

import copy
from typing import Dict, Hashable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

from ..expansion import DraftCandidates, DraftSampler, SampledDraft, expand, expand_sampled
from ..kv import NodeMask, cache_attend, causal_append, causal_bits, grown_length
from ..lean import Linear, Positions

__all__ = ["Drafter", "DraftGroup", "HostLengths", "SoloMixin", "make_groups", "target_vocab_size", "target_hidden_size",
           "head_rows", "join_rows"]


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

    # -- request rows (drafters run through the interface group) ------------------------------------
    def select_requests(self, keep: Sequence[int]) -> None:
        """Keep only requests `keep` (indices into the current batch, in that order) of the committed
        state. Only drafters that run through the interface group (no :meth:`make_group` of their own)
        implement it, for :meth:`DraftGroup.select_requests`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement select_requests")

    def append_requests(self, other: "Drafter") -> None:
        """Add the requests of `other` (a :meth:`clone` of this drafter, started on its own) after this
        drafter's, and release `other`; as :meth:`select_requests`, for :meth:`DraftGroup.append_requests`."""
        raise NotImplementedError(f"{type(self).__name__} does not implement append_requests")


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
    above 0), for drafters whose proposals suit greedy and sampled verification differently. ``alone``
    (set by the decoder before each draft) says whether this group's candidates make the step's tree on
    their own (one drafter drafts), not merged with or ranked against other drafters'.
    """

    needs_hidden = False
    sampling = False
    alone = False
    #: attention runs through taps.kv.cache_attend, which takes taps.kv.NodeMask masks as well
    lean_attention = False
    #: appends of up to this many tokens per row attend through a causal NodeMask (tree_attention)
    node_mask_append_limit = 256
    #: drafting runs no model (prompt lookup): the tuner asks :meth:`has_draft` before it plans a step
    free_draft = False
    #: once started, appended to at every step, never queued (a tuner's plain steps queue the others' appends
    #: until they next draft): groups whose append is host bookkeeping of a few microseconds (prompt lookup, an
    #: n-gram table), for which catching up at a draft after a run of plain steps cost more than keeping up
    kept_current = False
    #: its drawn draft is also its cheap greedy one: where no request samples the decoder may draw it too, the
    #: chain of its modes (an n-gram table: one host call, where its top-k tree is the generic expansion over
    #: the table's logits); verification at temperature 0 accepts it as a top-1 chain
    draws_greedy = False

    def __init__(self, drafters: Sequence[Drafter]):
        self.drafters = list(drafters)
        self.groups = len(self.drafters)
        self.target_features = self.drafters[0].target_features
        self.members: List[int] = list(range(self.groups))
        self.lengths_b: Optional[Tensor] = None
        self.host_lengths: List[int] = []
        self.root_logits: Optional[Tensor] = None
        self.token_map: Optional[Tensor] = None
        self.kv: List[List[Tensor]] = []  # per layer [keys, values] [G * B, Hkv, S, D] (lean kinds)

    @property
    def batch(self) -> int:
        return len(self.host_lengths)

    def has_draft(self, b: int) -> bool:
        """Whether a draft now would propose anything for request b (a group with ``free_draft`` tells
        before drafting; the others always may)."""
        return True

    @property
    def lengths(self) -> Tensor:
        """[G * B] committed entries per row."""
        return self._rows(self.lengths_b)

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
        return torch.cat([t] * self.groups)  # (a fifth of Tensor.repeat's time on small tensors)

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
        # every row writes T positions, its padding past its own new tokens too: after a lazy catch-up (a
        # tuner's group appends what it missed, rows of a continuous batch having missed different numbers
        # of tokens) a short row near the end of its cache would write past it
        self._ensure_positions(longest + num_tokens)
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

    def _ensure_positions(self, length: int) -> None:
        """Cache positions 0 .. length - 1 in every row: the caches ``kv`` grow (:func:`taps.kv.grown_length`),
        the kind's rotary table with them (:meth:`_ensure_rope`)."""
        if not self.kv or self.kv[0][0].shape[2] >= length:
            return
        size = self.kv[0][0].shape[2]
        new = grown_length(size, length)

        def grow(t: Tensor) -> Tensor:
            out = t.new_zeros((t.shape[0], t.shape[1], new, *t.shape[3:]))
            out[:, :, :size] = t
            return out
        self.kv = [[grow(t) for t in layer] for layer in self.kv]
        self._ensure_rope(new)

    def _ensure_rope(self, length: int) -> None:
        """Rotary rows 0 .. length - 1 (kinds with a rotary table of their own)."""

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

    def _last(self, out: Tensor, num_new: Tensor, num_new_host: Optional[Sequence[int]] = None) -> Tensor:
        """Row r's entry num_new[r % B] - 1 of out [G * B, T, ...] (the last real token of each row); a view
        when the host counts say every row appended the same number (always at batch 1: one column, where
        the indexing's four small ops cost 20-50 us in a decoding step)."""
        if num_new_host is not None and len(num_new_host) and min(num_new_host) == max(num_new_host) > 0:
            return out[:, int(num_new_host[0]) - 1]
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

    def draft_sampled(self, depth: int, width: int, sampler: DraftSampler, profiler=None) -> SampledDraft:
        """Chains drawn from the group's drafter, or from the mean of its G drafters' distributions
        (:func:`taps.expansion.expand_sampled`): [B, M] candidates."""
        return expand_sampled(self, depth, width, sampler, profiler, groups=self.groups)

    def tree_depth(self, depth: int, top_k: int) -> int:
        """The deepest node :meth:`draft` ``(depth, top_k)`` can propose (the expansion's depth)."""
        return depth

    def release(self) -> None:
        """Drop the requests' state (caches included; the attributes are replaced, never changed in place,
        so a group :meth:`spawn` made keeps its own)."""
        self.lengths_b = None
        self.root_logits = None

    #: per-row state ([G * B, ...] tensors) that :meth:`subset`, :meth:`select_requests` and
    #: :meth:`append_requests` carry over with the caches ``kv``
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
        new._take_rows(self, rows)
        new._share_tables(self)
        self.release()
        return new

    def _share_tables(self, other: "DraftGroup") -> None:
        """Reuse `other`'s precomputed tables (rotary rows) after :meth:`subset`."""

    def _take_rows(self, source: "DraftGroup", rows: Tensor) -> None:
        """Set this group's per-row tensors (:attr:`_row_state`, the caches ``kv``) to rows `rows` of
        `source`'s."""
        for name in self._row_state:
            value = getattr(source, name)
            setattr(self, name, None if value is None else value.index_select(0, rows))
        self.kv = [[t.index_select(0, rows) for t in layer] for layer in source.kv]

    # -- request rows ----------------------------------------------------------------------------------
    def spawn(self) -> "DraftGroup":
        """A new group of the same drafters and ``members``, not started, sharing this group's weights and
        precomputed tables, with the same ``sampling``: start it on newly arrived requests, then
        :meth:`append_requests` it to this group."""
        new = copy.copy(self)
        new.members = list(self.members)
        new.host_lengths = []
        new.release()
        return new

    def select_requests(self, keep: Sequence[int]) -> None:
        """Keep only requests `keep` (indices b in 0 .. B-1, distinct, in that order) of every drafter, in
        place; `keep` may be empty (the group then holds no request until :meth:`append_requests`)."""
        keep = self._request_list(keep)
        index = torch.tensor(keep, dtype=torch.int64, device=self.lengths_b.device)
        offsets = torch.arange(self.groups, device=index.device).unsqueeze(1) * self.batch
        self._select_state(keep, index, (offsets + index).flatten())
        self.host_lengths = [self.host_lengths[b] for b in keep]

    def append_requests(self, other: "DraftGroup") -> None:
        """Add the B' requests of `other` (a started group from :meth:`spawn`) after this group's B, in
        place (rows stay group-major); caches of different capacities are joined at the larger one.
        `other` is released."""
        if (other is self or type(other) is not type(self) or other.members != self.members
                or len(other.drafters) != len(self.drafters)
                or any(a is not b for a, b in zip(other.drafters, self.drafters))):
            raise ValueError(f"{type(self).__name__}.append_requests: the other group must come from this "
                             "group's spawn()")
        if other.lengths_b is None:
            raise RuntimeError(f"{type(self).__name__}.append_requests: start() the other group first")
        self._join_state(other)
        self.host_lengths = self.host_lengths + other.host_lengths
        other.release()

    def _request_list(self, keep: Sequence[int]) -> List[int]:
        """`keep` as a list of distinct request indices of this group (ValueError otherwise)."""
        keep = [int(b) for b in keep]
        if any(not 0 <= b < self.batch for b in keep) or len(set(keep)) != len(keep):
            raise ValueError(f"{type(self).__name__}.select_requests: need distinct requests in "
                             f"[0, {self.batch}), got {keep}")
        return keep

    def _select_state(self, keep: List[int], index: Tensor, rows: Tensor) -> None:
        """Keep the device state of requests `keep` (``index``: the same [B'] on the device; ``rows``:
        their [G * B'] rows); kinds with state of their own extend it."""
        self.lengths_b = self.lengths_b.index_select(0, index)
        self._take_rows(self, rows)

    def _join_state(self, other: "DraftGroup") -> None:
        """Put `other`'s device state after this group's; kinds with state of their own extend it."""
        self.lengths_b = torch.cat([self.lengths_b, other.lengths_b])
        for name in self._row_state:
            mine = getattr(self, name)
            if mine is not None:
                setattr(self, name, join_rows(mine, getattr(other, name), self.groups))
        self.kv = [[join_rows(a, b, self.groups) for a, b in zip(mine, theirs)]
                   for mine, theirs in zip(self.kv, other.kv)]


class HostLengths:
    """For groups whose requests' state lives on the host (prompt lookup, n-gram tables), mixed in before
    :class:`DraftGroup`: the [B] lengths tensor is made from ``host_lengths`` when read (a draft, a change of the
    requests), not at every append (the decoder appends to every group every step, plain ones included).
    :meth:`_lengths_changed` after the host lengths move; the tensor stays on the device it was last set on."""

    _lengths: Optional[Tensor] = None
    _lengths_current = True
    _lengths_device = torch.device("cpu")

    @property
    def lengths_b(self) -> Optional[Tensor]:
        if not self._lengths_current:
            self._lengths = torch.tensor(self.host_lengths, dtype=torch.int64, device=self._lengths_device)
            self._lengths_current = True
        return self._lengths

    @lengths_b.setter
    def lengths_b(self, value: Optional[Tensor]) -> None:
        self._lengths, self._lengths_current = value, True
        if value is not None:
            self._lengths_device = value.device

    def _lengths_changed(self) -> None:
        """The host lengths moved: the tensor is made again when read (a released group keeps none)."""
        self._lengths_current = self._lengths is None


def join_rows(a: Tensor, b: Tensor, groups: int) -> Tensor:
    """Group-major row tensors ``a [G * B, ...]`` and ``b [G * B', ...]`` joined as ``[G * (B + B'), ...]``:
    each group's rows of `a`, then its rows of `b`. A dimension where they differ (a cache's capacity)
    takes the larger size; the padding is zeros."""
    ba, bb = a.shape[0] // groups, b.shape[0] // groups
    a, b = a.reshape(groups, ba, *a.shape[1:]), b.reshape(groups, bb, *b.shape[1:])
    if a.shape[2:] == b.shape[2:]:
        return torch.cat([a, b], 1).flatten(0, 1)
    out = a.new_zeros((groups, ba + bb, *(max(x, y) for x, y in zip(a.shape[2:], b.shape[2:]))))
    out[(slice(None), slice(0, ba)) + tuple(slice(0, n) for n in a.shape[2:])] = a
    out[(slice(None), slice(ba, None)) + tuple(slice(0, n) for n in b.shape[2:])] = b
    return out.flatten(0, 1)


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

    def spawn(self) -> "DraftGroup":
        """A group of a :meth:`Drafter.clone` of the drafter (whose state lives in the drafter itself)."""
        new = _InterfaceGroup(self.drafters[0].clone())
        new.members, new.sampling = list(self.members), self.sampling
        return new

    def select_requests(self, keep: Sequence[int]) -> None:
        keep = self._request_list(keep)
        self.drafters[0].select_requests(keep)
        self.host_lengths = [self.host_lengths[b] for b in keep]

    def append_requests(self, other: "DraftGroup") -> None:
        if other is self or type(other) is not type(self) or other.members != self.members:
            raise ValueError("_InterfaceGroup.append_requests: the other group must come from this group's spawn()")
        self.drafters[0].append_requests(other.drafters[0])
        self.host_lengths = self.host_lengths + other.host_lengths
        other.release()


class SoloMixin:
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


def head_rows(weight: Tensor, bias: Optional[Tensor], vocab: Optional[Tensor]) -> Linear:
    """A head Linear over all rows, or only the draft vocabulary's rows (copied)."""
    if vocab is None:
        return Linear(weight, bias)
    vocab = vocab.to(weight.device)
    return Linear(weight.detach()[vocab].contiguous(), None if bias is None else bias.detach()[vocab].contiguous())
