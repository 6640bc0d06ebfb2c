"""taps_ops: speculative-decoding kernels for PyTorch (CPU and CUDA).

Public API (shapes in brackets; B requests, N tree nodes, V vocabulary):

- :func:`verify_tree` lossless acceptance of a draft tree against the target's logits
- :func:`build_tree`  top-by-score, ancestor-closed draft tree from EAGLE-2 style candidates
- :func:`merge_trees` trie union of several drafters' trees under one root, cut to a node budget
- :func:`tree_attention` attention of tree queries over a prefix plus the masked tree tail
- :func:`compact_kv` in-place move of the accepted path's KV entries next to the prefix
- :func:`rms_norm`   Llama's RMSNorm in one pass (one weight or G stacked ones), for the lean forwards
- :func:`rope_`      rotary position embedding in place, in one pass, for the lean forwards
- :func:`expand_level` one level of an EAGLE-2 draft expansion (top-k children, scores, next frontier)
- :func:`decoder_layer` a whole Llama decoder layer of the lean forwards in one call
- :func:`pack_panels`, :func:`panel_linear`: ``x W^T + b`` for a few rows of x over a float32 or bfloat16 weight kept
  as panels (CPU), the same bits at every ISA level and row count
- :func:`cpu_info`, :func:`set_cpu_isa`, :func:`native_half_matmul`: the CPU kernels' instruction-set level
  (scalar, avx2, avx512, amx; chosen at load from the CPU, ``TAPS_CPU_ISA`` caps it)

The tree format and the op contracts are those of the project's DESIGN.md; :mod:`taps_ops.reference`
holds a plain-PyTorch implementation of every op that the tests and benchmarks compare against.

Every op of the tree contract takes ``validate=True`` (rms_norm, rope_ and expand_level read no data
to check, so they have no such flag): the checks that read the inputs' data (tree structure, NaN, lengths, paths)
raise a clear error. On CUDA they cost one device sync, so ``validate=False`` skips them for hot
loops and CUDA-graph capture (where ``validate=True`` raises); the kernels then still never read or
write out of bounds, but bad input gives unspecified results.

Bad input (a shape, dtype, device, size limit, tree structure or length the op cannot take) raises
``ValueError`` with a message that starts ``taps_ops: <op>:``, on every op and backend.
"""

from __future__ import annotations

import math
import os
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple, Union

import torch
from torch import Tensor


def _load_library():
    # TAPS_OPS_LIBRARY points at a shared library built elsewhere (development builds); the
    # installed package carries its own `_C` extension. Either way the library is also the `_C` module
    # (returned), whose functions are fast entries to some ops.
    path = os.environ.get("TAPS_OPS_LIBRARY")
    if path:
        torch.ops.load_library(path)
        import importlib.util
        spec = importlib.util.spec_from_file_location(f"{__name__}._C", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        _check_library(path, "unset TAPS_OPS_LIBRARY or rebuild it: TAPS_CPU_ONLY=1 python tools/dev_build.py")
        return module
    from . import _C
    _check_library(getattr(_C, "__file__", "taps_ops._C"), "rebuild it: pip install . (or ./run setup)")
    return _C


#: the ops this package's Python side calls; a library built from older sources lacks some
_OPS = ("verify_tree", "build_tree", "merge_trees", "tree_attention", "compact_kv", "rms_norm", "rope_",
        "expand_level", "decoder_layer", "panel_linear", "_cpu_isa", "_set_cpu_isa", "_cpu_features",
        "_set_panel_prefetch", "_set_panel_next", "token_store_continuation", "ngram_table_logits",
        "ngram_table_draw", "head_argmax")


# the latest argument each op gained (a library that lacks it was built before it)
_NEWEST_ARGUMENTS = {"tree_attention": ("num_queries",)}


def _check_library(path: str, fix: str) -> None:
    """ImportError naming the library and the missing ops when the loaded library predates these sources
    (an in-place build not redone after an update), instead of a failure far from the cause."""
    missing = [name for name in _OPS if not hasattr(torch.ops.taps_ops, name)]
    for name, wanted in _NEWEST_ARGUMENTS.items():  # an op whose schema grew since
        if name not in missing:
            have = {a.name for a in getattr(torch.ops.taps_ops, name).default._schema.arguments}
            missing += [f"{name}({arg}=)" for arg in wanted if arg not in have]
    if missing:
        raise ImportError(f"taps_ops: the compiled library {path} was built from older sources: it lacks the "
                          f"op(s) {', '.join(missing)}; {fix}")


# tree_attention's, panel_linear's and decoder_layer's entries without torch.ops' argument parsing (None in a library built
# without them)
_library = _load_library()
_tree_attention_fast = getattr(_library, "tree_attention", None)
_panel_linear_fast = getattr(_library, "panel_linear", None)
_decoder_layer_fast = getattr(_library, "decoder_layer", None)

__all__ = [
    "VerifyOutput", "Tree", "MergedTree", "verify_tree", "build_tree", "merge_trees",
    "tree_attention", "compact_kv", "rms_norm", "rope_", "pack_panels", "panel_linear", "PANEL_WIDTH", "pack_head_screen", "head_argmax", "ExpandLevel", "expand_level", "decoder_layer",
    "token_store_continuation", "ngram_table_logits", "ngram_table_draw", "NGRAM_FLOOR_LOGIT", "has_cuda_kernels", "cpu_info", "set_cpu_isa", "cpu_level", "native_half_matmul", "CPU_ISA_LEVELS",
]

Scalar = Union[float, int, Tensor]


class VerifyOutput(NamedTuple):
    """Result of :func:`verify_tree`.

    tokens:       [B, N] int64, the accepted draft tokens, then one bonus/correction token, then -1.
    num_accepted: [B] int64, accepted draft tokens (tokens emitted = num_accepted + 1).
    path:         [B, N] int64, node indices of the accepted path (path[:, 0] == 0), then -1.
    """

    tokens: Tensor
    num_accepted: Tensor
    path: Tensor


class Tree(NamedTuple):
    """A batch of draft trees in the project's tree format ([B, N] unless noted).

    tokens (int64, -1 padding), parents (int64, root and padding -1), depth (int64, root 0, padding -1),
    tree_mask [B, N, ceil(N / 64)] int64 ancestor bitmask (bit j of word j // 64 in row i: node j is
    node i or one of its ancestors), scores (float32 cumulative draft log-prob, root 0, padding -inf),
    candidate_index (int64, the candidate each node came from, -1 for the root and padding).
    """

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    tree_mask: Tensor
    scores: Tensor
    candidate_index: Tensor


class MergedTree(NamedTuple):
    """A :class:`Tree` from :func:`merge_trees`: ``source [B, N] int64`` is a bitmask of the drafters
    (bit t = tree t) that proposed each node, in place of ``candidate_index``."""

    tokens: Tensor
    parents: Tensor
    depth: Tensor
    tree_mask: Tensor
    scores: Tensor
    source: Tensor


def has_cuda_kernels() -> bool:
    """True when the extension was built with its CUDA kernels."""
    return torch._C._dispatch_has_kernel_for_dispatch_key("taps_ops::verify_tree", "CUDA")


#: The CPU kernels' instruction-set levels, lowest first (each includes the ones before it).
CPU_ISA_LEVELS = ("scalar", "avx2", "avx512", "amx")

# The highest level each CPU op has code for (the op runs at min(this, the level in force)). decoder_layer
# runs ATen's, oneDNN's and MKL's kernels (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS) plus
# the ops above.
_OP_MAX_ISA = {
    "verify_tree": "avx512",      # row passes (max, sum of exp): AVX-512 / AVX2 + FMA / scalar
    "tree_attention": "amx",      # micro-GEMMs AVX-512 (D % 16 == 0) / AVX2 + FMA (D % 8 == 0), Vec kernel
                                  # otherwise; amx: bf16 on AMX brgemm for head dims >= 64 and
                                  # >= 16 query rows per KV head (TAPS_ATTN_BF16_AMX: 1 always, 0 never)
    "rms_norm": "avx512",         # row loops for AVX2 (no FMA: the same bits at every level); bf16 rows with
    "rope_": "avx512",            # explicit AVX2 / AVX-512 (+ AVX512-BF16 rounding) vectors
    "expand_level": "avx2",
    "panel_linear": "amx",        # register-blocked FMA kernels AVX-512 / AVX2 + FMA / scalar std::fma (same bits);
                                  # amx: bf16 x over bf16 panels on AMX tiles (in % 32 == 0; TAPS_PANEL_AMX=0: no)
    "head_argmax": "avx512",      # int8 screen: AVX512-VNNI (avx512 level on a VNNI host, else AVX2's) / AVX2 / scalar
    "build_tree": "scalar",       # scalar tree logic (no vector path to choose)
    "merge_trees": "scalar",
    "compact_kv": "scalar",       # memcpy
    "token_store_continuation": "scalar",  # binary searches and a vote on the host
    "ngram_table_logits": "scalar",        # binary searches and a row fill on the host
    "ngram_table_draw": "scalar",
}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform
    return platform.processor() or platform.machine()


def cpu_info() -> dict:
    """What the CPU kernels run on this machine.

    Returns a dict: ``cpu`` (model name), ``isa`` (the level in force: one of :data:`CPU_ISA_LEVELS`),
    ``host_isa`` (the best this CPU runs), ``features`` (the CPU features the kernels look at, e.g.
    ``avx2``, ``avx512f``, ``avx512_bf16``, ``amx_bf16``), ``native_bf16`` (:func:`native_half_matmul` for
    bf16: bf16 matrix products in hardware, so bf16 models are worth running), ``aten_capability`` (PyTorch's own
    CPU kernels' level, ``ATEN_CPU_CAPABILITY``), ``mkl_instructions`` (``MKL_ENABLE_INSTRUCTIONS``, the limit of
    MKL's float32 products; None: unset, the host's best), ``ops`` (the level each op uses) and ``summary`` (one
    line of it all, which the benchmarks and ``taps demo`` print).

    The level is chosen when the library loads: the best the CPU runs, or ``TAPS_CPU_ISA``
    (scalar|avx2|avx512|amx) when set; :func:`set_cpu_isa` changes it later. Together with
    ``ATEN_CPU_CAPABILITY=avx2``, ``ONEDNN_MAX_CPU_ISA=AVX2`` and ``MKL_ENABLE_INSTRUCTIONS=AVX2`` (MKL's float32
    GEMMs, which torch's ``mm`` and ``linear`` call and which read neither of the others: without it they keep
    AVX-512, 1.8x an AVX2 product at 16 rows on an AMX Xeon) an AVX-512 machine runs as an AVX2-only one.
    """
    isa = torch.ops.taps_ops._cpu_isa()
    features = list(torch.ops.taps_ops._cpu_features())
    rank = CPU_ISA_LEVELS.index(isa)
    ops = {op: CPU_ISA_LEVELS[min(rank, CPU_ISA_LEVELS.index(top))] for op, top in _OP_MAX_ISA.items()}
    native_bf16 = native_half_matmul(torch.bfloat16)
    aten = torch.backends.cpu.get_cpu_capability() if hasattr(torch.backends.cpu, "get_cpu_capability") else "?"
    mkl = os.environ.get("MKL_ENABLE_INSTRUCTIONS") or None
    info = dict(cpu=_cpu_model(), isa=isa, host_isa=torch.ops.taps_ops._cpu_host_isa(), features=features,
                native_bf16=native_bf16, aten_capability=aten, mkl_instructions=mkl, ops=ops)
    info["summary"] = (f"{info['cpu']}; taps kernels: {isa} (host {info['host_isa']}); ATen: {aten}; "
                       f"MKL: {mkl or 'host'}; native bf16: {'yes' if native_bf16 else 'no'}")
    return info


def native_half_matmul(dtype: torch.dtype) -> bool:
    """Whether this CPU multiplies `dtype` (bfloat16 / float16) matrices in hardware at the kernels' level:
    AVX512-BF16 or AMX-BF16 for bfloat16, AVX512-FP16 or AMX-FP16 for float16, with the level at avx512 or
    above (so ``TAPS_CPU_ISA=avx2`` also answers as a CPU without them would). Elsewhere half-precision
    products are emulated, several times slower than float32 ones, and taps' lean forwards widen the
    weights to float32 instead (``taps.lean.Linear.pack``)."""
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"taps_ops.native_half_matmul: dtype must be bfloat16 or float16, got {dtype}")
    if CPU_ISA_LEVELS.index(torch.ops.taps_ops._cpu_isa()) < CPU_ISA_LEVELS.index("avx512"):
        return False
    names = ("avx512_bf16", "amx_bf16") if dtype == torch.bfloat16 else ("avx512_fp16", "amx_fp16")
    features = torch.ops.taps_ops._cpu_features()
    return any(n in features for n in names)


def set_cpu_isa(level: str) -> str:
    """Runs the CPU kernels at `level` (one of :data:`CPU_ISA_LEVELS`, at most the CPU's own) from now on, in
    every thread; returns the previous level. For tests and benchmarks of the lower paths on a machine with
    a higher one (``TAPS_CPU_ISA`` does the same at load time). Raises ValueError for an unknown level or one
    this CPU cannot run."""
    if level not in CPU_ISA_LEVELS:
        raise ValueError(f"taps_ops.set_cpu_isa: level must be one of {', '.join(CPU_ISA_LEVELS)}, got {level!r}")
    global _LEVEL
    previous = torch.ops.taps_ops._cpu_isa()
    torch.ops.taps_ops._set_cpu_isa(level)
    _LEVEL = torch.ops.taps_ops._cpu_isa()
    return previous


def cpu_level() -> str:
    """The CPU kernels' level in force (what :func:`cpu_info` reports as ``isa``), without a call into the
    library: for per-step decisions."""
    return _LEVEL


# Read the level once at import: a bad TAPS_CPU_ISA is a clear ValueError here, not at the first op call.
_LEVEL = torch.ops.taps_ops._cpu_isa()


def _per_request(value: Scalar, batch: int, dtype: torch.dtype, device: torch.device, name: str) -> Tensor:
    """A Python scalar or a [B] / [] tensor as a [B] tensor of `dtype` on `device`."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"taps_ops: {name} must be a scalar or a [B] = [{batch}] tensor, got shape {tuple(value.shape)}")
        if value.is_floating_point() and dtype == torch.int64:
            raise ValueError(f"taps_ops: {name} must hold integers, got dtype {value.dtype}")
        return value.to(device=device, dtype=dtype).contiguous()
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"taps_ops: {name} must be a Python number or a tensor, got {type(value).__name__}")
    if dtype == torch.int64 and not float(value).is_integer():
        raise ValueError(f"taps_ops: {name} must be an integer, got {value!r}")
    if not math.isfinite(value):  # (an invalid setting the op rejects: not kept, a NaN key matches nothing)
        return torch.full((batch,), value, dtype=dtype, device=device)
    # the same few settings every step: made once (the ops only read them; about 3 us each otherwise)
    key = (value, batch, dtype, device)
    made = _PER_REQUEST.get(key)
    if made is None:
        if len(_PER_REQUEST) > 256:
            _PER_REQUEST.clear()
        made = _PER_REQUEST[key] = torch.full((batch,), value, dtype=dtype, device=device)
    return made


_PER_REQUEST: Dict[tuple, Tensor] = {}


def _check_scalar_ranges(temperature: Scalar, top_k: Scalar, top_p: Scalar) -> None:
    # Python scalars are checked here at no cost; tensors are checked by the op itself.
    if isinstance(temperature, (int, float)) and not (temperature >= 0 and math.isfinite(temperature)):
        raise ValueError(f"taps_ops: temperature must be finite and >= 0, got {temperature!r}")
    if isinstance(top_k, (int, float)) and not top_k >= 0:
        raise ValueError(f"taps_ops: top_k must be >= 0 (0 = off), got {top_k!r}")
    if isinstance(top_p, (int, float)) and not (0.0 < top_p <= 1.0):
        raise ValueError(f"taps_ops: top_p must be in (0, 1], got {top_p!r}")


def verify_tree(
    logits: Tensor,
    tokens: Tensor,
    parents: Tensor,
    *,
    temperature: Scalar = 0.0,
    top_k: Scalar = 0,
    top_p: Scalar = 1.0,
    draft_probs: Optional[Tensor] = None,
    uniforms: Optional[Tensor] = None,
    generator: Optional[torch.Generator] = None,
    validate: bool = True,
) -> VerifyOutput:
    """Lossless acceptance of a batch of draft trees (one target forward pass over the tree).

    Args:
        logits: [B, N, V] float32/bfloat16/float16. Row i holds the target's logits for the token
            after node i. Only the rows of visited nodes (the accepted path plus one) are read.
        tokens: [B, N] int64 tree tokens (node 0 = root, the last committed token; -1 padding).
        parents: [B, N] int64 (parents[:, 0] == -1; 0 <= parents[b, i] < i for real nodes; -1 padding).
        temperature: scalar or [B]; 0 = greedy (argmax, ties to the lowest id). Default 0.
        top_k: scalar or [B] int; 0 = off. Keeps every token whose logit is >= the k-th largest.
        top_p: scalar or [B] in (0, 1]; keeps the smallest set of most likely tokens (after top-k)
            whose mass reaches top_p, with every token tied at the threshold. Default 1 (off).
        draft_probs: optional [B, N, V]: row i is the distribution each child of node i was sampled
            from; selects recursive rejection sampling. None: deterministic candidates (any drafter).
        uniforms: optional [B, N] float32 in [0, 1), the coin of each node; identical uniforms give
            identical results on CPU and CUDA. Drawn from `generator` when None.
        generator: torch.Generator for the uniforms.
        validate: check tree structure and NaN logits (needs a device sync on CUDA). With False the
            kernels still never read or write out of bounds, but a malformed tree gives unspecified
            (in-bounds) results.

    Returns:
        VerifyOutput(tokens [B, N], num_accepted [B], path [B, N]), int64, -1 padded.
    """
    if not isinstance(logits, Tensor) or logits.dim() != 3:
        raise ValueError(f"taps_ops.verify_tree: logits must be a [B, N, V] tensor, got "
                         f"{tuple(logits.shape) if isinstance(logits, Tensor) else type(logits).__name__}")
    _check_scalar_ranges(temperature, top_k, top_p)
    batch, num_nodes, device = logits.shape[0], logits.shape[1], logits.device
    temperature_t = _per_request(temperature, batch, torch.float32, device, "temperature")
    top_k_t = _per_request(top_k, batch, torch.int64, device, "top_k")
    top_p_t = _per_request(top_p, batch, torch.float32, device, "top_p")
    if uniforms is None:
        uniforms = torch.rand((batch, num_nodes), generator=generator, device=device, dtype=torch.float32)
    out = torch.ops.taps_ops.verify_tree.default(
        logits, tokens, parents, temperature_t, top_k_t, top_p_t, draft_probs, uniforms, validate)
    return VerifyOutput(*out)


def build_tree(
    scores: Tensor,
    tokens: Tensor,
    parents: Tensor,
    num_nodes: int,
    root_tokens: Optional[Tensor] = None,
    *,
    validate: bool = True,
) -> Tree:
    """Select an ancestor-closed draft tree of `num_nodes` nodes from EAGLE-2 style candidates.

    Args:
        scores: [B, M] float32 cumulative draft log-prob of each candidate.
        tokens: [B, M] int64 candidate tokens; a negative token marks a padding candidate.
        parents: [B, M] int64, -1 = child of the root, else the index of an earlier candidate.
        num_nodes: nodes in the output tree, root included (>= 1). The best `num_nodes - 1`
            candidates are kept, closed under ancestors (ties: shallower, then earlier candidate).
        root_tokens: optional [B] int64 token of the root (node 0); -1 when None.
        validate: check every candidate (parent range, NaN scores) and raise on a bad one (one device
            sync on CUDA; always checked on the CPU, where it is free). With False the CUDA kernel still
            stays in bounds, but bad candidates give unspecified (in-bounds) results.

    Returns:
        Tree with [B, num_nodes] fields, siblings ordered by score (best first), -1 padded.
    """
    return Tree(*torch.ops.taps_ops.build_tree.default(scores, tokens, parents, int(num_nodes), root_tokens,
                                                       validate))


def merge_trees(
    tokens: Tensor,
    parents: Tensor,
    scores: Tensor,
    num_nodes: Optional[int] = None,
    weights: Optional[Tensor] = None,
    *,
    validate: bool = True,
) -> MergedTree:
    """Trie union of T drafters' trees per request, cut to `num_nodes` by score.

    Args:
        tokens: [B, T, N] int64 trees in the tree format (node 0 the shared root, -1 padding).
        parents: [B, T, N] int64.
        scores: [B, T, N] float32 cumulative draft log-prob of each node.
        num_nodes: output nodes, root included; default T * (N - 1) + 1, room for the whole union.
        weights: optional [T] or [B, T] per-drafter log-weight added to that drafter's scores.
        validate: check every tree (shared root, topological parents, padding, NaN scores and weights)
            and raise on a bad node (one device sync on CUDA; always checked on the CPU, where it is
            free). With False the CUDA kernel still stays in bounds, but bad trees give unspecified
            (in-bounds) results.

    Returns:
        MergedTree with [B, num_nodes] fields; a merged node's score is the max over its sources,
        `source` the bitmask of drafters that proposed it (T <= 63).
    """
    if not isinstance(tokens, Tensor) or tokens.dim() != 3:
        raise ValueError("taps_ops.merge_trees: tokens must be a [B, T, N] tensor")
    batch, num_trees, n = tokens.shape
    if num_nodes is None:
        num_nodes = num_trees * max(n - 1, 0) + 1
    if weights is not None:
        if not isinstance(weights, Tensor):
            weights = torch.as_tensor(weights, dtype=torch.float32)
        if weights.dim() == 1:
            weights = weights.unsqueeze(0).expand(batch, -1)
        if weights.dim() != 2 or tuple(weights.shape) != (batch, num_trees):
            raise ValueError(f"taps_ops.merge_trees: weights must be [T] or [B, T] = [{batch}, {num_trees}], "
                             f"got shape {tuple(weights.shape)}")
        weights = weights.to(device=tokens.device, dtype=torch.float32).contiguous()
    return MergedTree(*torch.ops.taps_ops.merge_trees.default(tokens, parents, scores, int(num_nodes), weights,
                                                              validate))


def tree_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    tree_mask: Tensor,
    kv_lens: Tensor,
    scale: Optional[float] = None,
    *,
    validate: bool = True,
    tree_nodes: Optional[int] = None,
    num_queries: Optional[Tensor] = None,
) -> Tensor:
    """Attention of N tree queries over each request's prefix plus the tree nodes.

    Args:
        q: [B, Hq, N, D] float32/bfloat16/float16.
        k, v: [B, Hkv, S, D], same dtype; Hq a multiple of Hkv (grouped-query attention).
        tree_mask: [B, N, W] int64 bitmask (as from build_tree): bit j of word j // 64 of row i = query i
            sees tree node j. W >= ceil(T / 64).
        kv_lens: [B] int64; request b's keys are k[b, :, :kv_lens[b]], the last T of them tree nodes
            0..T-1, the rest a fully visible prefix. T <= kv_lens[b] <= S.
        scale: softmax scale, default 1 / sqrt(D).
        validate: check T <= kv_lens[b] <= S and 0 <= num_queries[b] <= N (one device sync on CUDA;
            always checked on the CPU, where it is free). With False the CUDA kernel clamps both into range
            instead of raising: for hot loops and CUDA graphs where the caller guarantees them.
        tree_nodes: T >= N, the tree nodes among the keys (default N: the queries are the whole tree).
            More than N when only the newest nodes have queries, as in a drafter's expansion level,
            whose N frontier nodes see their ancestors among the T nodes drafted so far.
        num_queries: [B] int64 on q's device, or None (N each): request b's queries are nodes
            0 .. num_queries[b] - 1 only; its rows of out past them are zeros and cost nothing. For a
            ragged batch of trees padded to one [B, N] grid (different node counts per request): the
            padding queries are skipped, not computed and discarded. The live rows hold the same bits as
            the call without it.

    Returns:
        out [B, Hq, N, D] in q's dtype (float32 accumulation).

    CUDA: head dims 32, 64, 80, 96, 128, 256 (others up to 256 are zero-padded to the next: a copy of q, k
    and v per call); checking kv_lens costs one device sync.
    """
    if _tree_attention_fast is not None and not torch.compiler.is_compiling():
        # the common case (plain tensors, float or default scale) through the dispatcher's typed call;
        # NotImplemented for anything else, which torch.ops below parses (or rejects)
        out = _tree_attention_fast(q, k, v, tree_mask, kv_lens, scale, validate, tree_nodes, num_queries)
        if out is not NotImplemented:
            return out
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return torch.ops.taps_ops.tree_attention.default(q, k, v, tree_mask, kv_lens, float(scale), validate,
                                                     None if tree_nodes is None else int(tree_nodes), num_queries)


def compact_kv(caches: Sequence[Tensor], path: Tensor, prefix_lens: Tensor, *, validate: bool = True) -> None:
    """Move the KV entries of each request's accepted path next to its prefix, in place.

    Args:
        caches: K and V tensors of every layer, each [B, H, S, D] (any float dtype); tree node i of
            request b sits at position prefix_lens[b] + i before the call.
        path: [B, P] int64 accepted node indices (root first, path[:, 0] == 0, strictly increasing),
            -1 padded, e.g. VerifyOutput.path.
        prefix_lens: [B] int64 committed positions before the tree.
        validate: check the paths (root first, strictly increasing, inside the cache) and prefix_lens
            (one device sync on CUDA; always checked on the CPU, where it is free). With False the CUDA
            kernel leaves a request with an invalid path untouched instead of raising.

    After the call, entry j of the path is at position prefix_lens[b] + j of every cache.
    """
    torch.ops.taps_ops.compact_kv.default(list(caches), path, prefix_lens, validate)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Llama's RMSNorm of every row of x, in one pass: ``round(round(x * rsqrt(mean(x^2) + eps)) * w)``
    with the mean in float32 and ``round`` to x's dtype, as Hugging Face's ``LlamaRMSNorm`` computes it
    (``weight * (x.float() * rsqrt(var + eps)).to(dtype)``), up to the order of the sum of squares (the
    fixed order of ``csrc/include/taps/rms_norm.h``, the same on the CPU and on CUDA).

    Args:
        x: [..., H] float32/bfloat16/float16 (any layout; a copy is made when the last dimension is
            strided).
        weight: [H], or [G, H] stacked weights of G groups: x's rows (its leading dimensions flattened,
            R in all) are G consecutive blocks of R / G rows and block g uses weight[g]. x's dtype.
        eps: >= 0.

    Returns:
        out: x's shape and dtype, contiguous.

    No autograd: an inference op (the lean forward paths call it with autograd off). CUDA: its tests
    pass on an H200 (2026-12-04).
    """
    return torch.ops.taps_ops.rms_norm.default(x, weight, float(eps))


def _host_tensors(op: str, **tensors) -> None:
    """The host-data ops' (token stores, n-gram tables) check of their tensor arguments: each a tensor on the CPU
    (ValueError naming the op and the argument otherwise)."""
    for name, t in tensors.items():
        if not isinstance(t, Tensor) or t.device.type != "cpu":
            raise ValueError(f"taps_ops: {op}: {name} must be a tensor, a CPU tensor (host data), got "
                             f"{t.device if isinstance(t, Tensor) else type(t).__name__}")


#: the logit :func:`ngram_table_logits` gives tokens a context's entries do not hold (q ~1e-12 of their mass)
NGRAM_FLOOR_LOGIT = math.log(1e-12)


def token_store_continuation(tokens: Tensor, ends: Tensor, cols: Tensor, context: Sequence[int], depth: int,
                             min_ngram: int = 1, vote: int = 32) -> Tuple[int, int, int, List[int]]:
    """The longest suffix of `context` in a token store and the continuation voted over its occurrences
    (the search and vote of :class:`taps.drafters.store.TokenStore`, which builds the arrays; CPU, host data).

    Args:
        tokens: [L] int32, the store's sequences with -1 before, between and after them.
        ends: [M] int64, the positions of the store's tokens sorted by the reversed text ending at each.
        cols: [K, M] int32, ``cols[j, i]`` the token j places before ``ends[i]`` (-1 past its sequence's
            start): each column sorted within the ranges where the columns before it are equal.
        context: token ids (its last K are read).
        depth: the most continuation tokens (>= 0).
        min_ngram: a shorter match proposes nothing (>= 0).
        vote: the most occurrences voted (>= 1), the first ones of the matched range.

    Returns:
        (n, lo, hi, continuation): the suffix length matched (0 .. K), the range ``ends[lo:hi]`` of its
        occurrences, and when ``n >= max(min_ngram, 1)`` up to `depth` tokens: at each level the token most of
        the voted occurrences still agreeing with the continuation go on with (ties: the first in index order),
        stopping where most reach their sequence's end. Reads are bounds-checked (an end outside tokens raises
        ValueError); unsorted columns give unspecified matches, never out-of-bounds reads.
    """
    _host_tensors("token_store_continuation", tokens=tokens, ends=ends, cols=cols)
    got = _token_store_op(tokens, ends, cols, context, int(depth), int(min_ngram), int(vote))
    return got[0], got[1], got[2], got[3:]


_token_store_op = torch.ops.taps_ops.token_store_continuation.default


def ngram_table_logits(keys: Tensor, counts: Tensor, starts: Tensor, ids: Tensor, logp: Tensor, contexts: Tensor,
                       vocab: int, max_order: int, min_count: int = 1, floor: float = NGRAM_FLOOR_LOGIT) -> Tensor:
    """Logits [R, vocab] float32 of the longest context an n-gram table holds for each context row (the lookup
    of :class:`taps.drafters.table.NgramTable`, which builds the arrays; CPU, host data).

    Args:
        keys: [K] int64 holding uint64 keys, sorted as uint64 and distinct: a context t_1 .. t_n (oldest first)
            is ``n * b**n + (t_1 + 1) * b**(n - 1) + ... + (t_n + 1)`` modulo 2**64, b = vocab + 1; key 0 (the
            order-0 context, the corpus average) must be present.
        counts: [K] int64 positions each context averaged; starts: [K + 1] int64, context i's entries
            ``starts[i]:starts[i + 1]``; ids: [E] int64 token ids; logp: [E] float32 their logits.
        contexts: [R, W] int64, each row's last W tokens, oldest first, -1 where the context is shorter.
        vocab: the vocabulary (>= 1); max_order: the longest context tried (>= 0); min_count: the fewest
            positions a context needs to be used.
        floor: the logit of every token the chosen context's entries do not hold.

    Every read is bounds-checked (a start outside the entries or an id outside the vocabulary raises
    ValueError); unsorted keys give unspecified matches, never out-of-bounds reads.
    """
    _host_tensors("ngram_table_logits", keys=keys, counts=counts, starts=starts, ids=ids, logp=logp,
                  contexts=contexts)
    return _ngram_table_op(keys, counts, starts, ids, logp, contexts, int(vocab), int(max_order), int(min_count),
                           float(floor))


_ngram_table_op = torch.ops.taps_ops.ngram_table_logits.default


def ngram_table_draw(keys: Tensor, counts: Tensor, starts: Tensor, ids: Tensor, logp: Tensor, contexts: Tensor,
                     uniforms: Tensor, temperature: Union[Tensor, float], width: int, depth: int, vocab: int,
                     max_order: int, min_count: int = 1,
                     out: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """Sampled chains from an n-gram table (the table and contexts as :func:`ngram_table_logits` takes them; CPU,
    host data): for each request b, `width` draws from q at its root (context row b), each continued by one
    draw a level from q at its node, to `depth` levels; q at a node is softmax(logp / temperature[b]) over the
    entries of its context's longest suffix the table holds (zero elsewhere); at temperature 0, q is all on the
    entry of the largest logp (ties to the lowest id): the chain of the table's modes, for a greedy request of a
    batch whose other requests sample (``verify_tree`` at temperature 0 accepts exactly its argmax path).

    Args:
        uniforms: [B, width * depth] float32 in [0, 1): draw i of request b uses uniforms[b, i] (inverse CDF
            over the entries in their order; a token of zero mass is never drawn).
        temperature: [B] float32, finite and >= 0, or one Python number for every request.
        out: a contiguous float32 CPU tensor [B, 1 + M, vocab] to write probs into (cleared first) and return as
            probs, in place of a new one (a decoder keeps one: a fresh 128 KiB a draft cost ~20 us of page faults).

    Returns:
        (tokens, parents, scores, probs): [B, M] int64 / int64 / float32 (M = width * depth; level l's chain c
        is candidate (l - 1) * width + c, its parent the chain's previous candidate, -1 at level 1; scores the
        cumulative log q) and probs [B, 1 + M, vocab] float32: row 0 the root's q, row 1 + m the q candidate m's
        child was drawn from, zeros for the last level (what ``verify_tree(draft_probs=...)`` reads).
    """
    if isinstance(temperature, (int, float)) and not isinstance(temperature, bool) and isinstance(contexts, Tensor):
        # (made once per value and batch: the op checks it)
        temperature = _per_request(temperature, contexts.shape[0] if contexts.dim() else 0, torch.float32,
                                   torch.device("cpu"), "temperature")
    _host_tensors("ngram_table_draw", keys=keys, counts=counts, starts=starts, ids=ids, logp=logp,
                  contexts=contexts, uniforms=uniforms, temperature=temperature,
                  **({} if out is None else {"out": out}))
    return tuple(_ngram_draw_op(keys, counts, starts, ids, logp, contexts, uniforms, temperature, int(width),
                                int(depth), int(vocab), int(max_order), int(min_count), out))


_ngram_draw_op = torch.ops.taps_ops.ngram_table_draw.default


#: Outputs per panel of :func:`pack_panels`.
PANEL_WIDTH = 16


def pack_panels(weight: Tensor, dtype: Optional[torch.dtype] = None) -> Tensor:
    """A linear weight [out, in] as the panels :func:`panel_linear` reads, panel p holding outputs
    16p .. 16p + 15 (a copy; out must be a multiple of 16, in any value): float32 panels are [out / 16, in, 16],
    the 16 weights of each input next to each other; bfloat16 ones are [out / 16, ceil(in / 2), 16, 2], the
    inputs in pairs (element [p, j, o, h] is W[16p + o, 2j + h], zero past in), so that each 32-bit lane holds
    one output's two weights and widens by a shift and a mask. Panels lie an odd number of 64-byte lines
    apart (padding after each), so the few panels a kernel block streams at once never share L1 cache sets.
    Detached: for inference.

    Args:
        weight: [out, in] float32 or bfloat16.
        dtype: the panels' dtype, float32 or bfloat16 (default: the weight's). A float32 weight packed as
            bfloat16 is rounded to nearest even: half the bytes a product reads, for weights whose values
            may change (a drafter's: verification keeps decoding exact whatever it proposes), never for
            weights a result must match.
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"taps_ops: pack_panels: weight must be a 2-D tensor [out, in], got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"taps_ops: pack_panels: weight must be float32 or bfloat16, got {weight.dtype}")
    dtype = weight.dtype if dtype is None else dtype
    if dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"taps_ops: pack_panels: dtype must be torch.float32 or torch.bfloat16, got {dtype}")
    out, inner = weight.shape
    if out % PANEL_WIDTH != 0:
        raise ValueError(f"taps_ops: pack_panels: out = {out} features must be a multiple of {PANEL_WIDTH}")
    count = out // PANEL_WIDTH
    if dtype == torch.float32:   # [count, in, 16]: one 64-byte line per input
        stride = (inner + (1 - inner % 2)) * PANEL_WIDTH
        buffer = weight.new_zeros(count * stride, dtype=dtype)
        panels = buffer.as_strided((count, inner, PANEL_WIDTH), (stride, PANEL_WIDTH, 1))
        panels.copy_(weight.detach().reshape(count, PANEL_WIDTH, inner).transpose(1, 2))
        return panels
    pairs = (inner + 1) // 2     # bfloat16 [count, pairs, 16, 2]: one 64-byte line per pair of inputs
    stride = (pairs + (1 - pairs % 2)) * 2 * PANEL_WIDTH
    buffer = weight.new_zeros(count * stride, dtype=dtype)
    panels = buffer.as_strided((count, pairs, PANEL_WIDTH, 2), (stride, 2 * PANEL_WIDTH, 2, 1))
    padded = weight.detach()
    if inner % 2:
        padded = torch.cat([padded, padded.new_zeros(out, 1)], 1)
    panels.copy_(padded.reshape(count, PANEL_WIDTH, pairs, 2).transpose(1, 2))
    return panels


_panel_linear_op = torch.ops.taps_ops.panel_linear.default


def _panel_linear_call(x: Tensor, panels: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """panel_linear without the wrapper's device checks (CPU tensors): through the fast entry when it takes
    the arguments, else torch.ops."""
    if _panel_linear_fast is not None:
        out = _panel_linear_fast(x, panels, bias)
        if out is not NotImplemented:
            return out
    return _panel_linear_op(x, panels, bias)


def panel_linear(x: Tensor, panels: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x W^T + bias`` over a float32 or bfloat16 weight W [out, in] kept as :func:`pack_panels` (CPU).

    Made for a few rows (a decoding step's token, a draft tree's nodes): each weight element is read once
    per block of up to 8 rows (AVX-512; 6 at AVX2) and multiplied into all of them, where BLAS kernels
    tuned for large products take 1.5-2.5x a single row's time at 2-16 rows (bench/RESULTS.md). Any row
    count works (output blocks stay in L2 while the row blocks pass over them).

    Each output is ``sum_i x[r, i] * W[o, i]`` accumulated in float32 from i = 0 up, one fused multiply-add
    per term, then ``+ bias[o]``: the same bits at every ISA level (:func:`set_cpu_isa`), row count, row
    position and thread count, so a row's result never depends on the other rows of the call. It differs
    from ``F.linear`` by float rounding only. bfloat16 panels are widened to float32 as they are read (no
    bf16 instructions: any level): the bits of float32 panels of the same values, from half the bytes.

    bfloat16 x (over bfloat16 panels only) gives bfloat16: the float32 sums of x widened, plus the bias,
    rounded once. On a CPU with AVX512-BF16, at the avx512 level and above, its pairs are multiplied by
    ``vdpbf16ps`` (twice the multiply-adds per instruction), whose two fused multiply-adds run in this order
    (each lane's halves swapped), with denormals flushed: the bits of the other levels unless an input or a
    partial sum is a float32 denormal.

    Args:
        x: [..., in] float32, or bfloat16 with bfloat16 panels (a copy is made when not contiguous).
        panels: float32 [out / 16, in, 16] with strides (>= in * 16, 16, 1), or bfloat16 [out / 16, ceil(in / 2),
            16, 2] with strides (>= ceil(in / 2) * 32, 32, 2, 1) (:func:`pack_panels`); x's last dimension then
            any in with ceil(in / 2) = panels.shape[1].
        bias: [out] float32 or None.

    Returns:
        [..., out] float32 (bfloat16 for bfloat16 x), contiguous. No autograd (inference). CPU only (GPUs have cuBLAS for this);
        tensors elsewhere raise ValueError.
    """
    # the common case in three attribute reads (the loop below took 2 us, as long as a 256 x 256 product),
    # then the fast entry (torch.ops' argument handling costs 0.5 us more than torch.mm's)
    if (getattr(x, "is_cpu", False) and getattr(panels, "is_cpu", False)
            and (bias is None or getattr(bias, "is_cpu", False))):
        return _panel_linear_call(x, panels, bias) if not torch.compiler.is_compiling() else \
            _panel_linear_op(x, panels, bias)
    for name, t in (("x", x), ("panels", panels), ("bias", bias)):
        if isinstance(t, Tensor) and t.device.type != "cpu":
            raise ValueError(f"taps_ops: panel_linear: a CPU op, got {name} on {t.device}")
    return _panel_linear_op(x, panels, bias)


def pack_head_screen(weight: Tensor) -> Tuple[Tensor, Tensor]:
    """The int8 screen of a linear head [out, in] that :func:`head_argmax` reads beside its panels: ``(screen,
    meta)``, screen [out / 16, ceil(in / 4), 16, 4] int8 (element [p, g, o, k] = q[16p + o, 4g + k], zero past
    in; q = round(W / s) per output row, s = max|W_row| / 127) and meta [3, out] float32 (s, sum(q_row),
    sum|q_row|). A copy (a quarter of the float32 weight's bytes); out must be a multiple of 16 and every
    weight finite.

    Args:
        weight: [out, in] float32 or bfloat16 (the values the panels hold).
    """
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise ValueError(f"taps_ops: pack_head_screen: weight must be a 2-D tensor [out, in], got "
                         f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}")
    if weight.dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"taps_ops: pack_head_screen: weight must be float32 or bfloat16, got {weight.dtype}")
    out, inner = weight.shape
    if out % PANEL_WIDTH != 0:
        raise ValueError(f"taps_ops: pack_head_screen: out = {out} features must be a multiple of {PANEL_WIDTH}")
    w = weight.detach().to(torch.float64)
    if not bool(torch.isfinite(w).all()):
        raise ValueError("taps_ops: pack_head_screen: the weight holds non-finite values")
    scale = (w.abs().amax(1) / 127).to(torch.float32)
    safe = torch.where(scale > 0, scale.double(), torch.ones_like(w[:, 0]))
    q = torch.round(w / safe.unsqueeze(1)).clamp_(-127, 127).to(torch.int8)
    groups = (inner + 3) // 4
    padded = torch.zeros((out, groups * 4), dtype=torch.int8, device=weight.device)
    padded[:, :inner] = q
    screen = padded.view(out // PANEL_WIDTH, PANEL_WIDTH, groups, 4).transpose(1, 2).contiguous()
    meta = torch.stack([scale, q.sum(1, dtype=torch.int64).float(), q.abs().sum(1, dtype=torch.int64).float()])
    return screen, meta


_head_argmax_op = torch.ops.taps_ops.head_argmax.default


def head_argmax(x: Tensor, screen: Tensor, meta: Tensor, panels: Tensor) -> Tensor:
    """``panel_linear(x, panels).argmax(-1)`` (ties to the lowest id), bit for bit, at a fraction of its cost:
    the greedy token of each row under a head kept as panels, for verification at temperature 0.

    An int8 screen of the same weight (:func:`pack_head_screen`) and x quantized per row to 7 bits give each
    output an approximate logit and a rigorous bound on its distance to the exact one (the quantization of
    both, and the float32 rounding of the exact sum); only the panels holding outputs that could be the
    maximum (one bfloat16 step wider when x is bfloat16: its logits are rounded so) are multiplied exactly, by
    panel_linear's own kernel, and the argmax is taken among them. Rows that are not finite or all zero, or
    whose screen keeps more than 256 candidates, get the full product. The integer sums are exact at every
    level (AVX512-VNNI at the avx512 level where the CPU has it, else AVX2, else scalar), so the result is
    the same at every level.

    Args:
        x: [..., in] float32, or bfloat16 over bfloat16 panels.
        screen, meta: :func:`pack_head_screen` of the weight the panels hold.
        panels: :func:`pack_panels` of that weight (no bias).

    Returns:
        [...] int64. CPU only; tensors elsewhere raise ValueError.
    """
    for name, t in (("x", x), ("screen", screen), ("meta", meta), ("panels", panels)):
        if not isinstance(t, Tensor):
            raise ValueError(f"taps_ops: head_argmax: {name} must be a tensor, got {type(t).__name__}")
        if t.device.type != "cpu":
            raise ValueError(f"taps_ops: head_argmax: a CPU op, got {name} on {t.device}")
    return _head_argmax_op(x, screen, meta, panels)   # (dtypes and shapes are checked by the op)


def rope_(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotary position embedding of x in place: ``x = x * cos + x.roll(D // 2, -1) * sin`` per head, each
    product and the sum rounded to x's dtype as torch evaluates that expression (with ``sin`` carrying
    rotate_half's sign on its first half, this is Hugging Face's ``x * cos + rotate_half(x) * sin``; see
    ``taps.lean.RopeTable``).

    Args:
        x: [R, T, H, D] float32/bfloat16/float16, D even, any strides with a contiguous last dimension
            (e.g. the q and k heads of a fused qkv projection's output, rotated together); updated in place.
        cos, sin: [R, T, D] or [R, T, 1, D], x's dtype, contiguous last dimension (expanded views are
            fine): the table rows of each token's position, shared by its H heads.

    Returns:
        x. No autograd: an inference op (the lean forwards call it with autograd off). CUDA: its tests
        pass on an H200 (2026-12-04).
    """
    torch.ops.taps_ops.rope_.default(x, cos, sin)
    return x


class ExpandLevel(NamedTuple):
    """Result of :func:`expand_level` (R requests, F frontier nodes, k children each, C = F * k).

    scores:      [R, C] float32, each child's cumulative log-prob (its parent's score + its own log-prob).
    tokens:      [R, C] int64, the children's tokens (mapped through ``token_map`` when given).
    parents:     [R, C] int64, each child's parent candidate (``front_cands`` of its frontier node).
    entropy:     [R] float32, the summed entropy (nats) of the F rows' softmax (zeros unless asked).
    next_scores, next_tokens: [R, next_k] the next frontier: the best next_k children, best first.
    next_slots:  [R, next_k] int64, the frontier slot (0 .. F-1) of each one's parent (child index // k).
    next_cands:  [R, next_k] int64, their candidate indices: ``cand_offset`` + child index.
    """

    scores: Tensor
    tokens: Tensor
    parents: Tensor
    entropy: Tensor
    next_scores: Tensor
    next_tokens: Tensor
    next_slots: Tensor
    next_cands: Tensor


def expand_level(logits: Tensor, front_scores: Tensor, front_cands: Tensor, k: int, next_k: int = 0,
                 cand_offset: int = 0, token_map: Optional[Tensor] = None, *,
                 with_entropy: bool = False) -> ExpandLevel:
    """One level of an EAGLE-2 draft expansion, in one call: every frontier node's top-k children by
    log-softmax, their cumulative scores, tokens and parents, and the next frontier (the best ``next_k``
    children over all of a request's nodes).

    Child ``c = f * k + j`` of request r is the j-th best token of ``logits[r, f]``: its score is
    ``front_scores[r, f] + log_softmax(logits[r, f])[token]``, its parent ``front_cands[r, f]``. The order
    is the same everywhere: higher value first, equal values by the lower token id / child index, NaN as
    -inf. The log-softmax follows torch's formula ``(x - max) - log(sum(exp(x - max)))`` in float32, in
    the fixed summation order of ``csrc/include/taps/expand_level.h`` (CPU and CUDA alike).

    Args:
        logits: [R, F, V] float32/bfloat16/float16, the drafter's logits of the F frontier nodes (any
            strides).
        front_scores: [R, F] float32, the frontier nodes' cumulative log-probs (zeros for the root).
        front_cands: [R, F] int64, their candidate indices (-1 for the root).
        k: children per node, 1 <= k <= min(V, 64).
        next_k: size of the next frontier, 0 <= next_k <= F * k (0 on the last level).
        cand_offset: the candidate index of this level's first child.
        token_map: [V] int64 target token ids of a reduced draft vocabulary, or None (ids as they are).
        with_entropy: also sum the F rows' softmax entropies (entropy routing); zeros otherwise.

    A row with a NaN or +inf logit gets NaN scores (tokens stay in range); a row of only -inf gets scores
    -inf.
    No data checks, so no ``validate``; no autograd. CUDA: its tests passed on an H200 (2026-12-04); its row
    scans load ahead since (same order and bits, tested under the host emulation, not yet on a GPU).
    """
    return ExpandLevel(*torch.ops.taps_ops.expand_level.default(logits, front_scores, front_cands, int(k),
                                                                int(next_k), int(cand_offset), token_map,
                                                                bool(with_entropy)))


def decoder_layer(x: Tensor, weights: Sequence[Optional[Tensor]], eps: Sequence[float], dims: Sequence[int],
                  cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, write_start: int, tree_mask: Tensor,
                  kv_lens: Tensor, scale: float, *, tree_nodes: Optional[int] = None,
                  emb: Optional[Tensor] = None, write_positions: Optional[Tensor] = None,
                  rows: Optional[Tensor] = None) -> Tensor:
    """One Llama decoder layer with tree attention over a KV cache, in one call: the lean forward's layer
    (``taps.lean.decoder_layer`` with a ``taps.kv.TreeAttend``), the same arithmetic in the same order, so
    the output is the same bit for bit, without the host cost of some 25 operator calls from Python (on the
    CPU its adds, products and copies between the kernels run as plain loops; plain tensors and exact lists
    take the fast entry ``taps_ops._C.decoder_layer``, anything else torch.ops).

    ``h = rms_norm(x, in_norm)`` (or x without an input norm; EAGLE-3, with ``emb``:
    ``cat(rms_norm(emb, in_norm), rms_norm(x, hidden_norm))``); ``q, k, v = h @ qkv``; q and k rotated
    (``rope_`` when ``dims[3]``, else ``t * cos + t.roll(D // 2, -1) * sin``); k and v written to cache
    columns ``write_start .. write_start + T - 1`` of every row; ``tree_attention(q, keys, values,
    tree_mask, kv_lens, scale, validate=False, tree_nodes)``; ``x += attn @ o``; ``x += down(silu(gate) *
    up)`` of ``rms_norm(x, post_norm)``.

    Args:
        x: [G, R * T, H] float32/bfloat16: G weight groups (stacked weights), R rows each of T tokens.
        weights: 11 entries: in_norm (or None), hidden_norm (EAGLE-3, else None), qkv, qkv_bias, o, o_bias,
            post_norm, gate_up, gate_up_bias, down, down_bias. Norms [H] or [G, H]; projections [out, in]
            (F.linear), oneDNN-packed [out, in] (``taps.lean.pack_weight``) or stacked [G, in, out] (bmm,
            biases [G, 1, out]); qkv's outputs are q's heads, then k's, then v's; gate_up's gate then up.
            All of x's dtype.
        eps: [in_norm, hidden_norm, post_norm] epsilons.
        dims: [heads, kv_heads, head_dim, fused_rope].
        cos, sin: [G * R, T, 1, D] rotary rows (sin with rotate_half's sign, ``taps.lean.RopeTable``).
        keys, values: [G * R, Hkv, S, D] caches, written in place.
        write_start: the cache column of the first new token (every row alike).
        write_positions: [G * R, T] int64 cache columns of each row's new tokens instead (ragged rows;
            ``write_start`` is then ignored; out-of-range columns raise).
        tree_mask, kv_lens, scale, tree_nodes: as :func:`tree_attention` takes them (no kv_lens check).
        emb: [G, R * T, H] token embeddings for the EAGLE-3 layer, else None.
        rows: packed tokens (G = 1): int64 [M], strictly increasing slots ``r * T + t`` of the R x T grid
            that the attention sees (T = ``tree_mask.shape[1]``, R = ``keys.shape[0]``); x (and emb) are then
            [1, M, H], cos / sin [1, M, 1, D] and ``write_positions`` [M] (each token's cache column, in row
            ``slot // T``). Only those M tokens are projected, written and returned; the attention runs over
            the grid with zero queries at the other slots (a ragged batch of trees without computing its
            padding nodes). Checked: distinct, in range (one host read).

    Returns:
        the layer's output, x's shape and dtype. No autograd: an inference op. Used by the engine on the
        CPU; on CUDA it runs the same ops (its test against the CPU passes on an H200, 2026-12-04).
    """
    # lists pass through as they are (the engine calls this once per layer with prepared lists)
    weights = weights if type(weights) is list else list(weights)
    eps = eps if type(eps) is list else [float(e) for e in eps]
    dims = dims if type(dims) is list else [int(d) for d in dims]
    scale = float(scale)
    if _decoder_layer_fast is not None and not torch.compiler.is_compiling():
        out = _decoder_layer_fast(x, emb, weights, eps, dims, cos, sin, keys, values, write_start, tree_mask, kv_lens,
                                  tree_nodes, scale, write_positions, rows)
        if out is not NotImplemented:
            return out
    return torch.ops.taps_ops.decoder_layer.default(
        x, emb, weights, eps, dims, cos, sin, keys, values, int(write_start), tree_mask, kv_lens, tree_nodes, scale,
        write_positions, rows)


from . import _fake  # noqa: E402,F401  (shape functions for torch.compile / FakeTensor)
from . import reference  # noqa: E402,F401  (taps_ops.reference.<op>_ref without a separate import)
