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

import weakref
from typing import Iterable, List, Optional, Sequence, Tuple

import torch
from torch import Tensor, nn

import taps_ops

from . import hf
from .kv import TreeAttend, cache_attend, causal_append, causal_bits
from .lean import LeanCausalLM, Linear, lean_support, stack_key

__all__ = ["TargetForward", "LAZY_HEAD_MIN", "LAZY_MIN_NODES", "LAZY_MAX_CHAIN"]

#: lm_head size (vocabulary x hidden) and tree size from which verification computes only the visited rows
#: on the CPU by default (:meth:`TargetForward.verify`; the lazy walk's own cost is a host loop over the nodes and
#: one more walk when the path leaves the first-child chain, ~30-50 us; the shipped target's head costs ~23 us a
#: row in bf16, ~40 in fp32, Zen 4)
LAZY_HEAD_MIN = 1 << 20
LAZY_MIN_NODES = 12
#: by default the lazy head is used only when the trees' first-child chains hold at most this share of their
#: real nodes: a chain (prompt lookup's, a token store's) has every node on it, and computing its rows in
#: chunks as the walk goes measured slower than one product over all of them (a second call re-reads the whole
#: head: store rows 3-6% slower in fp32 and bf16)
LAZY_MAX_CHAIN = 0.5
#: a batch of trees runs packed (its real nodes only, :meth:`TargetForward.tree`) when its padding is at least
#: this share of its [B, N] grid (packing adds a few index operations per layer)
PACK_MIN_PADDING = 0.25
#: the largest logits grid (elements) a packed verification keeps for the next step (64 MB in fp32); a
#: larger one is allocated per step
LOGITS_GRID_KEEP = 1 << 24


#: a packed half-precision forward computes a multiple of this many rows (the first padding slots fill it): on
#: the CPU oneDNN builds a bf16 product's kernel the first time it meets a row count (0.3-0.4 ms against 0.06
#: ms after, a 1536 x 256 product), and a packed batch meets any count up to B x N
PACK_HALF_ROWS = 8


#: a half-precision prefill on the CPU runs a multiple of this many tokens a row (padding after the prompts):
#: oneDNN builds a bf16 product's kernel the first time it meets a row count, and a server meets a new prompt
#: length at nearly every admission (a 60-token prefill of the shipped target: 6.3 ms the first time, 2.8 ms
#: after, AMX Xeon)
PREFILL_HALF_ROWS = 16
#: a single prompt into an empty cache runs packed too (a causal chain of a packed tree forward: tree_attention, not
#: SDPA, and no padding rows) up to this many tokens. Measured on an AMX Xeon (1 thread, shipped target,
#: bench/RESULTS.md): bf16 20-300 tokens 9-21% faster packed, 600-1000 tokens 2-5% slower; fp32 14-27% faster at
#: 20-300 tokens, 7-14% at 600-1000 (longer prompts, and larger models' long ones, unmeasured: the padded path).
PACK_ONE_MAX = 512


def prefill_rows(num: int, dtype: torch.dtype, device: torch.device) -> int:
    """The tokens a row a prefill of `num` tokens runs: `num` rounded up to :data:`PREFILL_HALF_ROWS` in half
    precision on the CPU, else `num`."""
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float16):
        return num
    return -(-num // PREFILL_HALF_ROWS) * PREFILL_HALF_ROWS


def packed_slots(nodes: Sequence[int], num: int, half: bool = False) -> List[int]:
    """The grid slots (``b * num + i``) a packed forward computes: each tree's real nodes, and with ``half`` the
    first padding slots up to a multiple of :data:`PACK_HALF_ROWS` rows (at most the whole grid), in order."""
    slots = [b * num + i for b, n in enumerate(nodes) for i in range(n)]
    if half:
        want = min(-(-len(slots) // PACK_HALF_ROWS) * PACK_HALF_ROWS, len(nodes) * num)
        if want > len(slots):
            extra = [b * num + i for b, n in enumerate(nodes) for i in range(n, num)][:want - len(slots)]
            slots = sorted(slots + extra)
    return slots


def packs(nodes: Sequence[int], num: int, min_padding: float = PACK_MIN_PADDING) -> bool:
    """Whether trees of ``nodes`` real nodes each, padded to ``num``, run packed: when at least `min_padding` of
    the grid is padding (see :data:`PACK_MIN_PADDING`)."""
    padded = len(nodes) * num
    return len(nodes) > 1 and padded - sum(nodes) >= min_padding * padded


class _Packed:
    """The packed copies of one target's weights (its head; the lean model's fused projections, as large
    as the weights themselves) for the parameter values ``key`` names: shared by every
    :class:`TargetForward` of that target that holds it (decoders of one target keep one copy, not one
    each), and freed with the last of them."""

    __slots__ = ("model", "key", "head", "lean", "__weakref__")

    def __init__(self, model: nn.Module, key: tuple, lean: bool):
        self.model, self.key = model, key  # the model: its id names this entry for as long as it lives
        out = model.get_output_embeddings()
        self.head = Linear(out.weight, out.bias).pack(choose_layout=True)
        self.lean = LeanCausalLM(model).pack() if lean else None


_PACKED: "weakref.WeakValueDictionary[int, _Packed]" = weakref.WeakValueDictionary()


def _packed(model: nn.Module, key: tuple, lean: bool) -> _Packed:
    """The shared packed weights of `model` at parameter values `key`, built when missing or stale."""
    entry = _PACKED.get(id(model))
    if entry is None or entry.model is not model or entry.key != key or (lean and entry.lean is None):
        entry = _PACKED[id(model)] = _Packed(model, key, lean)
    return entry


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
        self.use_lean = lean is not False and why is None
        self.lean: Optional[LeanCausalLM] = None
        self._packed: Optional[_Packed] = None
        self._logits_grid: Optional[Tensor] = None  # reused by packed verifications (see verify)
        self._onehot: Optional[Tensor] = None       # greedy verification's zeroed one-hot grid (see verify)
        self.head = Linear(model.get_output_embeddings().weight, model.get_output_embeddings().bias)

    def new_cache(self, batch: int, max_len: int) -> hf.TreeKVCache:
        """A cache of `max_len` positions per request (and, on the lean path, the weights' packed copies
        and rotary rows brought up to date: rebuilt when a parameter changed since the last call; one copy
        shared by every TargetForward of the model)."""
        cache = hf.TreeKVCache.for_model(self.model, batch, max_len)
        key = stack_key(list(self.model.parameters()))
        if self._packed is None or self._packed.key != key:
            self._packed = _packed(self.model, key, self.use_lean)
            self.head = self._packed.head
            self.lean = self._packed.lean if self.use_lean else None
        if self.lean is not None:
            self.lean.rope.ensure(max_len, cache.lengths.device)
        return cache

    def prefill(self, cache: hf.TreeKVCache, input_ids: Tensor, num_new: Tensor, longest: int,
                return_hidden: bool = False, capture_layers: Sequence[int] = (),
                host_lengths: Optional[Sequence[int]] = None) -> hf.ForwardOutput:
        """Append right-padded input_ids [B, T] (num_new [B] real tokens per row; ``longest`` =
        max(cache.lengths) on the host). Returns the logits after each row's last real token [B, V] and,
        when asked, the final hidden states [B, T, H] and the inputs of ``capture_layers`` ([B, T, H]
        each); cache.lengths advances by num_new.

        ``host_lengths`` (num_new as host ints): on the lean path, several prompts into empty caches run packed (one
        prompt too, up to :data:`PACK_ONE_MAX` tokens): only their real
        tokens are computed, each row's a causal chain of a packed tree forward (each row's
        queries over its own keys only). The states returned at padding positions are then zeros (in half
        precision, a filler slot's, see :func:`packed_slots`: no real token's). (Shipped target, 8 prompts of
        37-76 tokens, Zen 4: 23.5 ms against 33.0 padded in bf16, 34.1 against 45.7 in fp32; 8 prompts of 58
        tokens, no padding: 19.5 against 24.9 ms, 31.8 against 35.8; prompts of 1500 and 900 tokens, bf16: 297
        against 463 ms.)"""
        if self.lean is None:
            return hf.prefill(self.model, cache, input_ids, num_new, return_hidden=return_hidden,
                              capture_layers=capture_layers)
        batch, num = input_ids.shape
        if longest + num > cache.max_len:
            raise ValueError(f"TargetForward.prefill: {longest + num} positions needed, the cache holds {cache.max_len}")
        hf.check_capture_layers(self.model, capture_layers)
        if host_lengths is not None and (len(host_lengths) != batch or (
                num_new.device.type == "cpu" and list(host_lengths) != num_new.tolist())):
            raise ValueError(f"TargetForward.prefill: host_lengths {list(host_lengths)} are not num_new "
                             f"{num_new.tolist()}")
        real = num
        if longest == 0 and host_lengths is not None and (len(host_lengths) > 1 or num <= PACK_ONE_MAX):
            device = input_ids.device
            chain = causal_bits(num, device).unsqueeze(0).expand(batch, num, -1)
            depth = torch.arange(num, device=device).unsqueeze(0).expand(batch, num)
            out = self.tree(cache, input_ids, chain, depth, 0, capture_layers=capture_layers,
                            nodes=list(host_lengths), min_padding=0.0)
            hidden, layers = out.hidden_states, out.layers
        else:
            rows = prefill_rows(num, self.lean.dtype, input_ids.device)
            if rows > num and longest + rows <= cache.max_len:
                # half precision on the CPU: padding tokens up to a multiple of PREFILL_HALF_ROWS (their K/V go
                # past each row's length, where the next steps write; no real token sees them)
                input_ids = torch.nn.functional.pad(input_ids, (0, rows - num), value=-1)
                num = rows
            positions, mask = causal_append(cache.lengths, longest, num)
            kv = [(layer.keys, layer.values) for layer in cache.layers]
            # from empty caches (longest 0: every row holds 0 entries) the K/V go to columns 0 .. T-1 of every
            # row, a plain copy; otherwise to each row's own positions
            attend = cache_attend(kv, self.lean.layers, mask, positions=positions,
                                  start=0 if longest == 0 else None)
            hidden, layers = self._run(input_ids, positions, attend, capture_layers)
        cache.lengths.add_(num_new)
        last = hidden[torch.arange(batch, device=hidden.device), (num_new - 1).clamp_min(0)]
        if num > real:
            hidden = hidden[:, :real]
            layers = None if layers is None else {i: t[:, :real] for i, t in layers.items()}
        return hf.ForwardOutput(self.head(last), hidden if return_hidden else None, layers)

    def _run(self, ids: Tensor, positions: Tensor, attend, capture_layers: Sequence[int]):
        batch, num = ids.shape
        out = self.lean.hidden(ids.clamp_min(0), positions, attend, capture_layers)
        hidden, layers = out if capture_layers else (out, None)
        if layers is not None:
            layers = {i: t.view(batch, num, -1) for i, t in layers.items()}
        return hidden.view(batch, num, -1), layers

    def tree(self, cache: hf.TreeKVCache, tokens: Tensor, tree_mask: Tensor, depth: Tensor, longest: int,
             capture_layers: Sequence[int] = (), uniform: bool = False,
             nodes: Optional[Sequence[int]] = None, min_padding: float = PACK_MIN_PADDING) -> hf.ForwardOutput:
        """The verification forward over trees [B, N] (node i of request b written at cache position
        lengths[b] + i, rotary position lengths[b] + depth[b, i]; ``longest`` = max(cache.lengths) on the
        host; ``uniform``: every row holds ``longest`` entries, so the nodes' K/V are one plain copy into
        columns longest .. longest + N - 1). Returns ForwardOutput(None, final hidden states [B, N, H],
        inputs of ``capture_layers``); cache.lengths is unchanged (apply :meth:`logits` to the rows that
        need them).

        ``nodes`` (host ints, [B]): each tree's real nodes (the first nodes[b] of row b; the rest padding).
        On the lean path, when they leave enough of the [B, N] grid as padding (:func:`packs`), only the
        real nodes are computed (``taps_ops.decoder_layer``'s packed rows: a ragged batch of trees costs
        its nodes, not B times its widest tree's; in half precision with the first padding slots up to a
        multiple of :data:`PACK_HALF_ROWS` rows, :func:`packed_slots`); the other padding rows of the
        returned states are zeros."""
        num = tokens.shape[1]
        if longest + num > cache.max_len:
            raise ValueError(f"TargetForward.tree: {longest + num} positions needed, the cache holds {cache.max_len}")
        if self.lean is None:
            return hf.tree_verify_forward(self.model, cache, tokens, tree_mask, depth, compute_logits=False,
                                          capture_layers=capture_layers)
        hf.check_capture_layers(self.model, capture_layers)
        prefix = cache.lengths
        positions = prefix.unsqueeze(1) + depth.clamp_min(0)
        kv_lens = prefix + num
        kv = [(layer.keys, layer.values) for layer in cache.layers]
        batch = tokens.shape[0]
        if nodes is not None and packs(nodes, num, min_padding):
            device = tokens.device
            half = self.lean.dtype in (torch.bfloat16, torch.float16)
            slots = torch.tensor(packed_slots(nodes, num, half), dtype=torch.int64, device=device)
            columns = (prefix.unsqueeze(1) + torch.arange(num, device=device)).view(-1).index_select(0, slots)
            attend = TreeAttend(kv, self.lean.layers, tree_mask, kv_lens, None, longest, packed=(slots, columns))
            hidden, layers = self._run(tokens.reshape(-1).index_select(0, slots).view(1, -1),
                                       positions.reshape(-1).index_select(0, slots).view(1, -1), attend, capture_layers)
            return hf.ForwardOutput(None, _unpack(hidden[0], slots, batch, num), None if layers is None else
                                    {i: _unpack(t[0], slots, batch, num) for i, t in layers.items()},
                                    (slots, hidden[0]))
        # node i of row b at cache column prefix[b] + i: one column range when every row holds `longest`
        # entries, else a scatter; either way the nodes are the last `num` of the row's kv_lens keys
        attend = TreeAttend(kv, self.lean.layers, tree_mask, kv_lens, None, longest,
                            positions=None if uniform else prefix.unsqueeze(1) + torch.arange(num, device=prefix.device))

        hidden, layers = self._run(tokens, positions, attend, capture_layers)
        return hf.ForwardOutput(None, hidden, layers)

    def logits(self, hidden: Tensor) -> Tensor:
        """The lm_head over hidden [..., H]."""
        return self.head(hidden)

    @staticmethod
    def capture_layers(specs: Iterable) -> Tuple[int, ...]:
        """The decoder layers whose inputs the drafters' feature specs ask for (see
        :attr:`taps.drafters.Drafter.target_features`: a tuple of layer indices for EAGLE-3 heads)."""
        return tuple(sorted({i for spec in specs if isinstance(spec, tuple) for i in spec}))

    @staticmethod
    def features(out: hf.ForwardOutput, spec) -> Optional[Tensor]:
        """What a drafter with feature spec `spec` reads of a forward's output: None, the final hidden
        states (``"final"``) or the inputs of the listed layers concatenated ([B, T, len * H])."""
        if spec is None:
            return None
        if spec == "final":
            return out.hidden_states
        return torch.cat([out.layers[i] for i in spec], dim=-1)

    def sample(self, logits: Tensor, *, uniforms: Optional[Tensor] = None, generator: Optional[torch.Generator] = None,
               **sample) -> Tensor:
        """One token per row from logits [B, V] (a prefill's), drawn as verification draws at a tree's
        root (``taps_ops.verify_tree`` of one-node trees): [B] int64."""
        one = torch.zeros((logits.shape[0], 1), dtype=torch.int64, device=logits.device)
        return taps_ops.verify_tree(logits.unsqueeze(1), one, one - 1, uniforms=uniforms, generator=generator,
                                    **sample).tokens[:, 0]

    @staticmethod
    def commit(cache: hf.TreeKVCache, path: Tensor, num_new: Tensor, validate: bool = True) -> None:
        """Commit each request's accepted path (``VerifyOutput.path`` [B, N]) after a tree forward:
        ``num_new [B]`` entries (the path's length, or 0 for a request whose path is only its root and
        that commits nothing); see :func:`taps.hf.compact_cache`."""
        hf.compact_cache(cache, path, num_new=num_new, validate=validate)

    def verify(self, hidden: Tensor, tokens: Tensor, parents: Tensor, tree_mask: Optional[Tensor] = None, *,
               lazy: Optional[bool] = None, uniforms: Optional[Tensor] = None,
               generator: Optional[torch.Generator] = None, packed: Optional[Tuple[Tensor, Tensor]] = None,
               **sample) -> taps_ops.VerifyOutput:
        """``taps_ops.verify_tree`` of trees [B, N] from the final hidden states [B, N, H] of a tree forward.

        The walk reads the logits of the nodes it visits only (the accepted path). ``lazy`` (default: on the
        CPU, for heads of at least :data:`LAZY_HEAD_MIN` weights not multiplied on AMX tiles
        (:meth:`taps.lean.Linear.tiles`), trees of :data:`LAZY_MIN_NODES` nodes or more and first-child chains of
        at most :data:`LAZY_MAX_CHAIN` of the real nodes) computes the lm_head for
        those rows instead of all N: first for each tree's *first-child chain* (the root, its best child, that
        child's best child, ...: siblings are ordered best first), then, when the walk reached a node whose row
        was not computed, for the chain below that node, and the walk is run again with the same coins until
        every node on its path was computed (an EAGLE tree of 16 nodes and depth 3 costs about 4 rows). The
        result is exactly that of the full-logits walk (the same rows, the same coins). On a GPU the full head
        is one cheap matrix product and needs no host decisions: the default there.
        ``tree_mask`` is not read (kept for callers that pass it).
        ``uniforms [B, N]``: the coins (default: drawn from `generator`). ``packed``: a packed forward's
        (slots, hidden [M, H]) (:attr:`hf.ForwardOutput.packed`): without the lazy head, the head runs over
        those M rows only (the other slots' logits, padding the walk never reads, are not written).
        """
        batch, num, _ = hidden.shape
        auto = lazy is None
        if auto:  # on the CPU, where the head is a large share of the step (not where it multiplies on AMX tiles,
            # whose 16-row product costs about a one-row one: bf16 chat 0.94 -> 1.02x of taps autoregressive without
            # the lazy head, merged-budget 0.84 -> 0.88x, AMX Xeon)
            lazy = (hidden.device.type == "cpu" and self.head.weight.numel() >= LAZY_HEAD_MIN and num >= LAZY_MIN_NODES
                    and not self.head.tiles(hidden))
        if uniforms is None:
            uniforms = torch.rand((batch, num), generator=generator, device=hidden.device, dtype=torch.float32)
        # greedy (temperature 0, drawn drafts or not): the head's argmax per row is all the walk reads
        greedy = _greedy(sample) and self.head.screens(hidden if packed is None else packed[1])
        if lazy and num > 1:
            ver = self._lazy_verify(hidden, tokens, parents, uniforms, sample, auto, greedy)
            if ver is not None:
                return ver
        if greedy:
            slots, rows = packed if packed is not None else (None, hidden.reshape(batch * num, -1))
            index = torch.arange(batch * num, device=rows.device) if slots is None else slots
            return self._onehot_verify(index, rows, (batch, num), tokens, parents, uniforms, sample)
        if packed is not None:
            slots, rows = packed
            logits = self.logits(rows)
            # the padding slots' logits are not written (B x N x V floats): the walk reads the rows of the
            # nodes it visits, real nodes only (a padding node has no parent)
            grid = self._kept("_logits_grid", batch * num * logits.shape[-1], logits.dtype, logits.device)
            # (each request's slots are one run: a slice copy each, bf16 8 x 12.5 rows of 8,192 logits 128 us
            # against 266 for index_copy_)
            _put_rows(grid.view(batch * num, -1), slots.tolist(), logits, slots)
            return taps_ops.verify_tree(grid.view(batch, num, -1), tokens, parents, uniforms=uniforms, **sample)
        return taps_ops.verify_tree(self.logits(hidden), tokens, parents, uniforms=uniforms, **sample)

    def _kept(self, name: str, size: int, dtype: torch.dtype, device: torch.device) -> Tensor:
        """`size` elements of the buffer kept in attribute `name` (zeros when new; kept for the next step up to
        :data:`LOGITS_GRID_KEEP` elements: a new one each step paid its pages' first touch, ~0.1 ms at 8 x 16 x
        8192). The logits grid (``_logits_grid``) holds earlier steps' logits (finite values): a walk reads the rows
        of the nodes it visits only, and those are written first. The one-hot grid (``_onehot``, bf16) is left
        zeroed by its users, which set ones and clear them again."""
        grid = getattr(self, name)
        if grid is None or grid.numel() < size or grid.dtype != dtype or grid.device != device:
            grid = torch.zeros(size, dtype=dtype, device=device)
            setattr(self, name, grid if size <= LOGITS_GRID_KEEP else None)
        return grid[:size]

    def _onehot_verify(self, index: Tensor, rows: Tensor, shape: Tuple[int, int], tokens: Tensor, parents: Tensor,
                       uniforms: Tensor, sample: dict) -> taps_ops.VerifyOutput:
        """Greedy verification from the head's argmax of hidden `rows` at flat [B * N] positions `index`: a bf16
        grid [B, N, V] of zeros with a one at each computed row's argmax (the walk reads visited rows only, and
        at temperature 0 a row's argmax is all it reads of it)."""
        batch, num = shape
        vocab = self.head.weight.shape[0]
        grid = self._kept("_onehot", batch * num * vocab, torch.bfloat16, rows.device)
        at = index * vocab + self.head.argmax(rows)
        grid.index_fill_(0, at, 1.0)
        try:
            return taps_ops.verify_tree(grid.view(batch, num, vocab), tokens, parents, uniforms=uniforms, **sample)
        finally:
            grid.index_fill_(0, at, 0.0)

    def _lazy_verify(self, hidden: Tensor, tokens: Tensor, parents: Tensor, uniforms: Tensor, sample: dict,
                     auto: bool, greedy: bool = False) -> Optional[taps_ops.VerifyOutput]:
        """:meth:`verify` with the lm_head computed for the rows the walk visits (see there); None when `auto`
        and the first-child chains hold more than :data:`LAZY_MAX_CHAIN` of the real nodes (the caller then
        computes every row)."""
        batch, num, width = hidden.shape
        # each node's first child (lowest index), on the host: ~1 us a node, against tens of tensor operations
        first = [[-1] * num for _ in range(batch)]
        real = 0
        for b, (row, toks) in enumerate(zip(parents.tolist(), tokens.tolist())):
            kids = first[b]
            for i in range(num - 1, 0, -1):
                if row[i] >= 0 and toks[i] >= 0:
                    kids[row[i]] = i
                    real += 1
        done = [[False] * num for _ in range(batch)]
        starts = [0] * batch  # the roots
        flat = hidden.reshape(batch * num, width)
        grid, marks = None, []
        vocab = self.head.weight.shape[0]
        try:
            while True:
                rows = []
                for b, node in enumerate(starts):
                    seen, kids = done[b], first[b]
                    while node >= 0:
                        if not seen[node]:
                            seen[node] = True
                            rows.append(b * num + node)
                        node = kids[node]
                if grid is None and auto and len(rows) - batch > LAZY_MAX_CHAIN * real:
                    return None  # (both counts without the roots)
                index = torch.tensor(rows, dtype=torch.int64, device=hidden.device)
                states = flat.index_select(0, index)
                if greedy:  # one-hot rows of the head's argmax (see _onehot_verify)
                    if grid is None:
                        grid = self._kept("_onehot", batch * num * vocab, torch.bfloat16, hidden.device)
                    marks.append(index * vocab + self.head.argmax(states))
                    grid.index_fill_(0, marks[-1], 1.0)
                else:
                    logits = self.logits(states)
                    if grid is None:
                        grid = self._kept("_logits_grid", batch * num * logits.shape[-1], logits.dtype,
                                          logits.device)
                    _put_rows(grid.view(batch * num, -1), rows, logits, index)
                ver = taps_ops.verify_tree(grid.view(batch, num, -1), tokens, parents, uniforms=uniforms, **sample)
                # per request, the first node of its path whose row is missing (-1: none): its chain is computed next
                starts = [next((node for node in path if node >= 0 and not seen[node]), -1)
                          for path, seen in zip(ver.path.tolist(), done)]
                if max(starts) < 0:
                    return ver
        finally:
            for at in marks:
                grid.index_fill_(0, at, 0.0)


def _greedy(sample: dict) -> bool:
    """Whether verification with these settings is greedy: temperature 0 for every request (a scalar, or a CPU
    tensor of zeros). Drawn drafts (``draft_probs``) too: at temperature 0 the walk takes the argmax and reads no
    proposal (an n-gram table's drafts are drawn at T = 0; their full head cost 0.56 ms a step at a batch of 8 x 4
    nodes, fp32, against 0.22 for the argmax)."""
    temperature = sample.get("temperature", 0.0)
    if isinstance(temperature, Tensor):
        return temperature.device.type == "cpu" and not bool(temperature.any())
    return float(temperature) == 0.0


def _unpack(rows: Tensor, slots: Tensor, batch: int, num: int) -> Tensor:
    """Packed rows [M, F] at their `slots` of a [batch, num, F] grid, zeros elsewhere."""
    return rows.new_zeros((batch * num, rows.shape[-1])).index_copy_(0, slots, rows).view(batch, num, -1)


#: the most runs of consecutive rows :func:`_put_rows` copies one by one (more: one index_copy_, unless the runs
#: hold PUT_ROWS_RUN_LENGTH rows or more each on average)
PUT_ROWS_RUNS = 4
PUT_ROWS_RUN_LENGTH = 4


def _put_rows(grid: Tensor, rows: Sequence[int], values: Tensor, index: Tensor) -> None:
    """grid[rows[i]] = values[i] (host ints `rows`, `index` the same as a tensor): a slice copy per run of
    consecutive rows when there are few or they are long (a run's copy costs a few microseconds; ``index_copy_``
    of 8 bf16 rows of 8,192 logits 29 us against 5; of a packed batch's 100 rows in 8 runs 266 us against 128),
    else one ``index_copy_``."""
    runs, start = [], 0
    for i in range(1, len(rows) + 1):
        if i == len(rows) or rows[i] != rows[i - 1] + 1:
            runs.append((start, i))
            start = i
    if len(runs) > PUT_ROWS_RUNS and len(rows) < PUT_ROWS_RUN_LENGTH * len(runs):
        grid.index_copy_(0, index, values)
        return
    for a, b in runs:
        grid[rows[a]:rows[a] + b - a].copy_(values[a:b])
