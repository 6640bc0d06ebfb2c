"""Tree verification for Hugging Face causal LMs through the taps_ops kernels.

A target model (LlamaForCausalLM first; Qwen2, Qwen3 and Mistral share its attention code) verifies a
whole draft tree in one forward pass. Three pieces make that work:

- :func:`register_taps_attention` registers an attention function named ``"taps"`` with the
  transformers attention interface. Outside a tree context it is plain ``"sdpa"``; inside one
  (:func:`tree_attention_context`, set by :func:`tree_verify_forward`) it calls
  :func:`taps_ops.tree_attention` on the cache's full per-layer K/V tensors, so each tree node attends
  to the request's prefix and to its own ancestors only.
- :class:`TreeKVCache` (defined in :mod:`taps.kv`, which the lean path shares), a transformers ``Cache``
  with preallocated per-layer K and V tensors
  ``[B, Hkv, max_len, D]`` and per-request lengths ``lengths [B]``, so that requests of different
  lengths share one batch and :func:`taps_ops.compact_kv` can update it in place.
- the forward helpers :func:`prefill` (ragged prompts, also plain decode steps),
  :func:`tree_verify_forward` and :func:`compact_cache`.

Cache layout. ``cache.lengths[b]`` entries of request b are committed: positions ``0 .. lengths[b]-1``
of every layer hold the K/V of its tokens, in order, and position p has rotary position p. Positions at
or past ``lengths[b]`` hold scratch data. One decoding step is::

    out = prefill(model, cache, prompt_ids, prompt_lens)      # lengths = prompt_lens
    root = out.logits.argmax(-1)                              # last committed token, not yet cached
    # draft a tree per request whose node 0 is `root` ...
    out = tree_verify_forward(model, cache, tree.tokens, tree.tree_mask, tree.depth)
    ver = taps_ops.verify_tree(out.logits, tree.tokens, tree.parents)
    compact_cache(cache, ver.path)       # lengths += num_accepted + 1 (the root and accepted drafts)
    # the bonus token ver.tokens[b, ver.num_accepted[b]] is the next root

The tree forward writes node i of request b at position ``lengths[b] + i`` (the layout compact_kv
expects) with rotary position ``lengths[b] + depth[b, i]``; ``lengths`` is left unchanged until
:func:`compact_cache` moves the accepted path (root first) next to the prefix and advances it.

Ragged prompts are right padded: ``input_ids [B, T]`` with ``num_new [B]`` real tokens per row. Every
row writes T entries starting at its own length, so each row's real tokens land at consecutive positions
and its padding lands past its new length, where it is scratch that later writes overwrite; the
attention mask is causal in each request's own positions, so real tokens never see padding.

Limits: attention is computed from the cache as written (no sliding window beyond the checks below, no
logit soft-capping); logits are ``lm_head(final hidden state)``, as in Llama, Qwen2/3 and Mistral.
Works with the layered ``Cache`` API of transformers >= 4.56 and 5.x.
"""

from __future__ import annotations

import contextlib
import contextvars
import inspect
from typing import Dict, Iterator, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

import taps_ops

from .kv import TreeKVCache

from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

try:  # transformers >= 4.53 builds masks through a registry keyed by the attention name
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
except ImportError:  # pragma: no cover - older transformers
    AttentionMaskInterface = None
    sdpa_mask = None

__all__ = [
    "TAPS_ATTENTION", "register_taps_attention", "use_taps_attention", "tree_attention_context", "masked_forward",
    "taps_attention_forward", "TreeKVCache", "ForwardOutput", "prefill", "tree_verify_forward",
    "compact_cache",
]

#: Name under which the attention function is registered (``attn_implementation="taps"``).
TAPS_ATTENTION = "taps"


# ---------------------------------------------------------------------------------------------------
# The attention hook
# ---------------------------------------------------------------------------------------------------

class _ForwardContext(NamedTuple):
    tree_mask: Optional[Tensor]  # [B, N, W] int64 ancestor bitmask; None: causal (sdpa) attention
    kv_lens: Optional[Tensor]    # [B] int64, prefix length + N (tree forwards only)
    max_kv_len: int              # the longest context any query sees, known on the host
    validate: bool = True        # taps_ops.tree_attention's kv_lens check (a device sync per layer on CUDA)


_CONTEXT: contextvars.ContextVar[Optional[_ForwardContext]] = contextvars.ContextVar(
    "taps_forward_context", default=None)


@contextlib.contextmanager
def _forward_context(ctx: _ForwardContext) -> Iterator[None]:
    token = _CONTEXT.set(ctx)
    try:
        yield
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def tree_attention_context(tree_mask: Tensor, kv_lens: Tensor, max_kv_len: Optional[int] = None,
                           validate: bool = True) -> Iterator[None]:
    """Within this context the ``"taps"`` attention runs tree attention instead of sdpa.

    Args:
        tree_mask: [B, N, ceil(N / 64)] int64 ancestor bitmask of the N query tokens.
        kv_lens: [B] int64; request b's keys are the first kv_lens[b] positions of the K/V the cache
            returns, the last N of them the tree nodes 0..N-1 (see :func:`taps_ops.tree_attention`).
        max_kv_len: max(kv_lens) if the caller knows it (saves a device sync); used only to check that
            a sliding-window layer's window covers every key.
        validate: let every layer's tree_attention check kv_lens (on CUDA one device sync per layer);
            False when the caller has checked N <= kv_lens <= S once, as tree_verify_forward does.
    """
    if max_kv_len is None:
        max_kv_len = int(kv_lens.max()) if kv_lens.numel() else 0
    with _forward_context(_ForwardContext(tree_mask, kv_lens, int(max_kv_len), validate)):
        yield


def _check_window(kwargs: dict, max_kv_len: int) -> None:
    # Our masks never hide keys by distance: fine as long as a sliding window covers the whole context.
    window = kwargs.get("sliding_window")
    if window is not None and max_kv_len > window:
        raise NotImplementedError(
            f"taps attention: a sliding-window layer (window {window}) would need to hide keys of a "
            f"{max_kv_len}-token context; only contexts within the window are supported")


def taps_attention_forward(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor,
                           attention_mask: Optional[Tensor], scaling: Optional[float] = None,
                           dropout: float = 0.0, **kwargs):
    """Attention function registered as ``"taps"`` (transformers' attention-interface signature).

    query [B, Hq, T, D]; key, value [B, Hkv, S, D] as returned by the cache's ``update``.
    Returns (out [B, T, Hq, D], None). Without a tree context this is transformers' sdpa attention.
    """
    ctx = _CONTEXT.get()
    if ctx is None or ctx.tree_mask is None:
        if ctx is not None:
            _check_window(kwargs, ctx.max_kv_len)
        return ALL_ATTENTION_FUNCTIONS["sdpa"](module, query, key, value, attention_mask,
                                               scaling=scaling, dropout=dropout, **kwargs)
    if dropout:
        raise ValueError("taps attention: tree verification runs without dropout (call model.eval())")
    if kwargs.get("softcap") is not None:
        raise NotImplementedError("taps attention: attention logit soft-capping is not supported")
    _check_window(kwargs, ctx.max_kv_len)
    if query.shape[2] != ctx.tree_mask.shape[1]:
        raise ValueError(f"taps attention: {query.shape[2]} query tokens but the tree context has "
                         f"{ctx.tree_mask.shape[1]} nodes")
    out = taps_ops.tree_attention(query, key, value, ctx.tree_mask, ctx.kv_lens, scaling, validate=ctx.validate)
    return out.transpose(1, 2).contiguous(), None


def register_taps_attention(name: str = TAPS_ATTENTION) -> str:
    """Register the ``"taps"`` attention (and its mask builder, that of sdpa) with transformers.

    Idempotent. Load a model with ``attn_implementation="taps"`` afterwards, or call
    :func:`use_taps_attention` on a loaded one. Returns the registered name.
    """
    AttentionInterface.register(name, taps_attention_forward)
    if AttentionMaskInterface is not None:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


def use_taps_attention(model: torch.nn.Module, name: str = TAPS_ATTENTION) -> torch.nn.Module:
    """Register the hook and switch a loaded model to it. Returns the model."""
    register_taps_attention(name)
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(name)
    else:  # pragma: no cover - older transformers
        model.config._attn_implementation = name
    return model


# ---------------------------------------------------------------------------------------------------
# The cache
# ---------------------------------------------------------------------------------------------------

# ---------------------------------------------------------------------------------------------------
# Forward helpers
# ---------------------------------------------------------------------------------------------------

class ForwardOutput(NamedTuple):
    """logits: see the helper; hidden_states: [B, T, H] final (normalised) hidden states, the input of
    lm_head, as EAGLE-style feature drafters consume them; None unless asked for; layers: {i: [B, T, H]
    the input of decoder layer i} for the layers asked for (``capture_layers``; EAGLE-3 heads read
    three of them), else None; packed: a packed tree forward's (slots [M], final hidden states [M, H]) of
    its real nodes (``TargetForward.tree``: hidden_states then holds them at their slots, zeros elsewhere),
    else None."""

    logits: Optional[Tensor]
    hidden_states: Optional[Tensor]
    layers: Optional[Dict[int, Tensor]] = None
    packed: Optional[Tuple[Tensor, Tensor]] = None


_CACHE_KWARG: dict = {}


def _cache_kwarg(module: torch.nn.Module) -> str:
    # transformers 5.x names the argument `cache` (past_key_values is deprecated); 4.x `past_key_values`.
    cls = type(module)
    if cls not in _CACHE_KWARG:
        params = inspect.signature(module.forward).parameters
        _CACHE_KWARG[cls] = "cache" if "cache" in params else "past_key_values"
    return _CACHE_KWARG[cls]


def _decoder(model: torch.nn.Module) -> torch.nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, getattr(model, "base_model_prefix", "model"))
    return decoder


def check_capture_layers(model, layers: Sequence[int]) -> None:
    """ValueError unless every index is a decoder layer of `model` (0 <= i < num_hidden_layers: its input)
    or num_hidden_layers (the final normalised hidden state, as ``output_hidden_states`` numbers it)."""
    if not layers:  # (every forward asks; reading the config costs about 20 us)
        return
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    n = int(text.num_hidden_layers)
    bad = [i for i in layers if not 0 <= int(i) <= n]
    if bad:
        raise ValueError(f"capture_layers: layer indices {bad} outside [0, {n}] for this {n}-layer model")


def _run_decoder(model, cache: TreeKVCache, input_ids: Tensor, position_ids: Tensor, mask: Tensor,
                 capture_layers: Sequence[int] = ()):
    """(final hidden [B, T, H], {i: input of layer i} for capture_layers, or None)."""
    decoder = _decoder(model)
    kwargs = {"output_hidden_states": True} if capture_layers else {}
    out = decoder(input_ids=input_ids, position_ids=position_ids, attention_mask=mask, use_cache=True,
                  **{_cache_kwarg(decoder): cache}, **kwargs)
    if not capture_layers:
        return out[0], None
    check_capture_layers(model, capture_layers)
    # hidden_states[i] is the input of layer i (0: the embeddings); the last entry is normalised
    return out[0], {int(i): out.hidden_states[int(i)] for i in capture_layers}


def _lm_head(model) -> torch.nn.Module:
    return model.get_output_embeddings()


def _check_model(model) -> None:
    impl = getattr(model.config, "_attn_implementation", None)
    if impl != TAPS_ATTENTION:
        raise ValueError(f"taps.hf: the model's attention implementation is {impl!r}; call "
                         "use_taps_attention(model) or load it with attn_implementation='taps'")


def masked_forward(model, cache: TreeKVCache, input_ids: Tensor, write_positions: Tensor, position_ids: Tensor,
                   mask: Tensor, capture_layers: Sequence[int] = ()):
    """One decoder forward with an explicit attention mask (the building block of prefill and of drafters'
    tree expansion).

    Args:
        input_ids: [B, T] tokens; write_positions: [B, T] cache position each token's K/V is written to;
        position_ids: [B, T] rotary positions; mask: [B, 1, T, S] bool, True = query t sees key s, over
        the first S cache positions (S <= cache.max_len).

    Returns:
        hidden [B, T, H]: the final normalised hidden states (apply the model's lm_head for logits); with
        ``capture_layers``, (hidden, {i: input of layer i}). cache.lengths is not changed.
    """
    kv_span = int(mask.shape[-1])
    with cache.writing(write_positions, kv_span), _forward_context(_ForwardContext(None, None, kv_span)):
        hidden, layers = _run_decoder(model, cache, input_ids, position_ids, mask, capture_layers)
    return (hidden, layers) if capture_layers else hidden


def prefill(model, cache: TreeKVCache, input_ids: Tensor, num_new: Optional[Tensor] = None, *,
            all_logits: bool = False, return_hidden: bool = False, capture_layers: Sequence[int] = ()) -> ForwardOutput:
    """Append tokens to every request of the cache with causal attention (a prompt, or a decode step).

    Args:
        model: a causal LM using the ``"taps"`` attention.
        cache: its :class:`TreeKVCache`; request b's tokens go to positions lengths[b] + t.
        input_ids: [B, T] int64, right padded (padding values are ignored; -1 is allowed).
        num_new: [B] int64 real tokens per row (1 <= num_new[b] <= T); default T for every row.
        all_logits: return logits for all T tokens ([B, T, V]) instead of the last real one ([B, V]).
        return_hidden: also return the final hidden states [B, T, H].
        capture_layers: also return the inputs of these decoder layers ([B, T, H] each).

    Returns:
        ForwardOutput; cache.lengths is advanced by num_new.
    """
    _check_model(model)
    batch, num_tokens = input_ids.shape
    lengths = cache.lengths
    device = lengths.device
    if num_new is None:
        num_new = torch.full((batch,), num_tokens, dtype=torch.int64, device=device)
    num_new = num_new.to(device=device, dtype=torch.int64)
    positions = lengths.unsqueeze(1) + torch.arange(num_tokens, device=device)  # [B, T]
    kv_span = int(lengths.max()) + num_tokens
    if kv_span > cache.max_len:
        raise ValueError(f"taps.hf.prefill: {kv_span} positions needed, the cache holds {cache.max_len}")
    # Causal in each request's own positions: key j is visible to new token t iff j <= lengths[b] + t.
    mask = (torch.arange(kv_span, device=device) <= positions.unsqueeze(-1)).unsqueeze(1)  # [B, 1, T, S]
    with cache.writing(positions, kv_span), _forward_context(_ForwardContext(None, None, kv_span)):
        hidden, layers = _run_decoder(model, cache, input_ids.clamp_min(0).to(device), positions, mask, capture_layers)
    lengths.add_(num_new)
    if all_logits:
        logits = _lm_head(model)(hidden)
    else:
        last = (num_new - 1).clamp_min(0)
        logits = _lm_head(model)(hidden[torch.arange(batch, device=device), last])
    return ForwardOutput(logits, hidden if return_hidden else None, layers)


def tree_verify_forward(model, cache: TreeKVCache, tree_tokens: Tensor, tree_mask: Tensor, depth: Tensor,
                        prefix_lens: Optional[Tensor] = None, *, return_hidden: bool = False,
                        compute_logits: bool = True, capture_layers: Sequence[int] = ()) -> ForwardOutput:
    """One target forward over a batch of draft trees (the verification pass).

    Args:
        model: a causal LM using the ``"taps"`` attention.
        cache: its :class:`TreeKVCache`.
        tree_tokens: [B, N] int64 (node 0 the root, the last committed token; -1 padding).
        tree_mask: [B, N, ceil(N / 64)] int64 ancestor bitmask.
        depth: [B, N] int64 (root 0; padding -1).
        prefix_lens: [B] int64 committed positions before the tree; default ``cache.lengths``.
        compute_logits: False: skip the lm_head (``logits`` is None; for callers that apply it to some
            rows only).
        capture_layers: also return the inputs of these decoder layers ([B, N, H] each).

    Node i of request b is written at cache position prefix_lens[b] + i, with rotary position
    prefix_lens[b] + depth[b, i]. cache.lengths is not changed (see :func:`compact_cache`).

    Returns:
        ForwardOutput(logits [B, N, V]: row i is the target's prediction after node i, hidden [B, N, H]).
    """
    _check_model(model)
    batch, num_nodes = tree_tokens.shape
    device = cache.lengths.device
    prefix = cache.lengths if prefix_lens is None else prefix_lens.to(device=device, dtype=torch.int64)
    kv_lens = prefix + num_nodes
    min_kv_len, max_kv_len = (int(x) for x in torch.stack(torch.aminmax(kv_lens)).tolist())  # one sync
    if min_kv_len < num_nodes:
        raise ValueError("taps.hf.tree_verify_forward: prefix_lens must be >= 0")
    if max_kv_len > cache.max_len:
        raise ValueError(f"taps.hf.tree_verify_forward: {max_kv_len} positions needed, the cache holds "
                         f"{cache.max_len}")
    positions = prefix.unsqueeze(1) + depth.to(device).clamp_min(0)
    write_positions = prefix.unsqueeze(1) + torch.arange(num_nodes, device=device)
    # A 4D placeholder so that transformers builds no mask of its own; the hook uses tree_mask.
    placeholder = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device).expand(
        batch, 1, num_nodes, cache.max_len)
    with cache.writing(write_positions, None), tree_attention_context(tree_mask.to(device), kv_lens, max_kv_len,
                                                                        validate=False):
        hidden, layers = _run_decoder(model, cache, tree_tokens.clamp_min(0).to(device), positions, placeholder,
                                      capture_layers)
    logits = _lm_head(model)(hidden) if compute_logits else None
    return ForwardOutput(logits, hidden if return_hidden or not compute_logits else None, layers)


def compact_cache(cache: TreeKVCache, path: Tensor, prefix_lens: Optional[Tensor] = None, *,
                  num_new: Optional[Tensor] = None, validate: bool = True) -> Tensor:
    """Commit each request's accepted path after a verification forward, for every layer.

    Args:
        cache: the cache :func:`tree_verify_forward` wrote the tree into.
        path: [B, P] int64 accepted node indices, root first, -1 padded (``VerifyOutput.path``).
        prefix_lens: [B] int64 committed positions before the tree; default ``cache.lengths``.
        num_new: [B] int64 entries each request commits (default: its path's length; 0 leaves a
            request's length as it is, for one that is finished).
        validate: ``taps_ops.compact_kv``'s checks of the paths.

    Returns:
        new lengths [B] int64 = prefix_lens + num_new (also stored in ``cache.lengths``).
    """
    device = cache.lengths.device
    prefix = cache.lengths if prefix_lens is None else prefix_lens.to(device=device, dtype=torch.int64)
    path = path.to(device=device, dtype=torch.int64)
    taps_ops.compact_kv(cache.kv_tensors(), path, prefix, validate=validate)
    new_lengths = prefix + ((path >= 0).sum(dim=1) if num_new is None else num_new)
    cache.lengths.copy_(new_lengths)
    return new_lengths
