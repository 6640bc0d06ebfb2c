"""Plain-PyTorch reference implementations of every taps_ops operator.

Written for clarity, not speed: loops over requests and nodes, full softmax rows. The tests and the
benchmarks compare the kernels against these functions. They follow DESIGN.md exactly, including
tie-breaking and the way each node's uniform coin is used.
"""

from __future__ import annotations

import torch
from torch import Tensor

# ---------------------------------------------------------------------------------------------------
# verify_tree, build_tree, merge_trees
# ---------------------------------------------------------------------------------------------------

import math
from typing import List, Optional, Tuple, Union

_Scalar = Union[float, int, Tensor]


def _per_request_values(value: _Scalar, batch: int, name: str) -> List[float]:
    """A Python scalar or a [B] / [] tensor as a list of B Python numbers (float32/int64 values)."""
    if isinstance(value, Tensor):
        value = value.detach().cpu()
        if value.dim() == 0:
            value = value.reshape(1).expand(batch)
        if value.dim() != 1 or value.shape[0] != batch:
            raise ValueError(f"reference: {name} must be a scalar or a [B] = [{batch}] tensor")
        return value.tolist()
    return [value] * batch


def target_probs_ref(logits_row: Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """The target distribution p at one node (docs/SEMANTICS.md, verify_tree), exactly, in float64.

    logits_row: [V] any float dtype (converted to float32 first, as the kernels do).
    temperature 0 gives the one-hot on the argmax (ties to the lowest id), top-k/top-p ignored.
    Returns [V] float64 summing to 1.
    """
    return _target_weights(logits_row, temperature, top_k, top_p)[0]


def _target_weights(logits_row: Tensor, temperature: float, top_k: int, top_p: float) -> Tuple[Tensor, Tensor, float]:
    """(p [V] float64, w [V] float64 unnormalised weights of the kept set, top-p margin).

    The top-p margin is the distance, relative to Z, between P * Z and the cumulative mass at the
    chosen threshold or the next larger one: a small margin means float32 summation could pick a
    different kept set (math.inf when top-p is off).
    """
    x32 = logits_row.detach().to(device="cpu", dtype=torch.float32)
    v = x32.numel()
    temperature = float(temperature)
    top_k = int(top_k)
    top_p = float(torch.tensor(top_p, dtype=torch.float32))  # the kernels see float32 values
    if temperature == 0.0:
        p = torch.zeros(v, dtype=torch.float64)
        p[int(torch.argmax(x32))] = 1.0  # torch.argmax returns the first maximal index
        return p, p.clone(), math.inf
    x = x32.to(torch.float64)
    # 1. top-k: every token tied with the k-th largest value is kept.
    if 0 < top_k < v:
        tau_k = torch.sort(x, descending=True).values[top_k - 1]
        kept = x >= tau_k
    else:
        kept = torch.ones(v, dtype=torch.bool)
    # 2. weights relative to the row maximum.
    m = x.max()
    w = torch.where(kept, torch.exp((x - m) / float(torch.tensor(temperature, dtype=torch.float32))),
                    torch.zeros_like(x))
    z = float(w.sum())
    margin = math.inf
    # 3. top-p: the largest threshold t whose mass {x_v >= t} reaches P * Z.
    if top_p < 1.0:
        positive = (kept & (w > 0)).nonzero().flatten()
        values, order = torch.sort(x[positive], descending=True)
        mass = torch.cumsum(w[positive][order], 0)
        # mass of {x_v >= t} for each distinct value t: the running sum at the last copy of t.
        last_of_value = torch.ones_like(values, dtype=torch.bool)
        last_of_value[:-1] = values[:-1] != values[1:]
        values, mass = values[last_of_value], mass[last_of_value]
        target = top_p * z
        reached = (mass >= target).nonzero().flatten()
        j = int(reached[0]) if reached.numel() else len(values) - 1
        tau_p = float(values[j])
        previous = float(mass[j - 1]) if j > 0 else 0.0
        margin = min((float(mass[j]) - target) / z, (target - previous) / z)
        kept = kept & (x >= tau_p)
        w = torch.where(kept, w, torch.zeros_like(w))
        z = float(w.sum())
    return w / z, w, margin


def _inverse_cdf(weights: Tensor, order: List[int], coin: float) -> Tuple[int, float]:
    """Inverse-CDF draw over `order` (SEMANTICS.md): with t = coin * Z, the first token of the order
    where the running sum of weights exceeds t; if rounding lets the sum end at or below t, the last
    token of the order with a positive weight. Returns (token, margin): the smallest distance,
    relative to Z, between t and a partial sum (a small margin means float32 may choose a neighbour).
    """
    w = weights[order]
    z = float(weights.sum())
    t = coin * z
    sums = torch.cumsum(w, 0)
    margin = float((sums - t).abs().min()) / z if len(order) else math.inf
    above = (sums > t).nonzero()
    if above.numel() > 0:
        return order[int(above[0])], margin
    positive = (w > 0).nonzero()
    return order[int(positive[-1])], margin


def _check_verify_row(row: Tensor, b: int, node: int) -> None:
    if torch.isnan(row).any() or torch.isposinf(row).any() or not torch.isfinite(row).any():
        raise ValueError(f"reference.verify_tree: logits row of visited node {node} of request {b} has NaN, "
                         f"+inf or no finite value")


def verify_tree_ref(
    logits: Tensor,
    tokens: Tensor,
    parents: Tensor,
    *,
    temperature: _Scalar = 0.0,
    top_k: _Scalar = 0,
    top_p: _Scalar = 1.0,
    draft_probs: Optional[Tensor] = None,
    uniforms: Optional[Tensor] = None,
    return_margin: bool = False,
):
    """Reference of taps_ops.verify_tree, one request and one node at a time.

    Args as the op (logits [B, N, V], tokens/parents [B, N], per-request scalars or [B] tensors,
    draft_probs [B, N, V] or None, uniforms [B, N] float32; None = all zeros).
    Returns (tokens [B, N], num_accepted [B], path [B, N]) int64 on logits' device, and with
    return_margin=True also margin [B] float64: the smallest distance of any coin decision of that
    request from its boundary (inverse-CDF partial sums and top-p mass relative to Z, acceptance
    coins against r/q). A float32 kernel may legitimately differ where the margin is below ~1e-5.
    """
    batch, n, v = logits.shape
    if tuple(tokens.shape) != (batch, n) or tuple(parents.shape) != (batch, n):
        raise ValueError("reference.verify_tree: tokens and parents must be [B, N]")
    temps = [float(torch.tensor(t, dtype=torch.float32)) for t in _per_request_values(temperature, batch, "temperature")]
    ks = [int(k) for k in _per_request_values(top_k, batch, "top_k")]
    ps = [float(p) for p in _per_request_values(top_p, batch, "top_p")]
    if uniforms is None:
        uniforms = torch.zeros(batch, n)
    coins = uniforms.detach().cpu().to(torch.float32).to(torch.float64)
    tok = tokens.detach().cpu().tolist()
    par = parents.detach().cpu().tolist()
    out_tokens = torch.full((batch, n), -1, dtype=torch.int64)
    out_path = torch.full((batch, n), -1, dtype=torch.int64)
    num_accepted = torch.zeros(batch, dtype=torch.int64)
    margins = torch.full((batch,), math.inf, dtype=torch.float64)
    for b in range(batch):
        if temps[b] < 0 or not math.isfinite(temps[b]) or ks[b] < 0 or not (0.0 < ps[b] <= 1.0):
            raise ValueError("reference.verify_tree: temperature >= 0, top_k >= 0, 0 < top_p <= 1 required")
        if not bool(((coins[b] >= 0) & (coins[b] < 1)).all()):
            raise ValueError("reference.verify_tree: uniforms must be in [0, 1)")
        if par[b][0] != -1:
            raise ValueError("reference.verify_tree: parents[b, 0] must be -1")
        real = 1
        while real < n and par[b][real] != -1:
            real += 1
        for i in range(1, n):
            if i < real and not (0 <= tok[b][i] < v and 0 <= par[b][i] < i):
                raise ValueError(f"reference.verify_tree: node {i} of request {b} has token {tok[b][i]} or parent "
                                 f"{par[b][i]} out of range")
            if i >= real and (tok[b][i] != -1 or par[b][i] != -1):
                raise ValueError(f"reference.verify_tree: node {i} of request {b} follows padding but is not padding")
        children = [[] for _ in range(n)]
        for i in range(1, real):
            children[par[b][i]].append(i)
        greedy = temps[b] == 0.0
        margin = math.inf
        cur = 0
        path = [0]
        emitted = []

        def weights_at(node: int) -> Tuple[Tensor, Tensor]:
            nonlocal margin
            row = logits[b, node].detach().cpu().to(torch.float32)
            _check_verify_row(row, b, node)
            p, w, top_p_margin = _target_weights(row, temps[b], ks[b], ps[b])
            margin = min(margin, top_p_margin)
            return p, w

        if draft_probs is None or greedy:
            while True:
                p, w = weights_at(cur)
                kids = children[cur]
                if greedy:
                    y = int(torch.argmax(p))
                else:
                    child_tokens = list(dict.fromkeys(tok[b][c] for c in kids))  # distinct, sibling order
                    rest = sorted(set(range(v)) - set(child_tokens))
                    y, draw_margin = _inverse_cdf(w, child_tokens + rest, float(coins[b, cur]))
                    margin = min(margin, draw_margin)
                match = [c for c in kids if tok[b][c] == y]
                if not match:
                    emitted.append(y)
                    break
                cur = match[0]
                path.append(cur)
                emitted.append(y)
        else:
            coin = float(coins[b, 0])
            p, _ = weights_at(cur)
            r = p.clone()
            while True:
                q = draft_probs[b, cur].detach().cpu().to(torch.float32).to(torch.float64)
                moved = False
                for c in children[cur]:
                    s = tok[b][c]
                    u = float(coins[b, c])
                    q_s, r_s = float(q[s]), float(r[s])
                    margin = min(margin, abs(u - r_s / q_s) if q_s > 0 else r_s)
                    if u * q_s < r_s:
                        coin = u if q_s <= r_s else u * q_s / r_s
                        cur = c
                        path.append(c)
                        emitted.append(s)
                        p, _ = weights_at(cur)
                        r = p.clone()
                        moved = True
                        break
                    residual = torch.clamp(r - q, min=0.0)
                    if float(residual.sum()) > 0:
                        r = residual / residual.sum()
                if not moved:
                    y, draw_margin = _inverse_cdf(r, list(range(v)), coin)
                    margin = min(margin, draw_margin)
                    emitted.append(y)
                    break
        out_path[b, : len(path)] = torch.tensor(path)
        out_tokens[b, : len(emitted)] = torch.tensor(emitted)
        num_accepted[b] = len(path) - 1
        margins[b] = margin
    result = (out_tokens.to(logits.device), num_accepted.to(logits.device), out_path.to(logits.device))
    return result + (margins,) if return_margin else result


def _select_and_order(nodes: List[dict], num_nodes: int) -> List[dict]:
    """Shared selection and output order of build_tree and merge_trees (SEMANTICS.md, build_tree).

    `nodes`: dicts with keys score, parent (index into `nodes` or -1 for the root), key (the candidate
    index / position key), in an order where every parent precedes its children. Returns the kept
    nodes in output order, each with its `out_parent` (output index of its parent, 0 = root) set.
    """
    for node in nodes:
        if math.isnan(node["score"]):
            raise ValueError("reference: NaN score")
        if node["parent"] < 0:
            node["depth"], node["eff"] = 1, node["score"]
        else:
            parent = nodes[node["parent"]]
            node["depth"], node["eff"] = parent["depth"] + 1, min(node["score"], parent["eff"])
    ranked = sorted(range(len(nodes)), key=lambda i: (-nodes[i]["eff"], nodes[i]["depth"], nodes[i]["key"]))
    kept = set(ranked[: max(num_nodes - 1, 0)])
    for i in kept:
        assert nodes[i]["parent"] < 0 or nodes[i]["parent"] in kept, "selection not closed under ancestors"
    out_index = {-1: 0}
    ordered: List[dict] = []
    depth = 1
    while len(ordered) < len(kept):
        level = [i for i in kept if nodes[i]["depth"] == depth]
        level.sort(key=lambda i: (out_index[nodes[i]["parent"]], -nodes[i]["score"], nodes[i]["key"]))
        for i in level:
            out_index[i] = len(ordered) + 1
            nodes[i]["out_parent"] = out_index[nodes[i]["parent"]]
            ordered.append(nodes[i])
        depth += 1
    return ordered


def _tree_tensors(ordered: List[dict], root_token: int, num_nodes: int, last_field: str, root_last: int,
                  pad_last: int):
    """One request's output rows (tokens, parents, depth, tree_mask, scores, last_field): the last
    field is `root_last` at the root and `pad_last` at padding nodes."""
    words = (num_nodes + 63) // 64
    tokens = [-1] * num_nodes
    parents = [-1] * num_nodes
    depth = [-1] * num_nodes
    scores = [-math.inf] * num_nodes
    last = [pad_last] * num_nodes
    masks = [0] * num_nodes  # Python ints as bitsets
    tokens[0], depth[0], scores[0], masks[0], last[0] = root_token, 0, 0.0, 1, root_last
    for j, node in enumerate(ordered, start=1):
        tokens[j], parents[j], scores[j] = node["token"], node["out_parent"], node["score"]
        depth[j] = depth[parents[j]] + 1
        masks[j] = masks[parents[j]] | (1 << j)
        last[j] = node[last_field]
    mask = torch.zeros(num_nodes, words, dtype=torch.int64)
    for i, bits in enumerate(masks):
        for w in range(words):
            word = (bits >> (64 * w)) & ((1 << 64) - 1)
            mask[i, w] = word - (1 << 64) if word >= (1 << 63) else word
    return (torch.tensor(tokens, dtype=torch.int64), torch.tensor(parents, dtype=torch.int64),
            torch.tensor(depth, dtype=torch.int64), mask, torch.tensor(scores, dtype=torch.float32),
            torch.tensor(last, dtype=torch.int64))


def _stack_requests(rows: list, device) -> Tuple[Tensor, ...]:
    return tuple(torch.stack([r[f] for r in rows]).to(device) for f in range(6))


def build_tree_ref(scores: Tensor, tokens: Tensor, parents: Tensor, num_nodes: int,
                   root_tokens: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
    """Reference of taps_ops.build_tree: (tokens, parents, depth, tree_mask, scores, candidate_index).

    scores [B, M] float32, tokens/parents [B, M] int64 (token < 0 = padding candidate, parent -1 = the
    root), root_tokens [B] or None. Outputs [B, num_nodes] (tree_mask [B, num_nodes, ceil(num_nodes/64)]).
    """
    if num_nodes < 1:
        raise ValueError("reference.build_tree: num_nodes must be >= 1")
    batch, m = scores.shape
    sc = scores.detach().cpu().to(torch.float32).tolist()
    tok = tokens.detach().cpu().tolist()
    par = parents.detach().cpu().tolist()
    roots = root_tokens.detach().cpu().tolist() if root_tokens is not None else [-1] * batch
    rows = []
    for b in range(batch):
        nodes, index_of = [], {}
        for c in range(m):
            if tok[b][c] < 0:
                continue
            p = par[b][c]
            if p != -1 and p not in index_of:
                raise ValueError(f"reference.build_tree: candidate {c} of request {b} has parent {p}, not -1 or "
                                 f"an earlier real candidate")
            index_of[c] = len(nodes)
            nodes.append(dict(score=sc[b][c], parent=index_of[p] if p != -1 else -1, key=c, token=tok[b][c],
                              candidate_index=c))
        ordered = _select_and_order(nodes, num_nodes)
        rows.append(_tree_tensors(ordered, int(roots[b]), num_nodes, "candidate_index", -1, -1))
    if batch == 0:
        words = (num_nodes + 63) // 64
        e = dict(dtype=torch.int64, device=scores.device)
        return (torch.empty(0, num_nodes, **e), torch.empty(0, num_nodes, **e), torch.empty(0, num_nodes, **e),
                torch.empty(0, num_nodes, words, **e), torch.empty(0, num_nodes, device=scores.device),
                torch.empty(0, num_nodes, **e))
    return _stack_requests(rows, scores.device)


def merge_trees_ref(tokens: Tensor, parents: Tensor, scores: Tensor, num_nodes: Optional[int] = None,
                    weights: Optional[Tensor] = None) -> Tuple[Tensor, ...]:
    """Reference of taps_ops.merge_trees: (tokens, parents, depth, tree_mask, scores, source).

    tokens/parents [B, T, N] int64 trees in the tree format (node 0 the shared root; node i > 0 is
    real iff its token is >= 0), scores [B, T, N] float32, weights [T] or [B, T] log-weights or None.
    The union is a trie over token paths; merged score = max(score + weight), source = OR of 1 << t,
    position key = the smallest (t, node index) of its occurrences; then build_tree's selection/order.
    """
    batch, num_trees, n = tokens.shape
    if not 1 <= num_trees <= 63:
        raise ValueError("reference.merge_trees: 1 to 63 trees per request")
    if num_nodes is None:
        num_nodes = num_trees * max(n - 1, 0) + 1
    if num_nodes < 1:
        raise ValueError("reference.merge_trees: num_nodes must be >= 1")
    adjusted = scores.detach().cpu().to(torch.float32)
    if weights is not None:
        w = torch.as_tensor(weights, dtype=torch.float32).detach().cpu()
        if w.dim() == 1:
            w = w.unsqueeze(0).expand(batch, -1)
        adjusted = adjusted + w[:, :, None]  # float32 addition, as the kernels do
    sc = adjusted.tolist()
    tok = tokens.detach().cpu().tolist()
    par = parents.detach().cpu().tolist()
    rows = []
    for b in range(batch):
        trie = {}  # token path (tuple) -> merged node dict; dict order = insertion order
        for t in range(num_trees):
            if par[b][t][0] != -1 or tok[b][t][0] != tok[b][0][0]:
                raise ValueError(f"reference.merge_trees: tree {t} of request {b}: the root must have parent -1 "
                                 f"and tree 0's root token")
            paths = {0: ()}
            for i in range(1, n):
                if tok[b][t][i] < 0:
                    if tok[b][t][i] != -1 or par[b][t][i] != -1:
                        raise ValueError("reference.merge_trees: a padding node must have token -1 and parent -1")
                    continue
                p = par[b][t][i]
                if tok[b][t][i - 1] < 0 and i >= 2:
                    raise ValueError("reference.merge_trees: a real node follows a padding node")
                if not (0 <= p < i) or p not in paths:
                    raise ValueError(f"reference.merge_trees: node {i} of tree {t} of request {b} has parent {p}, "
                                     f"not an earlier real node")
                path = paths[p] + (tok[b][t][i],)
                paths[i] = path
                s = sc[b][t][i]
                if math.isnan(s):
                    raise ValueError("reference.merge_trees: NaN score")
                node = trie.get(path)
                if node is None:
                    trie[path] = dict(score=s, key=(t, i), source=1 << t, token=path[-1], path=path)
                else:
                    node["score"] = max(node["score"], s)
                    node["key"] = min(node["key"], (t, i))
                    node["source"] |= 1 << t
        # every parent path is inserted before its children (topological input order).
        nodes = list(trie.values())
        index_of = {node["path"]: k for k, node in enumerate(nodes)}
        for node in nodes:
            node["parent"] = index_of[node["path"][:-1]] if len(node["path"]) > 1 else -1
        ordered = _select_and_order(nodes, num_nodes)
        # the root is in every tree; padding nodes are in none.
        rows.append(_tree_tensors(ordered, int(tok[b][0][0]), num_nodes, "source", (1 << num_trees) - 1, 0))
    if batch == 0:
        words = (num_nodes + 63) // 64
        e = dict(dtype=torch.int64, device=scores.device)
        return (torch.empty(0, num_nodes, **e), torch.empty(0, num_nodes, **e), torch.empty(0, num_nodes, **e),
                torch.empty(0, num_nodes, words, **e), torch.empty(0, num_nodes, device=scores.device),
                torch.empty(0, num_nodes, **e))
    return _stack_requests(rows, scores.device)


# ---------------------------------------------------------------------------------------------------
# tree_attention, compact_kv
# ---------------------------------------------------------------------------------------------------


def tree_attention_dense_mask(tree_mask: Tensor, kv_lens: Tensor, cache_len: int,
                              tree_nodes: Optional[int] = None) -> Tensor:
    """The dense boolean visibility mask [B, N, S] of tree_attention (True = query i sees key s).

    Request b, with T = tree_nodes (default N): positions < kv_lens[b] - T (the prefix) are visible to
    every query, position kv_lens[b] - T + j (tree node j) is visible to query i iff bit j of
    tree_mask[b, i] is set, positions >= kv_lens[b] are not visible.
    """
    batch, num_queries = tree_mask.shape[0], tree_mask.shape[1]
    num_nodes = num_queries if tree_nodes is None else int(tree_nodes)
    device = tree_mask.device
    nodes = torch.arange(num_nodes, device=device)
    words = tree_mask.to(torch.int64)[:, :, nodes // 64]  # [B, N, T]: word holding bit j, per column j
    tree_bits = ((words >> (nodes % 64)) & 1).bool()  # [B, N(query), T(node)]
    mask = torch.zeros((batch, num_queries, cache_len), dtype=torch.bool, device=device)
    for b in range(batch):
        length = int(kv_lens[b])
        start = length - num_nodes
        mask[b, :, :start] = True
        mask[b, :, start:length] = tree_bits[b]
    return mask


def tree_attention_ref(q: Tensor, k: Tensor, v: Tensor, tree_mask: Tensor, kv_lens: Tensor,
                       scale: Optional[float] = None, dtype: torch.dtype = torch.float64,
                       tree_nodes: Optional[int] = None, num_queries: Optional[Tensor] = None) -> Tensor:
    """Dense-mask attention: softmax(q k^T * scale + mask) v, computed in `dtype` (float64 default).

    q [B, Hq, N, D]; k, v [B, Hkv, S, D] (query head h uses KV head h // (Hq // Hkv));
    tree_mask [B, N, W] int64; kv_lens [B] int64 with T <= kv_lens[b] <= S (T = tree_nodes, default N);
    num_queries [B] int64 or None: request b's rows i >= num_queries[b] are zeros.
    Returns [B, Hq, N, D] in `dtype` (the tests cast as they need). A row that sees no key gives 0.
    """
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    group = q.shape[1] // k.shape[1]
    qf, kf, vf = q.to(dtype), k.to(dtype), v.to(dtype)
    kf = kf.repeat_interleave(group, dim=1)
    vf = vf.repeat_interleave(group, dim=1)
    mask = tree_attention_dense_mask(tree_mask, kv_lens, k.shape[2], tree_nodes)[:, None]  # [B, 1, N, S]
    scores = (qf @ kf.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # all-masked rows -> 0
    out = probs @ vf
    if num_queries is not None:
        dead = torch.arange(q.shape[2], device=q.device) >= num_queries.to(q.device).view(-1, 1)  # [B, N]
        out = out.masked_fill(dead[:, None, :, None], 0.0)
    return out


def compact_kv_ref(caches: List[Tensor], path: Tensor, prefix_lens: Tensor) -> List[Tensor]:
    """compact_kv without side effects: returns new tensors where, for each request b, entry j of
    path[b] (up to its first -1) has moved from position prefix_lens[b] + path[b, j] to
    prefix_lens[b] + j; every other position is unchanged.
    """
    out = []
    for cache in caches:
        new = cache.clone()
        for b in range(path.shape[0]):
            row = path[b]
            n = int((row >= 0).cumprod(0).sum())  # entries before the first -1
            if n == 0:
                continue
            prefix = int(prefix_lens[b])
            src = (row[:n].to(cache.device) + prefix)
            dst = torch.arange(n, device=cache.device) + prefix
            new[b].index_copy_(1, dst, cache[b].index_select(1, src))
        out.append(new)
    return out


def panel_linear_ref(x: Tensor, panels: Tensor, bias: Optional[Tensor] = None) -> Tensor:
    """``x W^T + bias`` in float64 (returned as float64: the reference the float32 kernel is within rounding
    of), W [out, in] read back from panels (:func:`taps_ops.pack_panels`): float32 [out / 16, in, 16] or
    bfloat16 [out / 16, ceil(in / 2), 16, 2] (in = x's last dimension)."""
    if panels.dim() == 4:
        count, pairs, width, _ = panels.shape
        weight = panels.permute(0, 2, 1, 3).reshape(count * width, 2 * pairs)[:, :x.shape[-1]].double()
    else:
        count, inner, width = panels.shape
        weight = panels.permute(0, 2, 1).reshape(count * width, inner).double()
    y = x.double() @ weight.t()
    return y if bias is None else y + bias.double()


def head_argmax_ref(x: Tensor, screen: Tensor, meta: Tensor, panels: Tensor) -> Tensor:
    """The argmax (ties to the lowest id) of :func:`panel_linear_ref`'s float64 product: what
    :func:`taps_ops.head_argmax` gives wherever a row's two largest logits lie further apart than float32 (for
    bfloat16 x, bfloat16) rounding; the op's own contract is the float32 kernel's argmax bit for bit. The screen
    and meta are not read (the reference needs no screen)."""
    return panel_linear_ref(x, panels).argmax(-1)


def rms_norm_ref(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """Hugging Face's Llama RMSNorm, ``weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype)``,
    for weight [H] or [G, H] (x's rows in G consecutive blocks, as in :func:`taps_ops.rms_norm`)."""
    width = x.shape[-1]
    rows = x.reshape(-1, width)
    w = weight.reshape(-1, width)
    groups = w.shape[0]
    xf = rows.float()
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    out = normed.view(groups, -1, width) * w.unsqueeze(1)
    return out.reshape(x.shape)


def rope_ref(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """``x * cos + x.roll(D // 2, -1) * sin`` for x [R, T, H, D] and cos / sin [R, T, D] or [R, T, 1, D]
    (a new tensor; :func:`taps_ops.rope_` writes the same values into x)."""
    if cos.dim() == 3:
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


def expand_level_ref(logits: Tensor, front_scores: Tensor, front_cands: Tensor, k: int, next_k: int = 0,
                     cand_offset: int = 0, token_map: Optional[Tensor] = None, with_entropy: bool = False):
    """Plain-PyTorch :func:`taps_ops.expand_level` (an ``ExpandLevel`` tuple): log_softmax in float32, a
    stable sort for the order (higher value first, ties to the lower index, NaN as -inf)."""
    from . import ExpandLevel

    rows, front, vocab = logits.shape
    logp = torch.log_softmax(logits.float(), -1)
    rank = torch.nan_to_num(logits.float(), nan=-math.inf, posinf=math.inf, neginf=-math.inf)
    ids = torch.sort(rank, dim=-1, descending=True, stable=True).indices[..., :k]          # [R, F, k]
    child_logp = logp.gather(-1, ids)
    scores = (front_scores.unsqueeze(-1) + child_logp).reshape(rows, front * k)
    tokens = (token_map[ids] if token_map is not None else ids).reshape(rows, front * k)
    parents = front_cands.unsqueeze(-1).expand(rows, front, k).reshape(rows, front * k)
    if with_entropy:
        p = logp.exp()
        entropy = -(p * torch.where(torch.isfinite(logp), logp, torch.zeros_like(logp))).sum(-1).sum(-1)
    else:
        entropy = torch.zeros(rows, dtype=torch.float32, device=logits.device)
    order = torch.sort(torch.nan_to_num(scores, nan=-math.inf), dim=-1, descending=True, stable=True).indices
    nxt = order[:, :next_k]
    return ExpandLevel(scores, tokens, parents, entropy, scores.gather(1, nxt), tokens.gather(1, nxt),
                       torch.div(nxt, k, rounding_mode="floor"), cand_offset + nxt)
