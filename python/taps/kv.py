"""K/V caches and attention masks: the plumbing under the lean layers (:mod:`taps.lean`) and the Hugging Face
path (:mod:`taps.hf`).

- :class:`TreeKVCache`: a transformers ``Cache`` with preallocated per-layer K and V tensors
  ``[B, Hkv, max_len, D]`` and per-request lengths ``lengths [B]`` (ragged batches; compacted in place by
  ``taps_ops.compact_kv``), used by both paths. Its layout is :mod:`taps.hf`'s module docstring's.
- :func:`write_kv`: the one K/V write of the Python side: new ``k, v [R, T, Hkv, D]`` into caches
  ``[R, Hkv, S, D]`` at columns ``start .. start + T - 1`` of every row (a copy) or at per-row positions (a
  scatter, for ragged rows). ``taps_ops.decoder_layer``'s ``write_start`` / ``write_positions`` are the
  same two writes in C++. :func:`kv_writer` binds it to one call site's positions.
- Attention callbacks over such caches (the ``Attend`` of :mod:`taps.lean`): :class:`TreeAttend` (one
  ``taps_ops.tree_attention`` call per layer, and the whole layer as one ``taps_ops.decoder_layer`` call
  through :meth:`TreeAttend.fused_layer`), :func:`cache_attend` (a dense bool mask and SDPA, or a
  :class:`NodeMask` through TreeAttend).
- Masks in ``taps_ops``' bit form: :func:`pack_bits`, :func:`causal_bits`, :class:`NodeMask`; the positions
  and causal mask of an append (:func:`causal_append`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor

import taps_ops

from transformers.cache_utils import Cache, CacheLayerMixin

__all__ = ["TreeKVCache", "write_kv", "kv_writer", "TreeAttend", "cache_attend", "NodeMask", "pack_bits",
           "causal_bits", "causal_append", "grown_length"]


def grown_length(size: int, need: int) -> int:
    """Positions of a cache of `size` that must hold `need`: at least `need`, and at least a quarter more than
    `size`, so that a run of ever longer needs copies the cache a few times, not once each."""
    return max(int(need), size + (size + 3) // 4)


def write_kv(keys: Tensor, values: Tensor, k: Tensor, v: Tensor, *, start: Optional[int] = None,
             positions: Optional[Tensor] = None, rows: Optional[Tensor] = None) -> None:
    """Write new K/V ``k, v [R, T, Hkv, D]`` into caches ``keys, values [R, Hkv, S, D]``: at columns
    ``start .. start + T - 1`` of every row when ``start`` is given (a plain copy, for rows that all hold
    ``start`` entries), else at per-row positions ``positions [R, T]`` (a scatter; ``rows`` = arange(R)[:, None]
    when the caller keeps one)."""
    if start is not None:
        stop = start + k.shape[1]
        keys[:, :, start:stop] = k.transpose(1, 2)
        values[:, :, start:stop] = v.transpose(1, 2)
        return
    if positions is None:
        raise ValueError("write_kv: give positions or start")
    if rows is None:
        rows = torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
    # advanced indices around a slice: the indexed view is [R, T, Hkv, D]
    keys[rows, :, positions] = k
    values[rows, :, positions] = v


class _WriteState(NamedTuple):
    positions: Tensor         # [B, T] int64 cache position of each new token
    kv_span: Optional[int]    # update() returns positions [0, kv_span); None: the full tensors


class _SharedState:
    """What every layer of one TreeKVCache needs to know about the forward in progress."""

    def __init__(self, batch_size: int, device: torch.device):
        self.lengths = torch.zeros(batch_size, dtype=torch.int64, device=device)
        self.rows = torch.arange(batch_size, device=device).unsqueeze(1)  # [B, 1]
        self.write: Optional[_WriteState] = None


class _TreeKVLayer(CacheLayerMixin):
    """One layer of a :class:`TreeKVCache`: preallocated keys and values [B, Hkv, max_len, D]."""

    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, state: _SharedState, keys: Tensor, values: Tensor):
        super().__init__()
        self._state = state
        #: keys / values are views of the first B rows of these (rows past B: left by requests that finished,
        #: taken by those that join; see TreeKVCache.select_requests / append_requests)
        self.storage = {"keys": keys, "values": values}
        self.keys = keys
        self.values = values
        self.device = keys.device
        self.dtype = keys.dtype
        self.is_initialized = True

    def lazy_initialization(self, key_states: Tensor, value_states: Optional[Tensor] = None) -> None:
        pass  # preallocated

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs):
        """Write key/value_states [B, Hkv, T, D] at each request's positions; return the K/V to attend."""
        write = self._state.write
        if write is None:
            raise RuntimeError("TreeKVCache is written only through taps.hf.prefill / tree_verify_forward, "
                               "which set each request's write positions")
        if key_states.shape[2] != write.positions.shape[1]:
            raise ValueError(f"TreeKVCache: {key_states.shape[2]} new tokens, expected {write.positions.shape[1]}")
        write_kv(self.keys, self.values, key_states.transpose(1, 2).to(self.dtype),
                 value_states.transpose(1, 2).to(self.dtype), positions=write.positions, rows=self._state.rows)
        if write.kv_span is None:
            return self.keys, self.values
        return self.keys[:, :, :write.kv_span], self.values[:, :, :write.kv_span]

    def get_mask_sizes(self, query_length, *args, **kwargs):
        # (kv_length, kv_offset); transformers 4.x passes cache_position [T] instead of the length T.
        write = self._state.write
        if write is not None and write.kv_span is not None:
            return write.kv_span, 0
        if isinstance(query_length, Tensor):
            query_length = query_length.shape[0]
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self, *args, **kwargs) -> int:
        return int(self._state.lengths.max()) if self._state.lengths.numel() else 0

    def get_max_length(self) -> int:
        return self.keys.shape[2]

    get_max_cache_shape = get_max_length  # the transformers 4.x name

    def reset(self) -> None:
        self.storage["keys"].zero_()
        self.storage["values"].zero_()
        self._state.lengths.zero_()


class TreeKVCache(Cache):
    """Preallocated K/V cache with a length per request, for ragged batches and tree verification.

    Every layer holds ``keys``, ``values`` [B, Hkv, max_len, D] (``cache.layers[i].keys``); request b's
    committed entries are positions ``0 .. lengths[b]-1``. Written through the lean forwards' attention
    callbacks or, on the Hugging Face path, only through :func:`taps.hf.prefill` and
    :func:`taps.hf.tree_verify_forward`; :func:`taps.hf.compact_cache` commits a verified path.

    Args:
        config: the model's config (its text config is used for multimodal ones).
        batch_size: B.
        max_len: positions per request (prompt + generated + one tree of N nodes must fit).
        dtype, device: of the K/V tensors; must match the model's.
    """

    def __init__(self, config, batch_size: int, max_len: int, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu"):
        text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_layers = text_config.num_hidden_layers
        num_heads = text_config.num_attention_heads
        num_kv_heads = getattr(text_config, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // num_heads
        device = torch.device(device)
        state = _SharedState(batch_size, device)
        shape = (batch_size, num_kv_heads, max_len, head_dim)
        layers = [_TreeKVLayer(state, torch.zeros(shape, dtype=dtype, device=device),
                               torch.zeros(shape, dtype=dtype, device=device)) for _ in range(num_layers)]
        super().__init__(layers=layers)
        self._state = state
        self.max_len = max_len

    @classmethod
    def for_model(cls, model: torch.nn.Module, batch_size: int, max_len: int) -> "TreeKVCache":
        """A cache matching `model`'s config, dtype and device."""
        param = next(model.parameters())
        return cls(model.config, batch_size, max_len, dtype=param.dtype, device=param.device)

    @property
    def lengths(self) -> Tensor:
        """[B] int64 committed positions per request (updated in place by the helpers)."""
        return self._state.lengths

    def select_requests(self, index: Tensor) -> None:
        """Keep only the requests `index` ([B'] int64 positions, in that order), in place.

        The K/V tensors are views of the first B rows of storage that keeps its rows when requests leave
        (a request that joins later takes them, see :meth:`append_requests`); only the rows whose position
        changes are copied (one per request that left when the last rows fill the holes, as
        :class:`taps.batching.ContinuousBatch` orders them)."""
        index = index.to(self.lengths.device)
        kept = index.shape[0]
        on_host = index.device.type == "cpu"   # (elsewhere the positions are not read back: one gather, no sync)
        moved = [i for i, src in enumerate(index.tolist()) if src != i] if on_host else None
        if moved:
            dst = torch.tensor(moved, dtype=torch.int64, device=index.device)
            src = index.index_select(0, dst)
        for layer in self.layers:
            for name in ("keys", "values"):
                store = layer.storage[name]
                if moved:  # every source row is read before any row is written
                    store.index_copy_(0, dst, store.index_select(0, src))
                elif not on_host:
                    store[:kept] = store.index_select(0, index)
                setattr(layer, name, store[:kept])
        self._state.lengths = self._state.lengths.index_select(0, index)
        self._state.rows = torch.arange(kept, device=index.device).unsqueeze(1)

    def append_requests(self, other: "TreeKVCache") -> None:
        """Add the requests of `other` (a cache of the same model) after this cache's, in place; the cache
        then holds at least the larger of the two capacities.

        The new rows go to storage rows that requests have left when there are enough (nothing else is
        copied); otherwise the storage grows to exactly the rows needed, and by at least a quarter of its
        positions when `other` holds more (so that a run of ever longer prompts copies the cache a few
        times, not once per request)."""
        batch, extra = self.lengths.shape[0], other.lengths.shape[0]
        rows_cap = self.layers[0].storage["keys"].shape[0] if self.layers else 0
        max_len = self.max_len
        grow = other.max_len > max_len
        if grow:
            max_len = grown_length(max_len, other.max_len)
        for mine, theirs in zip(self.layers, other.layers):
            for name in ("keys", "values"):
                store, b = mine.storage[name], getattr(theirs, name)
                if grow or batch + extra > rows_cap:
                    new = store.new_zeros((batch + extra, store.shape[1], max_len, store.shape[3]))
                    new[:batch, :, :store.shape[2]] = store[:batch]
                    store = mine.storage[name] = new
                else:
                    store[batch:batch + extra, :, b.shape[2]:].zero_()
                store[batch:batch + extra, :, :b.shape[2]] = b
                setattr(mine, name, store[:batch + extra])
        self._state.lengths = torch.cat([self._state.lengths, other.lengths.to(self._state.lengths.device)])
        self._state.rows = torch.arange(self._state.lengths.shape[0], device=self._state.lengths.device).unsqueeze(1)
        self.max_len = max_len

    def kv_tensors(self) -> List[Tensor]:
        """K and V of every layer, [B, Hkv, max_len, D] each: the `caches` list of taps_ops.compact_kv."""
        out: List[Tensor] = []
        for layer in self.layers:
            out += [layer.keys, layer.values]
        return out

    @contextlib.contextmanager
    def writing(self, positions: Tensor, kv_span: Optional[int]) -> Iterator[None]:
        """The Hugging Face path's writes while the block runs: each layer's ``update`` writes its new K/V at
        ``positions [B, T]`` and returns the first ``kv_span`` columns (None: all)."""
        self._state.write = _WriteState(positions, kv_span)
        try:
            yield
        finally:
            self._state.write = None


def kv_writer(positions: Optional[Tensor] = None, start: Optional[int] = None) -> Callable[..., None]:
    """``write(keys, values, k, v)``: :func:`write_kv` at per-row positions ``positions [R, T]`` or, when
    ``start`` is given (it takes precedence), at columns ``start .. start + T - 1`` of every row."""
    if start is None and positions is None:
        raise ValueError("kv_writer: give positions or start")
    rows = None if start is not None else torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)

    def write(keys: Tensor, values: Tensor, k: Tensor, v: Tensor) -> None:
        write_kv(keys, values, k, v, start=start, positions=positions, rows=rows)
    return write


class TreeAttend:
    """An :data:`Attend` callback over per-layer caches ``kv[i] = (keys, values)`` [R, Hkv, S, D]: the new K/V
    go to columns ``start .. start + T - 1`` of every row (a plain copy) or, with ``positions`` [R, T], to
    each row's own columns (a scatter, for ragged rows); attention is one ``taps_ops.tree_attention`` call
    (bits [R, N, W], kv_lens [R], tree_nodes T or None: see :class:`NodeMask`). :func:`decoder_layer`
    takes :meth:`fused_layer` to run the whole layer as one ``taps_ops.decoder_layer`` call.

    Packed (``packed = (slots [M], columns [M])``, a ragged batch of trees without its padding nodes): the layer
    computes only M of the R x T query slots (slot ``r * T + t``, T = ``bits.shape[1]``; q, k, v are then
    [1, M, H*, D]); their K/V go to cache row ``slot // T``, column ``columns[m]``; the attention runs over the
    [R, T] grid with zero queries at the other slots (each row's queries up to its last packed slot only:
    ``num_queries``, as the op derives them), and the M slots' outputs are returned ([1, Hq, M, D])."""

    __slots__ = ("kv", "scales", "bits", "kv_lens", "tree_nodes", "start", "positions", "rows", "packed", "cache_rows",
                 "live")

    def __init__(self, kv: Sequence[Sequence[Tensor]], layers: Sequence, bits: Tensor, kv_lens: Tensor,
                 tree_nodes: Optional[int], start: int, positions: Optional[Tensor] = None,
                 packed: Optional[Tuple[Tensor, Tensor]] = None):
        self.kv, self.scales = kv, [w.scale for w in layers]
        self.bits, self.kv_lens, self.tree_nodes, self.start = bits, kv_lens, tree_nodes, int(start)
        self.positions = positions
        self.rows = None if positions is None else torch.arange(positions.shape[0], device=positions.device).unsqueeze(1)
        self.packed = packed
        self.cache_rows = None if packed is None else packed[0].div(bits.shape[1], rounding_mode="floor")
        self.live = None if packed is None else torch.zeros(bits.shape[0], dtype=torch.int64, device=bits.device) \
            .scatter_reduce_(0, self.cache_rows, packed[0].remainder(bits.shape[1]) + 1, "amax")

    def __call__(self, i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = self.kv[i]
        if self.packed is not None:  # the operators of taps_ops.decoder_layer's packed path, in its order
            slots, columns = self.packed
            keys[self.cache_rows, :, columns] = k[0]
            values[self.cache_rows, :, columns] = v[0]
            rows, per_row = keys.shape[0], self.bits.shape[1]
            heads, dim = q.shape[2], q.shape[3]
            grid = q.new_zeros((rows * per_row, heads, dim))
            grid.index_copy_(0, slots, q[0])
            out = taps_ops.tree_attention(grid.view(rows, per_row, heads, dim).transpose(1, 2), keys, values, self.bits,
                                          self.kv_lens, self.scales[i], validate=False, tree_nodes=self.tree_nodes,
                                          num_queries=self.live)
            picked = out.transpose(1, 2).reshape(rows * per_row, heads * dim).index_select(0, slots)
            return picked.view(1, -1, heads, dim).transpose(1, 2)
        write_kv(keys, values, k, v, start=self.start if self.positions is None else None, positions=self.positions,
                 rows=self.rows)
        return taps_ops.tree_attention(q.transpose(1, 2), keys, values, self.bits, self.kv_lens, self.scales[i],
                                       validate=False, tree_nodes=self.tree_nodes)

    def fused_layer(self, op_args: Tuple[list, list, list], i: int, x: Tensor, emb: Optional[Tensor], cos: Tensor,
                    sin: Tensor) -> Tensor:
        """Layer i as one taps_ops.decoder_layer call (op_args: :attr:`taps.lean.LayerWeights.op_args`): the
        fused path an attention callback may offer :func:`taps.lean.decoder_layer`."""
        keys, values = self.kv[i]
        weights, eps, dims = op_args
        if self.packed is not None:
            return taps_ops.decoder_layer(x, weights, eps, dims, cos, sin, keys, values, self.start, self.bits,
                                          self.kv_lens, self.scales[i], tree_nodes=self.tree_nodes, emb=emb,
                                          write_positions=self.packed[1], rows=self.packed[0])
        return taps_ops.decoder_layer(x, weights, eps, dims, cos, sin, keys, values, self.start, self.bits, self.kv_lens,
                                      self.scales[i], tree_nodes=self.tree_nodes, emb=emb, write_positions=self.positions)


class NodeMask(NamedTuple):
    """Visibility of T new keys that follow each row's fully visible prefix, for N queries
    (``taps_ops.tree_attention``'s form): the mask a drafter's expansion level (the queries are the newest
    N of the T nodes drafted so far, each sees its ancestors) or an append of N = T tokens (causal) needs,
    without a dense [R, 1, N, S] bool mask.

    bits: [R, N, W] int64, bit j of word j // 64 of row i = query i sees new key j (W >= ceil(T / 64)).
    kv_lens: [R] int64, keys per row (prefix + T; the new keys are the last T of them).
    tree_nodes: T.
    """

    bits: Tensor
    kv_lens: Tensor
    tree_nodes: int


def pack_bits(dense: Tensor, words: Optional[int] = None) -> Tensor:
    """Bool [..., T] -> int64 [..., W] words, bit j of word j // 64 = dense[..., j] (taps_ops' tree-mask
    form); W = ceil(T / 64) (at least 1) unless given."""
    num = dense.shape[-1]
    words = max((num + 63) // 64, 1) if words is None else words
    padded = F.pad(dense, (0, words * 64 - num)).view(*dense.shape[:-1], words, 64)
    bit = torch.arange(64, device=dense.device)
    return (padded.long() << bit).sum(-1)  # distinct bits, so sum == or (bit 63 wraps to the sign bit)


_CAUSAL_BITS: Dict[Tuple[int, torch.device], Tensor] = {}


def causal_bits(tokens: int, device: torch.device) -> Tensor:
    """[T, ceil(T / 64)] int64 bit rows of a causal mask over T tokens (row i: bits 0..i), cached."""
    key = (int(tokens), torch.device(device))
    bits = _CAUSAL_BITS.get(key)
    if bits is None:
        bits = _CAUSAL_BITS[key] = pack_bits(torch.ones(tokens, tokens, dtype=torch.bool).tril()).to(device)
    return bits


def cache_attend(kv: Sequence[Sequence[Tensor]], layers: Sequence, mask: Union[Tensor, NodeMask], *,
                 positions: Optional[Tensor] = None, start: Optional[int] = None) -> Callable[..., Tensor]:
    """An ``attend`` callback over preallocated per-layer caches ``kv[i] = (keys, values)`` [R, Hkv, S, D].

    Each layer's new K/V ([R, T, Hkv, D]) are written at per-row positions ``positions [R, T]`` (committed
    tokens of ragged rows) or, with ``start`` (which takes precedence), at columns ``start .. start + T - 1``
    of every row (a plain copy; see :func:`kv_writer`); then attention runs over the first
    ``S' = mask.shape[-1]`` columns with the bool mask ``[R, 1, T, S']`` (True = visible), or, with a
    :class:`NodeMask`, as one ``taps_ops.tree_attention`` call (no dense mask, no SDPA).
    """
    if isinstance(mask, NodeMask):
        if start is None and positions is None:
            raise ValueError("cache_attend: give positions or start")
        return TreeAttend(kv, layers, mask.bits, mask.kv_lens, mask.tree_nodes, 0 if start is None else start,
                          positions=positions if start is None else None)
    write = kv_writer(positions, start)
    span = int(mask.shape[-1])

    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        keys, values = kv[i]
        write(keys, values, k, v)
        w = layers[i]
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, :span], values[:, :, :span],
                                              attn_mask=mask, scale=w.scale, enable_gqa=w.heads != w.kv_heads)
    return attend


def causal_append(lengths: Tensor, longest: int, num_tokens: int) -> Tuple[Tensor, Tensor]:
    """Positions [R, T] and the causal mask [R, 1, T, S] (S = longest + T) for appending T tokens to rows
    holding ``lengths [R]`` committed entries (``longest`` = max(lengths), known on the host): token t of
    row r goes to position lengths[r] + t and sees every key up to it."""
    positions = lengths.unsqueeze(1) + torch.arange(num_tokens, device=lengths.device)
    span = longest + num_tokens
    mask = (torch.arange(span, device=lengths.device) <= positions.unsqueeze(-1)).unsqueeze(1)
    return positions, mask
