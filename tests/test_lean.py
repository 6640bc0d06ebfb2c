"""The lean forward path (taps.lean, taps.forward) against the Hugging Face modules it replaces.

1. Prefill logits of the lean path equal the Hugging Face model's own forward, for Llama, Qwen2, Qwen3
   (per-head q/k norms, head_dim != hidden / heads), Mistral and a Llama-3 rope-scaled config, in fp32
   and bf16 (bf16: the same ops in the same order, so equal up to the attention kernel's rounding).
2. The tree-verification forward: every node's hidden state equals the Hugging Face model run on the
   prefix plus that node's path (what the node must see), and equals the Hugging Face path of the
   engine (``lean=False``); captured layer inputs agree between the two paths.
3. Stacked weight groups (G drafters as one batched forward) equal G separate forwards.
4. Models the lean path does not cover are named and fall back; bad capture indices are refused.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_ops  # noqa: E402
from taps import hf  # noqa: E402
from taps.forward import PACK_ONE_MAX, TargetForward  # noqa: E402
from taps.kv import cache_attend, causal_append  # noqa: E402
from taps.lean import LeanCausalLM, lean_support  # noqa: E402

ARCHS = ["llama", "qwen2", "qwen3", "mistral", "llama3-rope"]


def _model(arch="llama", vocab=97, layers=3, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    prefix = {"llama": "Llama", "qwen2": "Qwen2", "qwen3": "Qwen3", "mistral": "Mistral",
              "llama3-rope": "Llama"}[arch]
    kw = dict(vocab_size=vocab, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2,
              tie_word_embeddings=False)
    if arch == "qwen3":
        kw.update(head_dim=16, rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    if arch == "llama3-rope":
        kw.update(rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    if arch == "qwen2":
        kw.update(use_sliding_window=False)
    model = getattr(transformers, prefix + "ForCausalLM")(getattr(transformers, prefix + "Config")(**kw)).eval()
    with torch.no_grad():  # non-trivial norm weights and biases, so that a dropped one shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_prefill_logits_equal_hugging_face(arch, dtype):
    model = _model(arch, dtype=dtype)
    assert lean_support(model) is None
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(1))
    ref = model(input_ids=ids).logits.float()
    fwd = TargetForward(hf.use_taps_attention(model), lean=True)
    cache = fwd.new_cache(2, 32)
    out = fwd.prefill(cache, ids, torch.tensor([11, 11]), 0, return_hidden=True)
    got = fwd.logits(out.hidden_states).float()
    assert cache.lengths.tolist() == [11, 11]
    if dtype == torch.float32:
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.logits, ref[:, -1], atol=1e-5, rtol=1e-5)
        return
    # bf16: against the fp32 model, the lean path's error may be at most twice Hugging Face's own
    exact = _model(arch, dtype=torch.float32)(input_ids=ids).logits
    err_hf, err_lean = (ref - exact).abs().max(), (got - exact).abs().max()
    assert err_lean <= 2 * err_hf, (err_lean, err_hf)
    assert torch.equal(out.logits.float(), got[:, -1])


@torch.no_grad()
def test_half_precision_prefill_runs_whole_blocks_of_tokens(monkeypatch):
    """A bf16 prefill on the CPU runs each row's tokens up to a multiple of PREFILL_HALF_ROWS (padding after
    the prompts: oneDNN builds a kernel per new row count): its logits, hidden states, captured layers and
    the prompts' K/V are those of the prefill without the padding, within bf16 rounding, lengths and shapes
    unchanged; a cache without room for the padding gets none."""
    import taps.forward as forward

    model = _model("llama", dtype=torch.bfloat16)
    ids = torch.randint(0, 97, (2, 11), generator=torch.Generator().manual_seed(2))
    lens = torch.tensor([11, 5])
    assert forward.prefill_rows(11, torch.bfloat16, torch.device("cpu")) == forward.PREFILL_HALF_ROWS
    assert forward.prefill_rows(11, torch.float32, torch.device("cpu")) == 11
    runs, whole = {}, forward.PREFILL_HALF_ROWS
    for block in (whole, 1):
        monkeypatch.setattr(forward, "PREFILL_HALF_ROWS", block)
        fwd = TargetForward(hf.use_taps_attention(model), lean=True)
        cache = fwd.new_cache(2, 32)
        seen = []
        run = fwd._run
        monkeypatch.setattr(fwd, "_run", lambda ids, *a: seen.append(ids.shape[1]) or run(ids, *a))
        out = fwd.prefill(cache, ids, lens, 0, return_hidden=True, capture_layers=(1,))
        runs[block] = (out, cache, seen[0])
    (padded, pc, rows), (plain, cc, plain_rows) = runs[whole], runs[1]
    assert rows == 16 and plain_rows == 11
    assert pc.lengths.tolist() == cc.lengths.tolist() == [11, 5]
    assert padded.hidden_states.shape == plain.hidden_states.shape == (2, 11, 32)
    assert padded.layers[1].shape == plain.layers[1].shape
    torch.testing.assert_close(padded.logits.float(), plain.logits.float(), atol=0.05, rtol=0.05)
    torch.testing.assert_close(padded.hidden_states.float(), plain.hidden_states.float(), atol=0.05, rtol=0.05)
    for a, b in zip(pc.layers, cc.layers):
        for b_, n in enumerate(lens.tolist()):
            torch.testing.assert_close(a.keys[b_, :, :n].float(), b.keys[b_, :, :n].float(), atol=0.05, rtol=0.05)
            torch.testing.assert_close(a.values[b_, :, :n].float(), b.values[b_, :, :n].float(), atol=0.05, rtol=0.05)
    monkeypatch.undo()
    fwd = TargetForward(hf.use_taps_attention(model), lean=True)
    cache = fwd.new_cache(2, 12)  # room for the prompts, not for 16 tokens
    out = fwd.prefill(cache, ids, lens, 0, return_hidden=True)
    assert cache.lengths.tolist() == [11, 5] and out.hidden_states.shape == (2, 11, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_packed_prefill_equals_the_padded_one(arch, dtype):
    """Prompts into empty caches with their lengths on the host (TargetForward.prefill host_lengths) run packed,
    each prompt a causal chain of a packed tree forward: the logits after each prompt, the hidden states and
    captured layers at its tokens (fp32: zeros at the padding) and its tokens' K/V are the padded prefill's
    (fp32 to 1e-5; bf16 within its rounding), for ragged, equal, one-token and single prompts; caches that hold
    entries already, and a single prompt past PACK_ONE_MAX tokens, run as before."""
    model = hf.use_taps_attention(_model(arch, dtype=dtype))
    gen = torch.Generator().manual_seed(5)
    fwd = TargetForward(model, lean=True)

    def close(x, y):
        if dtype == torch.float32:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-5)
        else:  # bf16: other rounding along the way (another attention kernel, other row blocks); 3% of the norm
            # (each path's logits are 1-4% of the norm from the float32 model's on these random models, alike)
            assert float((x.float() - y.float()).norm()) <= 0.03 * float(y.float().norm()) + 1e-3
    for lengths in ([11], [13, 4, 1, 9, 13], [7, 7, 7], [1, 70]):
        width = max(lengths)
        ids = torch.zeros(len(lengths), width, dtype=torch.int64)
        for b, n in enumerate(lengths):
            ids[b, :n] = torch.randint(0, 97, (n,), generator=gen)
        lens = torch.tensor(lengths)
        outs, caches, trees = {}, {}, []
        tree = fwd.tree
        fwd.tree = lambda *a, **k: (trees.append(k.get("nodes")), tree(*a, **k))[1]
        for packed in (False, True):
            cache = caches[packed] = fwd.new_cache(len(lengths), width + 20)
            outs[packed] = fwd.prefill(cache, ids, lens, 0, return_hidden=True, capture_layers=(0, 2),
                                       host_lengths=lengths if packed else None)
        del fwd.tree
        assert trees == [lengths]  # the packed one only
        a, b = outs[True], outs[False]
        assert caches[True].lengths.tolist() == caches[False].lengths.tolist() == lengths
        close(a.logits, b.logits)
        real = torch.arange(width) < lens.unsqueeze(1)
        assert a.hidden_states.shape == b.hidden_states.shape
        close(a.hidden_states[real], b.hidden_states[real])
        if dtype == torch.float32:  # (half precision computes filler slots up to whole blocks of rows)
            assert not a.hidden_states[~real].any()
        for i in (0, 2):
            close(a.layers[i][real], b.layers[i][real])
        for la, lb in zip(caches[True].layers, caches[False].layers):
            for r, n in enumerate(lengths):
                close(la.keys[r, :, :n], lb.keys[r, :, :n])
                close(la.values[r, :, :n], lb.values[r, :, :n])
    # caches holding entries, or one prompt past PACK_ONE_MAX: the prefill as before (no tree forward)
    calls = []
    tree = fwd.tree
    fwd.tree = lambda *a, **k: (calls.append(1), tree(*a, **k))[1]
    cache = fwd.new_cache(1, 20)
    fwd.prefill(cache, ids[:1, :3], torch.tensor([3]), 0, host_lengths=[3])
    assert calls == [1]  # one short prompt: packed
    calls.clear()
    n = PACK_ONE_MAX + 1
    fwd.prefill(fwd.new_cache(1, n + 4), torch.randint(0, 97, (1, n), generator=gen), torch.tensor([n]), 0,
                host_lengths=[n])
    assert calls == []  # one prompt past PACK_ONE_MAX: padded
    calls.clear()
    cache = fwd.new_cache(2, 20)
    fwd.prefill(cache, ids[:2, :3], torch.tensor([3, 2]), 0)
    fwd.prefill(cache, ids[:2, :2], torch.tensor([2, 1]), 3, host_lengths=[2, 1])
    assert not calls and cache.lengths.tolist() == [5, 3]
    for wrong in ([3], [3, 2, 1], [2, 3], [3, 3]):  # host lengths that are not num_new: refused
        with pytest.raises(ValueError, match="host_lengths"):
            fwd.prefill(fwd.new_cache(2, 20), ids[:2, :3], torch.tensor([3, 2]), 0, host_lengths=wrong)


def _random_tree(n, vocab, gen):
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=gen)) for i in range(1, n)]
    tokens = torch.randint(0, vocab, (n,), generator=gen)
    depth = [0] * n
    for i in range(1, n):
        depth[i] = depth[parents[i]] + 1
    mask = torch.zeros(n, (n + 63) // 64, dtype=torch.int64)
    for i in range(n):
        j = i
        while j >= 0:
            mask[i, j // 64] |= 1 << (j % 64)
            j = parents[j]
    return tokens, torch.tensor(parents), torch.tensor(depth), mask


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_tree_forward_equals_per_path_reference_and_hf_path(arch):
    model = hf.use_taps_attention(_model(arch))
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 97, (n,), generator=gen) for n in (9, 5)]
    n = 13
    trees = [_random_tree(n, 97, gen) for _ in prompts]
    tokens = torch.stack([t[0] for t in trees])
    depth = torch.stack([t[2] for t in trees])
    mask = torch.stack([t[3] for t in trees])
    ids = torch.zeros(2, 9, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = p
        tokens[b, 0] = p[-1]  # the root is the last committed token: prefill all but it
    lens = torch.tensor([len(p) - 1 for p in prompts])
    outs = {}
    for lean in (True, False):
        fwd = TargetForward(model, lean=lean)
        cache = fwd.new_cache(2, 40)
        fwd.prefill(cache, ids, lens, 0)
        outs[lean] = fwd.tree(cache, tokens, mask, depth, int(lens.max()), capture_layers=(0, 2, 3))
    torch.testing.assert_close(outs[True].hidden_states, outs[False].hidden_states, atol=1e-5, rtol=1e-5)
    for i in (0, 2, 3):
        torch.testing.assert_close(outs[True].layers[i], outs[False].layers[i], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[True].layers[3], outs[True].hidden_states)  # index N: the final hidden state
    logits = model.get_output_embeddings()(outs[True].hidden_states)
    for b, p in enumerate(prompts):
        parents = trees[b][1].tolist()
        for node in range(n):
            path, j = [], node
            while j > 0:
                path.append(int(tokens[b, j]))
                j = parents[j]
            seq = torch.cat([p, torch.tensor(path[::-1], dtype=torch.int64)]).unsqueeze(0)
            torch.testing.assert_close(logits[b, node], model(input_ids=seq).logits[0, -1], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
@torch.no_grad()
def test_packed_tree_forward_equals_the_padded_one(arch):
    """Trees of 13, 4, 1 and 6 real nodes padded to 13 (ragged prefixes): the forward over their real nodes
    only (TargetForward.tree with nodes) gives the padded forward's hidden states and captured layers at the
    real nodes (zeros at the padding), writes the same K/V at the real nodes' cache columns and nothing at
    the padding's; trees that leave little padding run as they are."""
    from taps import forward as fw

    model = hf.use_taps_attention(_model(arch))
    gen = torch.Generator().manual_seed(4)
    real, n = [13, 4, 1, 6], 13
    prompts = [torch.randint(0, 97, (k,), generator=gen) for k in (9, 5, 7, 3)]
    trees = [_random_tree(r, 97, gen) for r in real]
    tokens = torch.full((4, n), -1, dtype=torch.int64)
    depth = torch.full((4, n), -1, dtype=torch.int64)
    mask = torch.zeros(4, n, 1, dtype=torch.int64)
    ids = torch.zeros(4, 9, dtype=torch.int64)
    for b, (p, t) in enumerate(zip(prompts, trees)):
        tokens[b, :real[b]], depth[b, :real[b]], mask[b, :real[b]] = t[0], t[2], t[3]
        ids[b, :len(p)] = p
        tokens[b, 0] = p[-1]
    lens = torch.tensor([len(p) - 1 for p in prompts])
    assert fw.packs(real, n) and not fw.packs([13, 12, 13, 11], n) and not fw.packs([1], 4)
    outs, caches = {}, {}
    fwd = TargetForward(model, lean=True)
    for packed in (False, True):
        cache = caches[packed] = fwd.new_cache(4, 40)
        fwd.prefill(cache, ids, lens, 0)
        before = [(layer.keys.clone(), layer.values.clone()) for layer in cache.layers]
        outs[packed] = fwd.tree(cache, tokens, mask, depth, int(lens.max()), capture_layers=(0, 2, 3),
                                nodes=real if packed else None)
    assert outs[False].packed is None and outs[True].packed is not None
    slots, rows = outs[True].packed
    assert slots.tolist() == [b * n + i for b in range(4) for i in range(real[b])]
    real_mask = torch.arange(n) < torch.tensor(real).unsqueeze(1)
    torch.testing.assert_close(outs[True].hidden_states[real_mask], outs[False].hidden_states[real_mask],
                               atol=1e-5, rtol=1e-5)
    assert torch.equal(outs[True].hidden_states[~real_mask], torch.zeros_like(outs[True].hidden_states[~real_mask]))
    torch.testing.assert_close(rows, outs[True].hidden_states[real_mask])
    for i in (0, 2, 3):
        torch.testing.assert_close(outs[True].layers[i][real_mask], outs[False].layers[i][real_mask], atol=1e-5,
                                   rtol=1e-5)
    for b in range(4):
        cols = slice(int(lens[b]), int(lens[b]) + real[b])
        pad = slice(int(lens[b]) + real[b], int(lens[b]) + n)
        for la, lb, (k0, v0) in zip(caches[True].layers, caches[False].layers, before):
            torch.testing.assert_close(la.keys[b, :, cols], lb.keys[b, :, cols], atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(la.values[b, :, cols], lb.values[b, :, cols], atol=1e-5, rtol=1e-5)
            assert torch.equal(la.keys[b, :, pad], k0[b, :, pad]) and torch.equal(la.values[b, :, pad], v0[b, :, pad])
    # verification over the packed rows' logits: what the padded forward's logits give
    for lazy in (False, True):
        a = fwd.verify(outs[True].hidden_states, tokens, torch.stack([torch.cat([t[1], torch.full((n - len(t[1]),), -1)])
                                                                    for t in trees]), mask, lazy=lazy,
                       packed=outs[True].packed, uniforms=torch.zeros(4, n))
        b = fwd.verify(outs[False].hidden_states, tokens, torch.stack([torch.cat([t[1], torch.full((n - len(t[1]),), -1)])
                                                                     for t in trees]), mask, lazy=lazy,
                       uniforms=torch.zeros(4, n))
        assert torch.equal(a.tokens, b.tokens) and torch.equal(a.num_accepted, b.num_accepted)


@pytest.mark.parametrize("seed", range(6))
def test_put_rows_writes_what_index_copy_writes(seed):
    """``_put_rows`` (slice copies per run of consecutive rows, or one ``index_copy_``) writes each row where
    ``index_copy_`` does, whatever the runs: few, many short ones, many long ones (a packed batch's slots), in
    float32 and bfloat16; the rows outside are left as they were."""
    from taps.forward import _put_rows

    g = torch.Generator().manual_seed(seed)
    total = 97
    for dtype in (torch.float32, torch.bfloat16):
        cases = [list(range(0, total, 2)),  # many runs of one row: index_copy_
                 [b * 12 + i for b in range(8) for i in range(10)]]  # 8 runs of 10 (a packed batch): slices
        for runs in (1, 3, 9, 30):
            starts = sorted(torch.randperm(total - 8, generator=g)[:runs].tolist())
            rows = sorted({r for a in starts for r in range(a, a + int(torch.randint(1, 9, (1,), generator=g)))})
            cases.append([r for r in rows if r < total])
        for rows in cases:
            values = torch.randn(len(rows), 13, generator=g).to(dtype)
            base = torch.randn(total, 13, generator=g).to(dtype)
            want, got = base.clone(), base.clone()
            index = torch.tensor(rows, dtype=torch.int64)
            want.index_copy_(0, index, values)
            _put_rows(got, rows, values, index)
            assert torch.equal(got, want), (dtype, rows)


def test_packed_slots_round_half_precision_rows_up_with_the_first_padding_slots():
    from taps.forward import PACK_HALF_ROWS, packed_slots

    assert PACK_HALF_ROWS == 8
    assert packed_slots([3, 1, 2], 4) == [0, 1, 2, 4, 8, 9]
    assert packed_slots([3, 1, 2], 4, half=True) == [0, 1, 2, 3, 4, 5, 8, 9]        # 6 -> 8 rows
    assert packed_slots([1, 1], 3, half=True) == [0, 1, 2, 3, 4, 5]                  # at most the grid
    assert packed_slots([4, 4], 4, half=True) == list(range(8))


@torch.no_grad()
def test_stacked_group_equals_separate_forwards():
    models = [_model("llama", seed=s) for s in (3, 4)]
    batch, num = 2, 5
    ids = torch.randint(0, 97, (batch, num), generator=torch.Generator().manual_seed(5))
    lens = torch.zeros(batch, dtype=torch.int64)
    positions, mask = causal_append(lens, 0, num)

    def run(lean, groups):
        layer = lean.layers[0]
        kv = [[torch.zeros(groups * batch, layer.kv_heads, 8, layer.head_dim) for _ in range(2)] for _ in lean.layers]
        lean.rope.ensure(8, ids.device)
        pos, m = positions.repeat(groups, 1), mask.repeat(groups, 1, 1, 1)
        hidden = lean.hidden(ids.repeat(groups, 1), pos, cache_attend(kv, lean.layers, m, positions=pos))
        return lean.logits(hidden)

    stacked = run(LeanCausalLM(models), 2)  # [2, B * T, V]
    for g, m in enumerate(models):
        torch.testing.assert_close(stacked[g], run(LeanCausalLM(m), 1)[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(stacked[g].view(batch, num, -1), m(input_ids=ids).logits, atol=1e-5, rtol=1e-5)


def test_unsupported_models_fall_back_and_bad_capture_is_refused():
    cfg = transformers.GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=64)
    gpt2 = transformers.GPT2LMHeadModel(cfg).eval()
    assert "GPT2LMHeadModel" in lean_support(gpt2)
    with pytest.raises(ValueError, match="lean path does not cover"):
        TargetForward(gpt2, lean=True)
    sliding = _model("mistral")
    sliding.config.sliding_window = 4
    for layer in sliding.model.layers:
        layer.self_attn.sliding_window = 4
    assert "sliding" in lean_support(sliding)
    model = hf.use_taps_attention(_model("llama"))
    fwd = TargetForward(model)
    cache = fwd.new_cache(1, 16)
    with pytest.raises(ValueError, match="outside"):
        fwd.prefill(cache, torch.tensor([[1, 2, 3]]), torch.tensor([3]), 0, capture_layers=(4,))


@pytest.mark.parametrize("sample", [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.0, top_p=0.6)])
@torch.no_grad()
def test_lazy_head_verification_equals_the_full_logits(sample):
    """Lazy verification (lm_head only for the rows the walk visits) gives the full-logits result, also
    when the accepted path leaves the first-child chain; the children are planted on the target's most
    likely tokens at random sibling positions so that walks go deep and off the chain."""
    model = hf.use_taps_attention(_model("llama", vocab=50))
    fwd = TargetForward(model)
    fwd.new_cache(1, 8)
    gen = torch.Generator().manual_seed(6)
    batch, num = 5, 24
    hidden = torch.randn(batch, num, 32, generator=gen) * 4  # peaked distributions: long accepted paths
    logits = fwd.logits(hidden)
    parents = torch.full((batch, num), -1)
    tokens = torch.full((batch, num), -1)
    tree_mask = torch.zeros((batch, num, (num + 63) // 64), dtype=torch.int64)
    off_chain = 0
    for b in range(batch):
        tokens[b, 0] = 7
        n_real = num - b  # ragged: padding at the end of some trees
        for i in range(1, n_real):
            parents[b, i] = int(torch.randint(max(0, i - 4), i, (1,), generator=gen))
        for p in range(n_real):
            kids = [i for i in range(1, n_real) if parents[b, i] == p]
            ranked = logits[b, p].argsort(descending=True).tolist()
            for rank, i in zip(torch.randperm(len(kids), generator=gen).tolist(), kids):
                tokens[b, i] = ranked[rank]  # distinct tokens among siblings, the argmax somewhere
        for i in range(n_real):
            j = i
            while j >= 0:
                tree_mask[b, i, j // 64] |= 1 << (j % 64)
                j = int(parents[b, j])
    longest = 0
    for seed in range(20):
        g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
        full = fwd.verify(hidden, tokens, parents, tree_mask, lazy=False, generator=g1, **sample)
        lazy = fwd.verify(hidden, tokens, parents, tree_mask, lazy=True, generator=g2, **sample)
        for a, b in zip(full, lazy):
            assert torch.equal(a, b), (seed, full, lazy)
        longest = max(longest, int(full.num_accepted.max()))
        for b in range(batch):  # count accepted nodes that are not their parent's first child
            for j in range(1, int(full.num_accepted[b]) + 1):
                node = int(full.path[b, j])
                off_chain += node != min(i for i in range(num) if parents[b, i] == parents[b, node])
    assert off_chain > 5 and longest >= 3


@torch.no_grad()
def test_greedy_verification_of_drawn_drafts_reads_the_argmax_only(monkeypatch):
    """At temperature 0 verification reads no proposal (the walk takes each row's argmax): a drawn draft (an n-gram
    table's chains of its modes, with their draft_probs) is verified from the head's argmax like a top-k one, not
    from the full logits, and gives verify_tree's result on the full logits, ragged trees and a mixed batch's
    tensor of zero temperatures included."""
    model = hf.use_taps_attention(_model("llama", vocab=112))
    fwd = TargetForward(model)
    fwd.new_cache(1, 8)
    fwd.head.panels = taps_ops.pack_panels(fwd.head.weight.detach())  # (a large head's layout: the argmax screen)
    gen = torch.Generator().manual_seed(5)
    batch, num = 3, 7
    hidden = torch.randn(batch, num, 32, generator=gen) * 4
    logits = fwd.logits(hidden)
    parents = torch.arange(-1, num - 1).repeat(batch, 1)  # chains
    tokens = logits.argmax(-1).roll(1, 1)  # node i: the argmax of node i - 1's row (accepted at T = 0)
    tokens[1, 3] = (tokens[1, 3] + 1) % 112  # request 1 is rejected at node 3
    tokens[2, 5:] = -1  # request 2's tree is ragged
    parents[2, 5:] = -1
    probs = torch.rand(batch, num, 112, generator=gen)
    probs /= probs.sum(-1, keepdim=True)
    uniforms = torch.rand(batch, num, generator=gen)
    calls, head = [], fwd.logits
    monkeypatch.setattr(fwd, "logits", lambda h: calls.append(h.shape) or head(h))
    screens = fwd.head.screens(hidden)
    for temperature in (0.0, torch.zeros(batch)):
        calls.clear()
        got = fwd.verify(hidden, tokens, parents, draft_probs=probs, temperature=temperature, uniforms=uniforms)
        want = taps_ops.verify_tree(logits, tokens, parents, draft_probs=probs, temperature=temperature,
                                    uniforms=uniforms)
        for a, b in zip(got, want):
            assert torch.equal(a, b), (got, want)
        assert got.num_accepted.tolist() == [num - 1, 2, 4]
        if screens:  # (not at the scalar level, where the head has no argmax screen)
            assert calls == [], calls
    # at temperature > 0 the proposal is read: the full logits
    calls.clear()
    fwd.verify(hidden, tokens, parents, draft_probs=probs, temperature=1.0, uniforms=uniforms)
    assert calls


@torch.no_grad()
def test_lazy_head_by_default_only_where_first_child_chains_are_short(monkeypatch):
    """The default (lazy=None, a head counted large): a chain (every node on the first-child chain) gets one
    product over all its rows; a bushy tree gets its first-child chain's rows first; both give the full
    result."""
    import taps.forward as tf

    monkeypatch.setattr(tf, "LAZY_HEAD_MIN", 0)
    model = hf.use_taps_attention(_model("llama", vocab=50))
    fwd = TargetForward(model)
    fwd.new_cache(1, 8)
    rows, head = [], fwd.logits
    monkeypatch.setattr(fwd, "logits", lambda h: rows.append((h.numel() // h.shape[-1], h.dim())) or head(h))
    gen = torch.Generator().manual_seed(3)
    hidden = torch.randn(2, 16, 32, generator=gen)
    tokens = torch.randint(0, 50, (2, 16), generator=gen)
    uniforms = torch.rand(2, 16, generator=gen)
    chain = torch.arange(-1, 15).repeat(2, 1)
    bushy = torch.tensor([-1] + [0] * 5 + [1 + (i // 2) for i in range(10)]).repeat(2, 1)  # chains 0, 1, 6
    for parents, first in ((chain, (32, 3)), (bushy, (6, 2))):  # (rows, 3: the [B, N, H] states as they are)
        full = fwd.verify(hidden, tokens, parents, lazy=False, uniforms=uniforms)
        rows.clear()
        out = fwd.verify(hidden, tokens, parents, uniforms=uniforms)
        assert rows[0] == first and sum(r for r, _ in rows) <= 32, rows
        for a, b in zip(full, out):
            assert torch.equal(a, b)
    # a head whose products run on AMX tiles (a 16-row product about a one-row one): one product, never lazy
    monkeypatch.setattr(type(fwd.head), "tiles", lambda self, x: True)
    rows.clear()
    out = fwd.verify(hidden, tokens, bushy, uniforms=uniforms)
    assert rows == [(32, 3)]
    for a, b in zip(fwd.verify(hidden, tokens, bushy, lazy=False, uniforms=uniforms), out):
        assert torch.equal(a, b)


def test_which_products_run_on_amx_tiles(monkeypatch):
    """Linear.tiles: bfloat16 x over bfloat16 panels, in a multiple of 32, autograd off, at the amx level (what
    panel_linear multiplies on tiles), not with TAPS_PANEL_AMX=0, not stacked weights, not float32 x."""
    from taps import lean

    monkeypatch.setattr(taps_ops, "cpu_level", lambda: "amx")
    lin = lean.Linear(torch.randn(64, 64).bfloat16())
    lin.half, lin.widened = torch.bfloat16, True
    lin.weight = lin.weight.float()
    lin.panels = taps_ops.pack_panels(lin.weight, torch.bfloat16)
    x = torch.randn(3, 64).bfloat16()
    with torch.no_grad():
        assert lin.tiles(x)
        assert not lin.tiles(x.float())
        monkeypatch.setattr(lean, "PANEL_AMX", False)
        assert not lin.tiles(x)
        monkeypatch.setattr(lean, "PANEL_AMX", True)
        monkeypatch.setattr(taps_ops, "cpu_level", lambda: "avx512")
        assert not lin.tiles(x)
        monkeypatch.setattr(taps_ops, "cpu_level", lambda: "amx")
        odd = lean.Linear(torch.randn(64, 48))
        odd.panels = taps_ops.pack_panels(odd.weight, torch.bfloat16)
        assert not odd.tiles(torch.randn(2, 48).bfloat16())
        lin.panels = taps_ops.pack_panels(lin.weight)      # float32 panels
        assert not lin.tiles(x)
    assert not lean.Linear(torch.randn(64, 64)).tiles(x)   # no panels


@torch.no_grad()
def test_forwards_of_one_target_share_its_packed_weights():
    """Decoders of one target keep one packed copy of its weights (the lean model's fused projections are
    as large as the weights), rebuilt for all of them when a parameter changes, and freed with the last."""
    import gc
    import weakref

    model = _model("llama")
    first, second = TargetForward(model), TargetForward(model)
    first.new_cache(1, 8)
    second.new_cache(1, 8)
    assert first.lean is second.lean and first.head is second.head
    other = TargetForward(_model("llama", seed=1))
    other.new_cache(1, 8)
    assert other.lean is not first.lean
    old = weakref.ref(first.lean)
    ids = torch.tensor([[3, 1, 4]])
    before = first.prefill(first.new_cache(1, 8), ids, torch.tensor([3]), 0).logits
    model.lm_head.weight.mul_(2.0)  # an in-place update: the packed copies are stale
    first.new_cache(1, 8)
    second.new_cache(1, 8)
    assert first.lean is second.lean and first.lean is not old()
    after = second.prefill(second.new_cache(1, 8), ids, torch.tensor([3]), 0).logits
    torch.testing.assert_close(after, 2 * before)
    hf_path = TargetForward(model, lean=False)  # the Hugging Face path shares the head, has no lean model
    hf_path.new_cache(1, 8)
    assert hf_path.lean is None and hf_path.head is first.head
    shared = weakref.ref(first.lean)
    del first, second, hf_path, old
    gc.collect()
    assert shared() is None


@pytest.mark.parametrize("layout", ["packed", "plain", "transposed", "panels"])
def test_every_head_layout_gives_the_same_product(layout, monkeypatch):
    """A large float32 head keeps the layout timed fastest on the machine (Linear.pack(choose_layout=True));
    whichever it is, the product is F.linear's up to float rounding, for 1-, 2- and 3-D inputs, with and
    without a bias; the layout is chosen only among the candidates the weight has."""
    from taps import lean

    torch.manual_seed(0)
    weight, bias = torch.randn(lean.LAYOUT_MIN_ROWS + 16, 48), torch.randn(lean.LAYOUT_MIN_ROWS + 16)
    assert lean.fastest_layout(weight, None, None, weight.t().contiguous(), repeats=1) in ("plain", "transposed")
    panels = taps_ops.pack_panels(weight)
    assert lean.fastest_layout(weight, None, None, weight.t().contiguous(), panels, repeats=1) in (
        "plain", "transposed", "panels")
    monkeypatch.setattr(lean, "fastest_layout", lambda w, b, p, t, pan=None, repeats=3, **kwargs: layout)
    for b in (None, bias):
        head = lean.Linear(weight, b).pack(choose_layout=True)
        assert (head.transposed is not None) == (layout == "transposed")
        assert (head.panels is not None) == (layout == "panels")
        assert layout != "plain" or head.packed is None
        with torch.no_grad():
            for shape in ((48,), (5, 48), (2, 9, 48)):
                x = torch.randn(shape)
                torch.testing.assert_close(head(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-4)
    small = lean.Linear(torch.randn(64, 48)).pack(choose_layout=True)  # below LAYOUT_MIN_ROWS: as before
    assert small.transposed is None


def test_a_large_head_is_timed_on_its_first_rows_only(monkeypatch):
    """A head beyond LAYOUT_PROBE_BYTES has its layouts timed on its first rows (whole panels), and only the
    chosen layout is then built for the whole weight."""
    from taps import lean

    seen = []

    def fake(weight, bias, packed, transposed, panels=None, repeats=3, **kwargs):
        seen.append((tuple(weight.shape), None if bias is None else tuple(bias.shape), tuple(transposed.shape),
                     None if panels is None else tuple(panels.shape)))
        return "panels"
    monkeypatch.setattr(lean, "fastest_layout", fake)
    monkeypatch.setattr(lean, "LAYOUT_PROBE_BYTES", 4 * 24 * 5000)     # 5000 rows of 24 floats
    weight, bias = torch.randn(lean.LAYOUT_MIN_ROWS + 2000, 24), torch.randn(lean.LAYOUT_MIN_ROWS + 2000)
    head = lean.Linear(weight, bias).pack(choose_layout=True)
    rows = 5000 - 5000 % 16
    assert seen == [((rows, 24), (rows,), (24, rows), (rows // 16, 24, 16))]
    assert head.panels.shape == ((lean.LAYOUT_MIN_ROWS + 2000) // 16, 24, 16) and head.packed is None
    with torch.no_grad():
        x = torch.randn(3, 24)
        torch.testing.assert_close(head(x), torch.nn.functional.linear(x, weight, bias), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("layout", ["packed", "transposed", "panels"])
def test_a_head_timed_whole_keeps_the_copy_it_timed(layout, monkeypatch):
    """A head within LAYOUT_PROBE_BYTES is timed whole: the chosen layout's copy is the one timed, not built
    a second time."""
    from taps import lean

    timed = {}

    def fake(weight, bias, packed, transposed, panels=None, repeats=3, **kwargs):
        timed.update(packed=packed, transposed=transposed, panels=panels)
        return layout
    monkeypatch.setattr(lean, "fastest_layout", fake)
    weight = torch.randn(lean.LAYOUT_MIN_ROWS + 16, 24)
    head = lean.Linear(weight).pack(choose_layout=True)
    kept = {"packed": head.packed, "transposed": head.transposed, "panels": head.panels}
    assert kept[layout] is not None and kept[layout] is timed[layout]
    assert all(v is None for k, v in kept.items() if k != layout)


def test_timed_rounds_within_the_budget():
    """The layout timer runs at least `repeats` rounds per input after one untimed call, more while its
    time budget lasts, and at most `most`."""
    from taps import lean

    calls = {"a": 0, "b": 0}

    def counter(key):
        def run(x):
            calls[key] += 1
        return run
    seconds = lean._timed({k: counter(k) for k in calls}, [torch.zeros(1), torch.zeros(2)], repeats=2)
    assert calls == {"a": 6, "b": 6} and set(seconds) == {"a", "b"}
    calls.update(a=0, b=0)
    lean._timed({k: counter(k) for k in calls}, [torch.zeros(1)], repeats=2, budget=60.0, most=7)
    assert calls == {"a": 8, "b": 8}


def test_small_layout_is_timed_once_per_shape_and_thread_count(monkeypatch):
    """`small_layout` keeps its answer per (shape, panels allowed, threads): asked again, it does not time
    again; with another thread count (another BLAS kernel), it does; panels are a candidate only where
    allowed."""
    from taps import lean

    timed = []

    def fake(candidates, inputs, repeats, **kwargs):
        timed.append((torch.get_num_threads(), tuple(sorted(candidates))))
        return {key: {"plain": 2.0, "stacked": 1.0, "panels": 0.5}[key] for key in candidates}
    monkeypatch.setattr(lean, "_timed", fake)
    monkeypatch.setattr(lean, "_SMALL_LAYOUT", {})
    threads = torch.get_num_threads()
    try:
        assert lean.small_layout((32, 16)) == "panels" and lean.small_layout((32, 16)) == "panels"
        assert timed == [(threads, ("panels", "plain", "stacked"))]
        assert lean.small_layout((32, 16), panels=False) == "stacked"
        other = 2 if threads == 1 else 1
        torch.set_num_threads(other)
        assert lean.small_layout((32, 16)) == "panels"
        assert timed == [(threads, ("panels", "plain", "stacked")), (threads, ("plain", "stacked")),
                         (other, ("panels", "plain", "stacked"))]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("layout", ["plain", "stacked", "panels"])
def test_every_small_layout_gives_the_same_product(layout, monkeypatch):
    """A layer projection keeps the layout timed fastest (Linear.choose_small_layout); each gives F.linear's
    product up to float rounding, with and without a bias; panels only where the shape allows them."""
    from taps import lean

    monkeypatch.setattr(lean, "small_layout", lambda shape, panels=True, repeats=3, stacked=True, bf16=False, packed=False:
                        layout if (layout != "panels" or panels) and (layout != "stacked" or stacked) else "plain")
    torch.manual_seed(0)
    for out in (48, 40, 16):
        weight, bias = torch.randn(out, 24), torch.randn(out)
        for b in (None, bias):
            lin = lean.Linear(weight, b).pack().choose_small_layout()
            assert lin.stacked == (layout == "stacked")
            assert (lin.panels is not None) == (layout == "panels" and out in (48,))
            x = torch.randn(1, 5, 24)
            with torch.no_grad():
                torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)
            head = lean.Linear(weight, b).pack().choose_small_layout(stacked=False)   # a head: any input shape
            assert not head.stacked and (head.panels is not None) == (layout == "panels" and out in (48,))
            x = torch.randn(3, 2, 24)
            with torch.no_grad():
                torch.testing.assert_close(head(x), torch.nn.functional.linear(x, weight, b), rtol=1e-5, atol=1e-5)


def test_a_widened_bf16_weight_may_be_kept_as_bf16_panels(monkeypatch):
    """On a CPU without bf16 products, a bfloat16 weight is widened (Linear.pack); bfloat16 panels hold its
    values exactly, so that layout (a candidate of small_layout / fastest_layout only for such weights) gives
    the float32 panels' products bit for bit from half the bytes."""
    from taps import lean

    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: False)
    offered = []

    def fake(candidates, inputs, repeats, **kwargs):
        offered.append(tuple(sorted(candidates)))
        return {key: 0.5 if key == "panels_bf16" else 1.0 for key in candidates}
    monkeypatch.setattr(lean, "_timed", fake)
    monkeypatch.setattr(lean, "_SMALL_LAYOUT", {})
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 24).bfloat16(), torch.randn(48).bfloat16()
    for b in (None, bias):
        lin = lean.Linear(weight, b).pack().choose_small_layout()
        assert lin.widened and lin.panels.dtype == torch.bfloat16
        head = lean.Linear(torch.randn(lean.LAYOUT_MIN_ROWS, 24).bfloat16(), None).pack(choose_layout=True)
        assert head.panels.dtype == torch.bfloat16
        wide = taps_ops.pack_panels(weight.float())
        x = torch.randn(2, 5, 24).bfloat16()
        with torch.no_grad():
            expected = taps_ops.panel_linear(x.float(), wide, None if b is None else b.float()).bfloat16()
            assert torch.equal(lin(x), expected)
    assert ("panels", "panels_bf16", "plain", "stacked") in offered
    assert ("packed", "panels", "panels_bf16", "plain", "transposed") in offered or \
        ("panels", "panels_bf16", "plain", "transposed") in offered
    offered.clear()
    lean.Linear(torch.randn(48, 24)).pack().choose_small_layout()   # float32 weights: no bf16 candidate
    assert offered and all("panels_bf16" not in c for c in offered)


def test_a_native_bf16_weight_is_kept_as_bf16_panels_where_they_time_faster(monkeypatch):
    """On a CPU with bf16 products, Linear.pack times oneDNN's bf16 kernel against bfloat16 panels
    (native_half_layout) for each bfloat16 weight that panels fit, at every level (at amx the panels multiply
    bf16 x on AMX tiles); where the panels win, the weight is widened and kept as them: its products are
    the widened float32 panels' bit for bit below the amx level, whatever the row count. Where oneDNN wins, with
    TAPS_PANELS_BF16=0 and for shapes panels do not fit, the weight stays bfloat16; stacked weights (a drafter
    group's) are kept as one group's would be."""
    from taps import lean

    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: True)
    choice, asked = {"layout": "panels_bf16"}, []
    monkeypatch.setattr(lean, "native_half_layout", lambda shape, repeats=3: asked.append(shape) or choice["layout"])
    torch.manual_seed(0)
    weight, bias = torch.randn(48, 24).bfloat16(), torch.randn(48).bfloat16()
    wide = taps_ops.pack_panels(weight.float())
    for b in (None, bias):
        lin = lean.Linear(weight, b).pack().choose_small_layout()
        assert lin.widened and lin.half == torch.bfloat16 and lin.panels.dtype == torch.bfloat16 and lin.packed is None
        x = torch.randn(1, 16, 24).bfloat16()
        with torch.no_grad():
            whole = lin(x)
            assert torch.equal(whole, taps_ops.panel_linear(x.float(), wide, None if b is None else b.float()).bfloat16())
            for rows in (1, 3):   # a plain step's rows give a tree's bits
                assert torch.equal(lin(x[:, :rows]), whole[:, :rows])
    assert asked == [(48, 24), (48, 24)]

    def kept_bf16(lin):
        return not lin.widened and lin.weight.dtype == torch.bfloat16 and lin.panels is None

    asked.clear()
    choice["layout"] = "packed"
    assert kept_bf16(lean.Linear(weight).pack()) and asked == [(48, 24)]
    choice["layout"] = "panels_bf16"
    monkeypatch.setattr(lean, "PANELS_BF16", False)
    assert kept_bf16(lean.Linear(weight).pack())
    monkeypatch.setattr(lean, "PANELS_BF16", True)
    # G > 1 drafters' weights (a group's): each group's bf16 panels where one group's weight would be kept so
    # (bmm, their other layout, is slower at a step's rows); each group's product is its own weight's panels'
    other = (weight.float() * 0.5).bfloat16()
    asked.clear()
    stacked = lean.Linear([weight, other], [bias, bias]).pack()
    assert asked == [(48, 24)]
    assert stacked.stacked and stacked.widened and stacked.panels.dtype == torch.bfloat16
    assert stacked.panels.shape[:2] == (2, 3)
    x = torch.randn(2, 5, 24).bfloat16()
    with torch.no_grad():
        y = stacked(x)
        assert y.dtype == torch.bfloat16 and y.shape == (2, 5, 48)
        for g, w in enumerate((weight, other)):
            assert torch.equal(y[g], taps_ops.panel_linear(x[g], taps_ops.pack_panels(w.float(), torch.bfloat16),
                                                           bias.float()))
    choice["layout"] = "packed"
    assert not lean.Linear([weight, other]).pack().widened   # (oneDNN's bmm, as before)
    choice["layout"] = "panels_bf16"
    asked.clear()
    for shape in ((40, 24), (16, 24), (48, 23)):   # outputs not whole panels, one panel, an odd input count
        assert kept_bf16(lean.Linear(torch.randn(*shape).bfloat16()).pack())
    half = lean.Linear(weight.float().half()).pack()   # float16: no such layout
    assert not half.widened and half.weight.dtype == torch.float16 and half.panels is None
    assert asked == []


def test_native_half_layout_times_both_layouts_once_per_shape():
    """The timing itself (a real one, small shape): one of the two layouts, cached per shape and threads."""
    from taps import lean

    first = lean.native_half_layout((64, 32))
    assert first in ("packed", "panels_bf16")
    assert lean._NATIVE_HALF_LAYOUT[((64, 32), torch.get_num_threads())] == first
    assert lean.native_half_layout((64, 32)) == first


def test_a_large_layer_projection_times_its_onednn_copy_beside_panels(monkeypatch):
    """A float32 projection of >= 4096 rows gets a oneDNN-packed copy (pack_weight); in a decoder layer
    (choose_small_layout(packed=True)) that copy is one more timed candidate, dropped when another layout
    is faster (a large model's MLP read from memory: panels), kept when it is the fastest; a head
    (packed=False) keeps it untimed."""
    from taps import lean

    if lean.pack_weight(torch.randn(4096, 32)) is None:
        pytest.skip("oneDNN packing is not available here")
    offered, fastest = [], ["panels"]

    def fake(candidates, inputs, repeats, **kwargs):
        offered.append(tuple(sorted(candidates)))
        return {key: 0.5 if key == fastest[0] else 1.0 for key in candidates}
    monkeypatch.setattr(lean, "_timed", fake)
    monkeypatch.setattr(lean, "_SMALL_LAYOUT", {})
    torch.manual_seed(0)
    weight = torch.randn(4096, 32)
    x = torch.randn(1, 3, 32)
    for winner in ("panels", "packed", "plain"):
        fastest[0] = winner
        monkeypatch.setattr(lean, "_SMALL_LAYOUT", {})
        lin = lean.Linear(weight).pack()
        assert lin.packed is not None
        lin.choose_small_layout(packed=True)
        assert offered[-1] == ("packed", "panels", "plain", "stacked")
        assert (lin.packed is not None) == (winner == "packed") and (lin.panels is not None) == (winner == "panels")
        with torch.no_grad():
            torch.testing.assert_close(lin(x), torch.nn.functional.linear(x, weight), rtol=1e-4, atol=1e-4)
    offered.clear()
    head = lean.Linear(weight).pack().choose_small_layout(stacked=False)
    assert not offered and head.packed is not None
