"""taps_ops.decoder_layer: one lean decoder layer as one op call.

1. Bit for bit the Python body it replaces (taps.lean.decoder_layer / eagle3_layer with the same
   TreeAttend, called through a plain callback so that the Python body runs): output and the K/V written
   to the caches, for fp32 (plain F.linear weights) and bf16 (oneDNN-packed weights), one weight set and
   G = 2 stacked sets (bmm), with and without biases (Qwen2), without an input norm (EAGLE-1/2's first
   layer), the EAGLE-3 layer (embedding beside x), the torch rotary form (bf16 rows wider than
   taps.lean's fused limit), odd sizes, T < tree_nodes.
2. Bad inputs raise clear errors (a fuzz over every argument).
3. The engine takes the op: a decoding step's lean layers run through it.
"""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_ops  # noqa: E402
from taps import lean  # noqa: E402
from taps.kv import TreeAttend, pack_bits  # noqa: E402
from taps.lean import LayerWeights, Norm, RopeTable, decoder_layer, eagle3_layer  # noqa: E402


def _layers(arch="llama", groups=1, dtype=torch.float32, seed=0, **extra):
    prefix = {"llama": "Llama", "qwen2": "Qwen2"}[arch]
    kw = dict(vocab_size=31, hidden_size=48, intermediate_size=40, num_hidden_layers=1, num_attention_heads=6,
              num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False)
    kw.update(extra)
    models = []
    for g in range(groups):
        torch.manual_seed(seed + g)
        m = getattr(transformers, prefix + "ForCausalLM")(getattr(transformers, prefix + "Config")(**kw)).eval()
        with torch.no_grad():
            for name, p in m.named_parameters():
                p.add_(torch.randn_like(p) * 0.2)   # non-trivial norms and biases
        models.append(m.to(dtype))
    return models


def _inputs(w: LayerWeights, groups, rows, tokens, tree_nodes, prefix, dtype, seed=1):
    gen = torch.Generator().manual_seed(seed)
    gb = groups * rows
    hidden = w.post_norm.rows.shape[-1]
    x = torch.randn(groups, rows * tokens, hidden, generator=gen).to(dtype)
    span = prefix + tree_nodes
    size = span + 3                                       # cache columns past the live ones
    keys = torch.randn(gb, w.kv_heads, size, w.head_dim, generator=gen).to(dtype)
    values = torch.randn(gb, w.kv_heads, size, w.head_dim, generator=gen).to(dtype)
    dense = torch.rand(gb, tokens, tree_nodes, generator=gen) < 0.5
    bits = pack_bits(dense)
    kv_lens = torch.full((gb,), span, dtype=torch.int64)
    return x, keys, values, bits, kv_lens, span - tokens


def _rope(models, w, gb, tokens, start, dtype):
    table = RopeTable(models[0].model.rotary_emb, dtype)
    table.ensure(start + tokens, torch.device("cpu"))
    positions = torch.randint(0, start + tokens, (gb, tokens), generator=torch.Generator().manual_seed(7))
    return table(positions)


def _both(run, keys, values):
    """(output, keys, values) of the op path and of the Python path, each on its own cache copies."""
    out = []
    for use_op in (True, False):
        k, v = keys.clone(), values.clone()
        out.append((run(k, v, use_op), k, v))
    return out


def _check_equal(results):
    (a, ka, va), (b, kb, vb) = results
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a, b), f"max diff {(a.float() - b.float()).abs().max().item()}"
    assert torch.equal(ka, kb) and torch.equal(va, vb)


@pytest.fixture(params=["plain", "stacked", "panels", "panels_bf16"])
def layout(request, monkeypatch):
    """A single float32 projection as the [out, in] weight, stacked [1, in, out] or taps' panels
    (LayerWeights.pack keeps the one timed fastest on the machine: Linear.choose_small_layout); every layout
    tested everywhere (panels where the projection's shape allows them). "panels_bf16": bfloat16 weights
    widened as on a CPU without bf16 products, kept as bfloat16 panels (float32 weights: float32 panels)."""
    def choose(shape, panels=True, repeats=3, stacked=True, bf16=False, packed=False):
        want = "panels" if request.param == "panels_bf16" and not bf16 else request.param
        if (want.startswith("panels") and not panels) or (want == "stacked" and not stacked):
            return "plain"
        return want
    monkeypatch.setattr(lean, "small_layout", choose)
    # a CPU with bf16 products (below amx) times bf16 panels against oneDNN (Linear.pack): not these layouts
    monkeypatch.setattr(lean, "native_half_layout", lambda shape, repeats=3: "packed")
    if request.param == "panels_bf16":
        monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: False)
    return request.param


CASES = [
    # arch, groups, dtype, no input norm, config extras
    ("llama", 1, torch.float32, False, {}),
    ("llama", 1, torch.bfloat16, False, {}),
    ("qwen2", 1, torch.float32, False, {"use_sliding_window": False}),
    ("qwen2", 1, torch.bfloat16, False, {"use_sliding_window": False}),
    ("llama", 2, torch.float32, False, {}),
    ("llama", 2, torch.bfloat16, False, {}),
    ("qwen2", 3, torch.float32, False, {"use_sliding_window": False}),
    ("llama", 1, torch.float32, True, {}),
    ("llama", 2, torch.bfloat16, True, {}),
    # (6 + 2) heads x 144 > taps.lean's fused rotary width for bf16: the torch rotary form
    ("llama", 1, torch.bfloat16, False, {"head_dim": 144}),
    ("llama", 1, torch.float32, False, {"head_dim": 144}),
]


@pytest.mark.parametrize("arch,groups,dtype,no_in_norm,extra", CASES)
# (2, 9, 9, 7): 18 rows a product, where the op's panel products ask the next projection's panels into L2 as they
# finish (taps::follow_panels, a hint: the same bits as the Python layer's separate calls)
@pytest.mark.parametrize("rows,tokens,tree_nodes,prefix", [(1, 1, 1, 5), (3, 5, 7, 11), (2, 4, 4, 0), (2, 9, 9, 7)])
@torch.no_grad()
def test_op_equals_the_python_layer_bit_for_bit(arch, groups, dtype, no_in_norm, extra, rows, tokens, tree_nodes,
                                                prefix, layout):
    models = _layers(arch, groups, dtype, **extra)
    w = LayerWeights([m.model.layers[0] for m in models])
    if no_in_norm:
        w.in_norm = None
    else:
        w.in_norm.eps = 0.01       # distinct epsilons, so that one used in the other's place shows
    w.post_norm.eps = 0.05
    w.pack()
    assert w.op_args is not None
    projections = (w.qkv, w.o, w.gate_up, w.down)
    # (G > 1 groups too: each group's panels stacked, a panel product per group)
    fp32 = all(p.weight.dtype == torch.float32 for p in projections)
    assert all((p.panels is not None) == (layout.startswith("panels") and fp32) for p in projections)
    if layout == "panels_bf16":   # widened bfloat16 weights as bfloat16 panels
        assert all(p.panels.dtype == dtype for p in projections)
    if groups > 1 and layout.startswith("panels") and fp32:
        assert all(p.panels.shape[0] == groups for p in projections)
    x, keys, values, bits, kv_lens, start = _inputs(w, groups, rows, tokens, tree_nodes, prefix, dtype)
    if prefix == 0:   # no prefix: every query sees at least itself (its node, the last `tokens` of the tree)
        itself = torch.eye(tokens, tree_nodes, dtype=torch.bool).roll(tree_nodes - tokens, 1)
        bits = bits | pack_bits(itself.expand(groups * rows, tokens, tree_nodes))
    cos, sin = _rope(models, w, groups * rows, tokens, start, dtype)
    fused_rope = bool(w.op_args[2][3])
    assert fused_rope == (dtype == torch.float32 or "head_dim" not in extra)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, tree_nodes, start)
        callback = attend if use_op else (lambda *a: attend(*a))
        return decoder_layer(w, 0, x, cos, sin, callback, rows, tokens)

    _check_equal(_both(run, keys, values))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [700, 1500])
@torch.no_grad()
def test_long_inputs_op_equals_the_python_layer(dtype, tokens):
    """The op's elementwise steps and layout copies run as loops up to 64 Ki elements a tensor and through ATen's
    kernels beyond (a prefill): both equal the Python layer bit for bit (700 tokens: gate_up's 56 Ki elements in
    the loops, 1,500: every step through ATen), also where the residual stream holds infinities and NaN."""
    models = _layers("qwen2", 2, dtype, use_sliding_window=False)
    w = LayerWeights([m.model.layers[0] for m in models]).pack()
    x, keys, values, bits, kv_lens, start = _inputs(w, 2, 1, tokens, tokens, 3, dtype)
    x[0, 5, 3], x[1, 7, 0], x[0, 9, :] = float("inf"), float("nan"), -float("inf")
    cos, sin = _rope(models, w, 2, tokens, start, dtype)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, tokens, start)
        callback = attend if use_op else (lambda *a: attend(*a))
        return decoder_layer(w, 0, x, cos, sin, callback, 1, tokens)

    (a, ka, va), (b, kb, vb) = _both(run, keys, values)
    assert a.dtype == b.dtype and a.shape == b.shape
    assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num())
    assert torch.equal(ka.nan_to_num(), kb.nan_to_num()) and torch.equal(va.nan_to_num(), vb.nan_to_num())


@pytest.mark.parametrize("arch,groups,dtype", [("llama", 1, torch.float32), ("qwen2", 1, torch.bfloat16),
                                                ("llama", 2, torch.bfloat16), ("llama", 3, torch.float32)])
@torch.no_grad()
@pytest.mark.usefixtures("layout")
def test_ragged_rows_op_equals_the_python_layer(arch, groups, dtype):
    """write_positions: each row's new K/V at its own columns (a scatter), its tree the last tree_nodes keys
    of its own kv_lens; bit for bit the Python body with the same TreeAttend."""
    extra = {"use_sliding_window": False} if arch == "qwen2" else {}
    models = _layers(arch, groups, dtype, **extra)
    w = LayerWeights([m.model.layers[0] for m in models]).pack()
    rows, tokens, tree_nodes, prefix = 3, 4, 6, 9
    x, keys, values, bits, _, _ = _inputs(w, groups, rows, tokens, tree_nodes, prefix, dtype)
    gb = groups * rows
    lengths = torch.tensor([prefix - 3 * (r % 3) for r in range(gb)])         # ragged prefixes
    first = lengths + tree_nodes - tokens                                      # columns of the T new nodes
    positions = first.unsqueeze(1) + torch.arange(tokens)
    kv_lens = lengths + tree_nodes
    cos, sin = _rope(models, w, gb, tokens, prefix, dtype)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, tree_nodes, 0, positions=positions)
        callback = attend if use_op else (lambda *a: attend(*a))
        return decoder_layer(w, 0, x, cos, sin, callback, rows, tokens)

    results = _both(run, keys, values)
    _check_equal(results)
    (_, k_op, _), _ = results
    written = k_op[torch.arange(gb).unsqueeze(1), :, positions]                # [GB, T, Hkv, D]
    assert not torch.equal(written, keys[torch.arange(gb).unsqueeze(1), :, positions])  # the scatter happened


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("groups", [1, 2])
@torch.no_grad()
@pytest.mark.usefixtures("layout")
def test_eagle3_layer_op_equals_the_python_layer(dtype, groups):
    hidden = 32
    models = _layers("llama", groups, dtype, hidden_size=hidden, num_attention_heads=4, head_dim=8)
    gen = torch.Generator().manual_seed(3)
    for m in models:   # the EAGLE-3 layer's q/k/v read 2H features
        attn = m.model.layers[0].self_attn
        for name in ("q_proj", "k_proj", "v_proj"):
            old = getattr(attn, name)
            new = torch.nn.Linear(2 * hidden, old.out_features, bias=False).to(dtype)
            new.weight.copy_(torch.randn(new.weight.shape, generator=gen).to(dtype) * 0.2)
            setattr(attn, name, new)
    w = LayerWeights([m.model.layers[0] for m in models])
    w.in_norm.eps, w.post_norm.eps = 0.01, 0.05
    w.pack()
    norm_w = [torch.randn(hidden, generator=gen).to(dtype) for _ in models]
    hidden_norm = Norm(norm_w, 0.02)
    rows, tokens, tree_nodes, prefix = 2, 3, 6, 9
    x, keys, values, bits, kv_lens, start = _inputs(w, groups, rows, tokens, tree_nodes, prefix, dtype)
    emb = torch.randn(x.shape, generator=gen).to(dtype)
    cos, sin = _rope(models, w, groups * rows, tokens, start, dtype)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, tree_nodes, start)
        callback = attend if use_op else (lambda *a: attend(*a))
        return eagle3_layer(w, hidden_norm, 0, emb, x, cos, sin, callback, rows, tokens)

    _check_equal(_both(run, keys, values))


def _packed_case(w, models, dtype, rows=3, tokens=5, prefix=9, real=(5, 1, 3), seed=1):
    """A ragged batch of `rows` trees of `tokens` slots each, row r's first real[r] real: the packed
    inputs (x [1, M, H], cos / sin [1, M, 1, D], slots, columns), the padded ones (x [1, R * T, H], cos / sin
    [R, T, 1, D], the columns [R, T]) and the caches, bits and kv_lens both use."""
    x, keys, values, _, _, _ = _inputs(w, 1, rows, tokens, tokens, prefix, dtype, seed=seed)
    # a tree's real nodes see real nodes only (padding comes after them: DESIGN's tree format)
    dense = torch.rand(rows, tokens, tokens, generator=torch.Generator().manual_seed(seed + 1)) < 0.5
    dense &= (torch.arange(tokens) < torch.tensor(real).unsqueeze(1)).unsqueeze(1)
    bits = pack_bits(dense)
    lengths = torch.tensor([prefix - 2 * (r % 3) for r in range(rows)])           # ragged prefixes
    columns = lengths.unsqueeze(1) + torch.arange(tokens)                           # [R, T]
    kv_lens = lengths + tokens
    cos, sin = _rope(models, w, rows, tokens, prefix + tokens, dtype)
    slots = torch.tensor([r * tokens + t for r in range(rows) for t in range(real[r])])
    packed = (x[:, slots], cos.reshape(rows * tokens, 1, -1)[slots].unsqueeze(0),
              sin.reshape(rows * tokens, 1, -1)[slots].unsqueeze(0), slots, columns.reshape(-1)[slots])
    return packed, (x, cos, sin, columns), keys, values, bits, kv_lens


@pytest.mark.parametrize("arch,dtype", [("llama", torch.float32), ("llama", torch.bfloat16),
                                        ("qwen2", torch.float32), ("qwen2", torch.bfloat16)])
@pytest.mark.parametrize("real", [(5, 1, 3), (1, 1, 1), (5, 5, 4), (2, 5, 5)])
@torch.no_grad()
@pytest.mark.usefixtures("layout")
def test_packed_rows_op_equals_the_python_layer_and_the_padded_layer(arch, dtype, real):
    """rows (a ragged batch of trees without its padding nodes): bit for bit the Python body with the same
    packed TreeAttend (output and caches); against the padded layer (every slot computed), the same real rows
    within rounding (the products run over fewer rows), the same K/V written at the real nodes' columns, and
    nothing written at the padding nodes' columns."""
    extra = {"use_sliding_window": False} if arch == "qwen2" else {}
    models = _layers(arch, 1, dtype, **extra)
    w = LayerWeights([models[0].model.layers[0]]).pack()
    rows, tokens = 3, 5
    (px, pcos, psin, slots, pcols), (x, cos, sin, columns), keys, values, bits, kv_lens = _packed_case(
        w, models, dtype, rows, tokens, real=real)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, tokens, 0, packed=(slots, pcols))
        callback = attend if use_op else (lambda *a: attend(*a))
        return decoder_layer(w, 0, px, pcos, psin, callback, 1, px.shape[1])

    results = _both(run, keys, values)
    _check_equal(results)
    (out, k_packed, v_packed), _ = results
    assert out.shape == (1, sum(real), x.shape[-1])
    kp, vp = keys.clone(), values.clone()
    padded = decoder_layer(w, 0, x, cos, sin, TreeAttend([(kp, vp)], [w], bits, kv_lens, tokens, 0, positions=columns),
                           rows, tokens)
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=3e-2, rtol=3e-2)
    torch.testing.assert_close(out[0], padded[0, slots], **tol)
    cache_rows = slots // tokens
    torch.testing.assert_close(k_packed[cache_rows, :, pcols], kp[cache_rows, :, pcols], **tol)
    torch.testing.assert_close(v_packed[cache_rows, :, pcols], vp[cache_rows, :, pcols], **tol)
    pad = torch.tensor([s for s in range(rows * tokens) if s not in set(slots.tolist())], dtype=torch.int64)
    if len(pad):   # the padding nodes' columns keep what the cache held
        pad_cols = columns.reshape(-1)[pad]
        assert torch.equal(k_packed[pad // tokens, :, pad_cols], keys[pad // tokens, :, pad_cols])
        assert torch.equal(v_packed[pad // tokens, :, pad_cols], values[pad // tokens, :, pad_cols])


def _packed_call():
    models = _layers("qwen2", 1, torch.float32, use_sliding_window=False)
    w = LayerWeights([models[0].model.layers[0]]).pack()
    (px, pcos, psin, slots, pcols), _, keys, values, bits, kv_lens = _packed_case(w, models, torch.float32)
    weights, eps, dims = w.op_args
    return dict(x=px, weights=list(weights), eps=list(eps), dims=list(dims), cos=pcos, sin=psin, keys=keys,
                values=values, write_start=0, tree_mask=bits, kv_lens=kv_lens, scale=w.scale, tree_nodes=5,
                write_positions=pcols, rows=slots)


BAD_PACKED = {
    "rows int32": (lambda a: a.update(rows=a["rows"].int()), "rows must be int64 [M]"),
    "rows 2-D": (lambda a: a.update(rows=a["rows"].unsqueeze(0)), "rows must be int64 [M]"),
    "rows count": (lambda a: a.update(rows=a["rows"][:-1]), "rows must be int64 [M]"),
    "rows repeated": (lambda a: a["rows"].__setitem__(1, a["rows"][0]), "strictly increasing"),
    "rows decreasing": (lambda a: a.update(rows=a["rows"].flip(0)), "strictly increasing"),
    "rows negative": (lambda a: a["rows"].__setitem__(0, -1), "strictly increasing"),
    "rows past the grid": (lambda a: a["rows"].__setitem__(-1, 15), "[0, R * T = 15)"),
    "one row past the grid": (lambda a: a.update(rows=torch.tensor([15]), x=a["x"][:, :1], cos=a["cos"][:, :1],
                                                 sin=a["sin"][:, :1], write_positions=a["write_positions"][:1]),
                              "[0, R * T = 15)"),
    "cos unpacked": (lambda a: a.update(cos=a["cos"].expand(2, -1, -1, -1)), "cos and sin must be [1, M"),
    "sin count": (lambda a: a.update(sin=a["sin"][:, :-1]), "cos and sin must be [1, M"),
    "no write_positions": (lambda a: a.update(write_positions=None), "write_positions must be int64 [M"),
    "write_positions [R, T]": (lambda a: a.update(write_positions=torch.zeros(3, 5, dtype=torch.int64)),
                               "write_positions must be int64 [M"),
    "write_positions past the cache": (lambda a: a.update(write_positions=torch.full_like(a["write_positions"], 99)),
                                       "out of bounds"),
    "write_positions negative": (lambda a: a["write_positions"].__setitem__(0, -1), "out of bounds"),
    "tree_mask 2-D": (lambda a: a.update(tree_mask=a["tree_mask"][0]), "tree_mask must be [R, T, W]"),
    "tree_mask rows": (lambda a: a.update(tree_mask=a["tree_mask"][:2]), "tree_mask must be [R, T, W]"),
    "G = 2": (lambda a: a.update(x=a["x"].expand(2, -1, -1)), "single weight set"),
}


def _valid_call():
    models = _layers("qwen2", 1, torch.float32, use_sliding_window=False)
    w = LayerWeights([models[0].model.layers[0]]).pack()
    x, keys, values, bits, kv_lens, start = _inputs(w, 1, 2, 3, 4, 5, torch.float32)
    cos, sin = _rope(models, w, 2, 3, start, torch.float32)
    weights, eps, dims = w.op_args
    return dict(x=x, weights=list(weights), eps=list(eps), dims=list(dims), cos=cos, sin=sin, keys=keys,
                values=values, write_start=start, tree_mask=bits, kv_lens=kv_lens, scale=w.scale, tree_nodes=4)


def _call(args):
    return taps_ops.decoder_layer(**args)


def _with_weight(i, value):
    def change(a):
        a["weights"][i] = value(a["weights"][i]) if callable(value) else value
    return change


BAD = {
    "x 2-D": (lambda a: a.update(x=a["x"][0]), "x must be"),
    "x float16": (lambda a: a.update(x=a["x"].half()), "float32 or bfloat16"),
    "x rows": (lambda a: a.update(x=a["x"][:, :-1]), "does not hold"),
    "too few weights": (lambda a: a["weights"].pop(), "must list 11"),
    "eps count": (lambda a: a["eps"].pop(), "eps must be"),
    "dims count": (lambda a: a["dims"].pop(), "dims must be"),
    "odd head dim": (lambda a: a["dims"].__setitem__(2, 7), "even head_dim"),
    "heads not a multiple": (lambda a: a["dims"].__setitem__(1, 4), "multiple of kv_heads"),
    "no qkv": (_with_weight(2, None), "qkv) is required"),
    "no post norm": (_with_weight(6, None), "post_norm) is required"),
    "no down": (_with_weight(9, None), "down) is required"),
    "qkv shape": (_with_weight(2, lambda t: t[:-2]), "qkv weight must map"),
    "o dtype": (_with_weight(4, lambda t: t.double()), "o weight has dtype"),
    "gate_up odd": (_with_weight(7, lambda t: t[:-1]), "even number of outputs"),
    "qkv bias": (_with_weight(3, lambda t: t[:-1]), "qkv bias must hold"),
    "norm width": (_with_weight(0, lambda t: t[..., :-1]), "in_norm weight must have"),
    "norm groups": (_with_weight(6, lambda t: t.expand(3, -1)), "post_norm weight must be [H] or [G, H]"),
    "stacked weight, G = 1": (_with_weight(4, lambda t: t.t().unsqueeze(0).expand(2, -1, -1)), "stacked for 2"),
    "cos shape": (lambda a: a.update(cos=a["cos"][:, :, :, :-2]), "cos must be"),
    "sin shape": (lambda a: a.update(sin=a["sin"][:1]), "cos and sin must be"),
    "keys heads": (lambda a: a.update(keys=a["keys"][:, :1], values=a["values"][:, :1]), "keys must have"),
    "values shape": (lambda a: a.update(values=a["values"][..., :-1]), "keys and values must be"),
    "write past the cache": (lambda a: a.update(write_start=a["keys"].shape[2] - 2), "the cache holds"),
    "negative write": (lambda a: a.update(write_start=-1), "cache columns"),
    "tree_mask words": (lambda a: a.update(tree_mask=a["tree_mask"][..., :0]), "tree_mask"),
    "tree_nodes past kv": (lambda a: a.update(tree_nodes=60), "must be in [T, S]"),
    "emb shape": (lambda a: a.update(emb=a["x"][:, :1]), "emb must have"),
    "write_positions shape": (lambda a: a.update(write_positions=torch.zeros(2, 2, dtype=torch.int64)),
                              "write_positions must be int64 [G * R, T]"),
    "write_positions dtype": (lambda a: a.update(write_positions=torch.zeros(2, 3, dtype=torch.int32)),
                              "write_positions must be int64"),
    "write_positions past the cache": (lambda a: a.update(write_positions=torch.full((2, 3), 99)), "out of bounds"),
    "write_positions negative": (lambda a: a.update(write_positions=torch.full((2, 3), -1)), "out of bounds"),
    "emb without hidden_norm": (lambda a: a.update(emb=a["x"].clone()), "hidden_norm are required"),
}


def _stacked_panels_call():
    """Two weight groups (a drafter group's), the fused q/k/v projection (with its biases) as each group's panels
    stacked [G, out / 16, in, 16], the others bmm's [G, in, out]."""
    models = _layers("qwen2", 2, torch.float32, use_sliding_window=False)
    w = LayerWeights([m.model.layers[0] for m in models]).pack()
    x, keys, values, bits, kv_lens, start = _inputs(w, 2, 2, 3, 4, 5, torch.float32)
    cos, sin = _rope(models, w, 4, 3, start, torch.float32)
    weights, eps, dims = w.op_args
    weights = list(weights)
    weights[2] = lean._stacked_panels(w.qkv.weight, w.qkv.bias)
    assert weights[2].shape[0] == 2 and weights[3].shape[:2] == (2, 1)
    return dict(x=x, weights=weights, eps=list(eps), dims=list(dims), cos=cos, sin=sin, keys=keys, values=values,
                write_start=start, tree_mask=bits, kv_lens=kv_lens, scale=w.scale, tree_nodes=4)


BAD_STACKED_PANELS = {
    "panels of 3 groups": (_with_weight(2, lambda t: torch.cat([t, t[:1]])), "G groups' panels [G, out / 16, in, 16]"),
    "panels of 1 group": (_with_weight(2, lambda t: t[:1]), "G groups' panels [G, out / 16, in, 16]"),
    "panels' inputs": (_with_weight(2, lambda t: t[:, :, :-2].contiguous()), "qkv weight must map"),
    "panels' outputs": (_with_weight(2, lambda t: t[:, :-1].contiguous()), "qkv weight must map"),
    "bias [G, out]": (_with_weight(3, lambda t: t[:, 0]), "bias of stacked panels must be [G, 1, out]"),
    "bias bfloat16": (_with_weight(3, lambda t: t.bfloat16()), "qkv bias has dtype"),
    "panels float64": (_with_weight(2, lambda t: t.double()), "G groups' panels"),
}

#: (a valid call's arguments, the bad cases of it): the grid form, the packed one (rows=) and a group's stacked panels
BAD_TABLES = {"grid": (_valid_call, BAD), "packed": (_packed_call, BAD_PACKED),
              "stacked panels": (_stacked_panels_call, BAD_STACKED_PANELS)}


@pytest.mark.parametrize("table,case", [(t, c) for t, (_, cases) in BAD_TABLES.items() for c in sorted(cases)])
def test_bad_inputs_raise_clear_errors(table, case, monkeypatch):
    # the cases cut [out, in] weights: the plain layout (the stacked one is the "stacked weight" cases)
    monkeypatch.setattr(lean, "small_layout", lambda shape, panels=True, repeats=3, stacked=True, bf16=False, packed=False: "plain")
    valid, cases = BAD_TABLES[table]
    args = valid()
    with torch.no_grad():
        _call(args)                      # the valid call works
    mutate, message = cases[case]
    args = valid()
    mutate(args)
    with pytest.raises((RuntimeError, ValueError, IndexError), match=re.escape(message)):
        with torch.no_grad():
            _call(args)


@pytest.mark.parametrize("table", ["grid", "packed"])
@torch.no_grad()
def test_a_bad_write_position_writes_nothing(table):
    """Every write position is checked before the first K/V row is written: a call with one column past the
    cache raises and leaves both caches as they were (the other columns valid)."""
    args = BAD_TABLES[table][0]()
    if table == "grid":
        start = args["write_start"]
        args["write_positions"] = start + torch.arange(3).repeat(2, 1)
        args["write_positions"][1, 2] = args["keys"].shape[2]
    else:
        args["write_positions"] = args["write_positions"].clone()
        args["write_positions"][-1] = args["keys"].shape[2]
    keys, values = args["keys"].clone(), args["values"].clone()
    with pytest.raises(IndexError, match="out of bounds"):
        _call(args)
    assert torch.equal(args["keys"], keys) and torch.equal(args["values"], values)


def _torch_ops_call(args):
    a = dict(args)
    return torch.ops.taps_ops.decoder_layer.default(
        a["x"], a.get("emb"), a["weights"], a["eps"], a["dims"], a["cos"], a["sin"], a["keys"], a["values"],
        a["write_start"], a["tree_mask"], a["kv_lens"], a["tree_nodes"], float(a["scale"]), a.get("write_positions"),
        a.get("rows"))


def _fast_args(a):
    return (a["x"], a.get("emb"), a["weights"], a["eps"], a["dims"], a["cos"], a["sin"], a["keys"], a["values"],
            a["write_start"], a["tree_mask"], a["kv_lens"], a["tree_nodes"], float(a["scale"]), a.get("write_positions"),
            a.get("rows"))


@pytest.mark.parametrize("table", ["grid", "packed", "stacked panels"])
@torch.no_grad()
def test_fast_entry_same_as_torch_ops(table):
    """taps_ops.decoder_layer takes a fast entry (taps_ops._C.decoder_layer) for plain tensors and exact lists,
    torch.ops for anything else: the same output and the same K/V written either way; arguments it does not take
    return NotImplemented (the wrapper then takes torch.ops, which converts or rejects them)."""
    valid = BAD_TABLES[table][0]
    results = []
    for call in (_torch_ops_call, _call, lambda a: taps_ops._decoder_layer_fast(*_fast_args(a))):
        args = valid()
        if call is not _torch_ops_call and taps_ops._decoder_layer_fast is None:
            pytest.skip("a library without the fast entry")
        results.append((call(args), args["keys"], args["values"]))
    for out, keys, values in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(keys, results[0][1])
        assert torch.equal(values, results[0][2])
    fast = taps_ops._decoder_layer_fast
    args = valid()
    declined = {"weights as a tuple": lambda a: a.update(weights=tuple(a["weights"])),
                "eps as a tuple": lambda a: a.update(eps=tuple(a["eps"])),
                "an int among eps": lambda a: a["eps"].__setitem__(0, 1),
                "a float among dims": lambda a: a["dims"].__setitem__(0, 6.0),
                "a bool among dims": lambda a: a["dims"].__setitem__(3, True),
                "write_start a tensor": lambda a: a.update(write_start=torch.tensor(a["write_start"])),
                "write_start a bool": lambda a: a.update(write_start=False),
                "tree_nodes a float": lambda a: a.update(tree_nodes=4.0),
                "a number among weights": lambda a: a["weights"].__setitem__(3, 1.0),
                "x a list": lambda a: a.update(x=a["x"].tolist())}
    for name, change in declined.items():
        a = valid()
        change(a)
        assert fast(*_fast_args(a)) is NotImplemented, name
    # the wrapper converts sequences and numbers as it always did
    a = valid()
    a.update(weights=tuple(a["weights"]), eps=tuple(a["eps"]), dims=tuple(a["dims"]))
    assert torch.equal(_call(a), results[0][0])
    with pytest.raises(TypeError, match="16 positional arguments"):
        fast(*_fast_args(args)[:-1])


def test_fast_entry_keeps_modes_autograd_and_profiler():
    """The fast entry still dispatches: torch-function and dispatch modes, tensor subclasses and the profiler
    see the op as through torch.ops; its errors are the op's."""
    from conftest import assert_modes_see_op
    args = _valid_call()
    with torch.no_grad():
        want = _call(_valid_call())
        assert_modes_see_op(lambda: _call(_valid_call()), torch.ops.taps_ops.decoder_layer.default, want)

        class Sub(torch.Tensor):
            pass

        a = _valid_call()
        a["x"] = a["x"].as_subclass(Sub)
        assert torch.equal(_call(a), want)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            _call(args)
        assert any(e.name == "taps_ops::decoder_layer" for e in prof.events())
        bad = _valid_call()
        bad["dims"][0] = 5
        with pytest.raises(ValueError, match="heads a multiple of kv_heads"):
            taps_ops._decoder_layer_fast(*_fast_args(bad)) if taps_ops._decoder_layer_fast else _call(bad)


@torch.no_grad()
def test_stacked_panels_multiply_each_group_by_its_own_weight():
    """A group's stacked panels: each group's rows through its own weight's panels (panel_linear), the bias
    of its group added; the same bits as the group's weight alone as panels, and within rounding of bmm."""
    args = _stacked_panels_call()
    out = _call(args)
    args_bmm = _stacked_panels_call()
    models = _layers("qwen2", 2, torch.float32, use_sliding_window=False)
    w = LayerWeights([m.model.layers[0] for m in models]).pack()
    args_bmm["weights"][2] = w.qkv.weight            # the same weights as bmm's [G, in, out]
    ref = _call(args_bmm)
    assert out.shape == ref.shape and not torch.equal(out, torch.zeros_like(out))
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    lin = lean.Linear([m.model.layers[0].self_attn.q_proj.weight for m in models],
                      [m.model.layers[0].self_attn.q_proj.bias for m in models])
    lin.panels = lean._stacked_panels(lin.weight, lin.bias)
    x = torch.randn(2, 5, lin.weight.shape[1])
    y = lin(x)
    for g in range(2):
        q = models[g].model.layers[0].self_attn.q_proj
        assert torch.equal(y[g], taps_ops.panel_linear(x[g], taps_ops.pack_panels(q.weight), q.bias))


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    args = _valid_call()
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = {k: (mode.from_tensor(v) if isinstance(v, torch.Tensor) else v) for k, v in args.items()}
        fake["weights"] = [mode.from_tensor(t) if t is not None else None for t in args["weights"]]
        out = _call(fake)
    assert out.shape == args["x"].shape and out.dtype == args["x"].dtype


@pytest.mark.parametrize("drafter", ["eagle", "lm"])
def test_the_engine_runs_its_lean_layers_through_the_op(monkeypatch, drafter):
    """Greedy decoding still equals the target's greedy decoding, with the drafter's expansion levels and
    appends and the target's tree forward running through taps_ops.decoder_layer."""
    import engine_models as em
    import taps
    from taps.drafters import EagleDrafter, ModelDrafter
    target = em.llama(64, 32, 2, seed=1)
    if drafter == "eagle":
        torch.manual_seed(3)
        cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        drafters = [em.randomize_(EagleDrafter(cfg), 0.2)]
    else:
        drafters = [ModelDrafter(em.llama(64, 32, 1, seed=2))]
    calls = []
    real = TreeAttend.fused_layer

    def spy(self, *a, **k):
        calls.append(a[1])
        return real(self, *a, **k)

    monkeypatch.setattr(TreeAttend, "fused_layer", spy)
    dec = taps.SpeculativeDecoder(target, drafters, depth=3, top_k=2, budget=6)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (7, 4, 11)]
    with torch.no_grad():
        for batch in ([prompts[0]], prompts):   # batch 1, then a ragged batch (the K/V scattered per row)
            calls.clear()
            out = dec.generate(batch, max_new_tokens=12)
            for p, got in zip(batch, out.tokens):
                ids = torch.tensor([p])
                ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                                      pad_token_id=0)
                assert got == ref[0, len(p):].tolist()
            assert calls, "no lean layer ran through taps_ops.decoder_layer"


@pytest.mark.parametrize("drafter", ["eagle", "lm"])
@torch.no_grad()
def test_a_group_of_drafters_with_stacked_panels_decodes_losslessly(monkeypatch, drafter):
    """Two drafters of one shape (a group: merged trees) whose stacked projections are kept as each drafter's
    panels (the layout timed faster for one drafter's weight): the group's layers take them (through
    taps_ops.decoder_layer), each drafter's rows through its own panels, and greedy decoding still equals the
    target's own."""
    import engine_models as em
    import taps
    from taps.drafters import EagleDrafter, ModelDrafter
    monkeypatch.setattr(lean, "small_layout", lambda shape, panels=True, repeats=3, stacked=True, bf16=False,
                        packed=False: "panels" if panels else "plain")
    target = em.llama(64, 32, 2, seed=1)
    if drafter == "eagle":
        cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
        drafters = []
        for seed in (3, 4):
            torch.manual_seed(seed)
            drafters.append(em.randomize_(EagleDrafter(cfg), 0.2))
    else:
        drafters = [ModelDrafter(em.llama(64, 32, 1, seed=s)) for s in (2, 5)]
    grouped = []   # the weight groups (x's G) of each layer call through the op
    real = TreeAttend.fused_layer

    def spy(self, op_args, index, x, *a, **k):
        grouped.append((x.shape[0], op_args[0][2].dim()))
        return real(self, op_args, index, x, *a, **k)

    monkeypatch.setattr(TreeAttend, "fused_layer", spy)
    dec = taps.SpeculativeDecoder(target, drafters, strategy="merged", depth=3, top_k=2, budget=8)
    group = dec._draft_groups()[0]
    assert len(group.members) == 2
    layers = group.layers if drafter == "eagle" else group.lean.layers
    for w in layers:   # each stacked projection as the two drafters' panels
        assert all(lin.panels is not None and lin.panels.shape[0] == 2 for lin in (w.qkv, w.o, w.gate_up, w.down))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (7, 4, 11)]
    out = dec.generate(prompts, max_new_tokens=12)
    assert (2, 4) in grouped   # a two-drafter layer ran through the op with stacked float32 panels
    for p, got in zip(prompts, out.tokens):
        ids = torch.tensor([p])
        ref = target.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              pad_token_id=0)
        assert got == ref[0, len(p):].tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.no_grad()
def test_cuda_matches_cpu(device, dtype):
    """The op on CUDA (the same function, the ops dispatching to their CUDA kernels) against the CPU:
    equal up to the kernels' rounding. Weights unpacked (oneDNN packing is CPU-only), head dim 64 (the
    CUDA tree_attention's smallest)."""
    if device != "cuda":
        pytest.skip("the CPU side is the bit-for-bit test above")
    models = _layers("qwen2", 1, dtype, hidden_size=128, num_attention_heads=4, head_dim=64, use_sliding_window=False)
    w = LayerWeights([models[0].model.layers[0]])
    w.qkv = lean.Linear.concat([w.q, w.k, w.v])          # fused, not packed: usable on both devices
    w.gate_up = lean.Linear.concat([w.gate, w.up])
    weights = [w.in_norm.rows, None, w.qkv.weight, w.qkv.bias, w.o.weight, w.o.bias, w.post_norm.rows,
               w.gate_up.weight, w.gate_up.bias, w.down.weight, w.down.bias]
    x, keys, values, bits, kv_lens, start = _inputs(w, 1, 2, 5, 9, 13, dtype)
    cos, sin = _rope(models, w, 2, 5, start, dtype)
    args = [w.in_norm.eps, 0.0, w.post_norm.eps], [w.heads, w.kv_heads, w.head_dim, 1]
    out = []
    for dev in ("cpu", "cuda"):
        to = (lambda t: None if t is None else t.to(dev))
        k, v = keys.clone().to(dev), values.clone().to(dev)
        y = taps_ops.decoder_layer(to(x), [to(t) for t in weights], *args, to(cos).contiguous(), to(sin).contiguous(),
                                   k, v, start, to(bits), to(kv_lens), w.scale, tree_nodes=9)
        out.append((y.cpu().float(), k.cpu().float(), v.cpu().float()))
    tol = dict(atol=2e-2, rtol=2e-2) if dtype == torch.bfloat16 else dict(atol=1e-4, rtol=1e-4)
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, **tol)


@pytest.mark.parametrize("groups", [1, 2])
@torch.no_grad()
def test_widened_half_weights_op_equals_the_python_layer(monkeypatch, groups):
    """On a CPU without hardware bf16 products (taps_ops.native_half_matmul False), Linear.pack widens bf16
    weights to float32: every projection is x widened, the float32 product, rounded to bf16; the op takes
    the widened weights beside the bf16 norms and still equals the Python body bit for bit."""
    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: False)
    models = _layers("qwen2", groups, torch.bfloat16, use_sliding_window=False)   # qwen2: projection biases
    w = LayerWeights([m.model.layers[0] for m in models])
    w.pack()
    for lin in (w.qkv, w.o, w.gate_up, w.down, w.q):
        assert lin.widened and lin.weight.dtype == torch.float32
    assert w.qkv.bias.dtype == torch.float32
    assert w.op_args is not None
    x, keys, values, bits, kv_lens, start = _inputs(w, groups, 3, 5, 7, 11, torch.bfloat16)
    # a widened projection is the float32 product of the widened input, rounded once
    weight = w.qkv.weight if w.qkv.stacked else w.qkv.weight.t()
    expected = (torch.bmm(x.float(), weight if w.qkv.stacked else weight.expand(groups, *weight.shape))
                + w.qkv.bias.reshape(groups if w.qkv.stacked else 1, 1, -1)).to(torch.bfloat16)
    assert torch.equal(w.qkv(x), expected)
    cos, sin = _rope(models, w, groups * 3, 5, start, torch.bfloat16)

    def run(k, v, use_op):
        attend = TreeAttend([(k, v)], [w], bits, kv_lens, 7, start)
        callback = attend if use_op else (lambda *a: attend(*a))
        return decoder_layer(w, 0, x, cos, sin, callback, 3, 5)

    _check_equal(_both(run, keys, values))


def _bf16_engine_and_its_autoregressive_decoding():
    """A small bf16 target and drafter: the speculative decoder's tokens and the autoregressive decoder's, for a
    batch of ragged prompts (12 new tokens each)."""
    import engine_models as em
    import taps
    from taps.drafters import ModelDrafter
    target = em.llama(64, 32, 2, seed=1).to(torch.bfloat16)
    drafter = ModelDrafter(em.llama(64, 32, 1, seed=2).to(torch.bfloat16))
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 64, (n,), generator=gen).tolist() for n in (7, 4, 11)]
    with torch.no_grad():
        spec = taps.SpeculativeDecoder(target, [drafter], depth=3, top_k=2, budget=6).generate(prompts, max_new_tokens=12)
        plain = taps.SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=12)
    assert all(len(t) == 12 for t in spec.tokens)
    return spec.tokens, plain.tokens


def test_widened_bf16_engine_equals_its_autoregressive_decoding(monkeypatch):
    """bf16 decoding with widened weights (no hardware bf16) emits what the engine's own bf16
    autoregressive decoding emits, token for token, for a batch of ragged prompts."""
    asked = []
    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: asked.append(dtype) and False)
    spec, plain = _bf16_engine_and_its_autoregressive_decoding()
    assert asked and set(asked) == {torch.bfloat16}   # the lean forwards widened their weights
    assert spec == plain


def test_bf16_panels_on_a_native_bf16_cpu_engine_equals_its_autoregressive_decoding(monkeypatch):
    """On a CPU with bf16 products, the lean forwards keep the bf16 projections that time
    faster as bfloat16 panels (taps.lean.native_half_layout; forced here for every weight), and their bf16
    activations go to panel_linear as they are (AVX512-BF16's dot products where the CPU has them, AMX tiles at the
    amx level): decoding
    with drafts still emits what the engine's own autoregressive decoding does (one layout a weight for every
    row count), token for token."""
    from taps import lean
    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: True)
    asked = []
    monkeypatch.setattr(lean, "native_half_layout", lambda shape, repeats=3: asked.append(shape) or "panels_bf16")
    spec, plain = _bf16_engine_and_its_autoregressive_decoding()
    assert (64, 32) in asked and (32, 32) in asked   # qkv of 64 outputs, the 32 x 32 o projection
    assert spec == plain
