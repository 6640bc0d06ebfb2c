"""The Hugging Face tree-verification hook (taps.hf) on tiny randomly initialised models, fp32 on CPU.

1. One verification forward gives, at every tree node, the logits of that node's root-to-node path run
   as a plain sequence after the prefix.
2. Verify + compact_cache + continue reproduces plain greedy generation (ragged batch).
3. Ragged batches: prefill of right-padded prompts, per-request trees.
"""

import pytest
import torch
import transformers

import taps_ops
from taps import hf

pytestmark = pytest.mark.usefixtures("one_thread")


VOCAB = 128
TOL = dict(atol=1e-5, rtol=1e-5)


def _tiny_config(arch: str):
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  initializer_range=0.1, tie_word_embeddings=False)
    if arch == "llama":
        return transformers.LlamaConfig(**common), transformers.LlamaForCausalLM
    if arch == "qwen2":  # q/k/v projections with bias
        return transformers.Qwen2Config(**common), transformers.Qwen2ForCausalLM
    if arch == "qwen3":  # per-head q/k RMSNorm, explicit head_dim
        return transformers.Qwen3Config(head_dim=16, **common), transformers.Qwen3ForCausalLM
    if arch == "mistral":  # passes sliding_window to the attention function
        return transformers.MistralConfig(**common), transformers.MistralForCausalLM
    raise ValueError(arch)


ARCHS = ["llama", "qwen2", "qwen3", "mistral"]  # transformers has them all since 4.51: a missing one fails

_MODELS = {}


def _model(arch: str):
    if arch not in _MODELS:
        config, cls = _tiny_config(arch)
        torch.manual_seed(1234)
        model = cls(config).eval()
        hf.use_taps_attention(model)
        _MODELS[arch] = model
    return _MODELS[arch]


@torch.no_grad()
def _plain_logits(model, seq):
    """Logits [len(seq), V] of a plain causal forward over `seq` (no cache, no tree)."""
    return model(input_ids=torch.tensor([seq])).logits[0]


def _tree_tensors(parents_rows, tokens_rows, num_nodes=None):
    """Pad literal trees to N nodes; return tokens, parents, depth [B, N] and tree_mask [B, N, W]."""
    n = num_nodes or max(len(p) for p in parents_rows)
    words = (n + 63) // 64
    batch = len(parents_rows)
    tokens = torch.full((batch, n), -1, dtype=torch.int64)
    parents = torch.full((batch, n), -1, dtype=torch.int64)
    depth = torch.full((batch, n), -1, dtype=torch.int64)
    mask = torch.zeros((batch, n, words), dtype=torch.int64)
    for b, (par, tok) in enumerate(zip(parents_rows, tokens_rows)):
        bits = []
        for i, (p, t) in enumerate(zip(par, tok)):
            assert (i == 0 and p == -1) or 0 <= p < i
            tokens[b, i], parents[b, i] = t, p
            depth[b, i] = 0 if p < 0 else depth[b, p] + 1
            bits.append((set() if p < 0 else set(bits[p])) | {i})
        for i in range(n):
            for j in (bits[i] if i < len(bits) else {i}):  # a padding row sees only itself
                word, bit = divmod(j, 64)
                value = int(mask[b, i, word]) | (1 << bit)
                mask[b, i, word] = value - (1 << 64) if value >= (1 << 63) else value
    return tokens, parents, depth, mask


def _path_tokens(par, tok, i):
    out = []
    while i >= 0:
        out.append(tok[i])
        i = par[i]
    return out[::-1]


def _prefill_ragged(model, prompts, max_len=96):
    batch, longest = len(prompts), max(len(p) for p in prompts)
    ids = torch.full((batch, longest), -1, dtype=torch.int64)
    for b, p in enumerate(prompts):
        ids[b, :len(p)] = torch.tensor(p)
    lens = torch.tensor([len(p) for p in prompts])
    cache = hf.TreeKVCache.for_model(model, batch, max_len)
    with torch.no_grad():
        out = hf.prefill(model, cache, ids, lens)
    assert cache.lengths.tolist() == lens.tolist()
    return cache, out.logits


def _check_tree_logits(model, prompts, roots, parents_rows, tokens_rows, num_nodes=None):
    cache, _ = _prefill_ragged(model, prompts)
    tokens, parents, depth, mask = _tree_tensors(parents_rows, [[r] + t[1:] for r, t in zip(roots, tokens_rows)],
                                                 num_nodes)
    with torch.no_grad():
        out = hf.tree_verify_forward(model, cache, tokens, mask, depth, return_hidden=True)
    n = tokens.shape[1]
    assert out.logits.shape == (len(prompts), n, VOCAB)
    assert out.hidden_states.shape[:2] == (len(prompts), n)
    assert cache.lengths.tolist() == [len(p) for p in prompts]  # the tree is not committed yet
    for b, prompt in enumerate(prompts):
        par, tok = parents[b].tolist(), tokens[b].tolist()
        for i in range(len(parents_rows[b])):
            expected = _plain_logits(model, prompt + _path_tokens(par, tok, i))[-1]
            torch.testing.assert_close(out.logits[b, i], expected, **TOL, msg=f"request {b} node {i}")


# Node 0 is the root; siblings repeat tokens of other branches so that only the mask and positions
# tell the paths apart.
LITERAL_PARENTS = [-1, 0, 0, 1, 1, 2, 3, 0, 6, 5]
LITERAL_TOKENS = [0, 20, 21, 30, 31, 20, 40, 22, 21, 30]


@pytest.mark.parametrize("arch", ARCHS)
def test_tree_logits_equal_path_logits(arch):
    model = _model(arch)
    prompt = [5, 17, 42, 8, 61, 3, 29]
    # two padding nodes at the end
    _check_tree_logits(model, [prompt], [11], [LITERAL_PARENTS], [LITERAL_TOKENS], num_nodes=12)


def test_tree_logits_more_than_64_nodes():
    model = _model("llama")
    gen = torch.Generator().manual_seed(7)
    n = 70
    parents = [-1]
    for i in range(1, n):  # mostly deep chains, some branching, crossing the 64-node word boundary
        branch = torch.rand((), generator=gen) < 0.3
        parents.append(int(torch.randint(0, i, (), generator=gen)) if branch else i - 1)
    tokens = torch.randint(0, VOCAB, (n,), generator=gen).tolist()
    _check_tree_logits(model, [[9, 1, 77, 4, 50]], [tokens[0]], [parents], [tokens])


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_ragged_batch_prefill_and_trees(arch):
    model = _model(arch)
    prompts = [[5, 17, 42, 8, 61], [3, 3, 90, 12, 7, 64, 100, 2, 33], [70, 1, 9]]
    cache, last_logits = _prefill_ragged(model, prompts)
    for b, p in enumerate(prompts):
        torch.testing.assert_close(last_logits[b], _plain_logits(model, p)[-1], **TOL)
    trees = [
        (LITERAL_PARENTS, LITERAL_TOKENS),
        ([-1, 0, 1, 2, 0], [0, 8, 9, 10, 8]),
        ([-1, 0, 0, 0, 1, 4], [0, 1, 2, 3, 4, 5]),
    ]
    _check_tree_logits(model, prompts, [11, 12, 13], [t[0] for t in trees], [t[1] for t in trees])


def _greedy_reference(model, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(_plain_logits(model, seq)[-1].argmax()))
    return seq[len(prompt):]


def _greedy_walk(logits, parents, tokens):
    """Greedy tree verification: the accepted path (node indices, root first) and the bonus token."""
    path, node = [0], 0
    while True:
        y = int(logits[node].argmax())
        child = next((c for c in range(len(parents)) if parents[c] == node and tokens[c] == y), None)
        if child is None:
            return path, y
        path.append(child)
        node = child


@pytest.mark.parametrize("arch", ARCHS[:2])
def test_verify_compact_continue_equals_greedy(arch):
    model = _model(arch)
    prompts = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 100, 2, 33], [70, 1, 9, 4]]
    target_len = 20
    reference = [_greedy_reference(model, p, target_len + 8) for p in prompts]
    cache, last_logits = _prefill_ragged(model, prompts)
    generated = [[int(t)] for t in last_logits.argmax(-1)]  # the first root of each request
    step = 0
    while min(len(g) for g in generated) < target_len:
        # Oracle trees: at each depth a wrong sibling first, then the right token; a wrong leaf under
        # the chain's end. Chain depth varies by step and request (0 = only the wrong leaf).
        parents_rows, tokens_rows = [], []
        for b, gen in enumerate(generated):
            future = reference[b][len(gen):]
            par, tok, chain = [-1], [gen[-1]], 0
            for d in range((step + b) % 4):
                par.append(chain), tok.append((future[d] + 1) % VOCAB)
                par.append(chain), tok.append(future[d])
                chain = len(par) - 1
            par.append(chain), tok.append((future[(step + b) % 4] + 5) % VOCAB)
            parents_rows.append(par), tokens_rows.append(tok)
        tokens, parents, depth, mask = _tree_tensors(parents_rows, tokens_rows)
        prefix = cache.lengths.clone()
        with torch.no_grad():
            logits = hf.tree_verify_forward(model, cache, tokens, mask, depth).logits
        path = torch.full(tokens.shape, -1, dtype=torch.int64)
        for b in range(len(prompts)):
            accepted, bonus = _greedy_walk(logits[b], parents[b].tolist(), tokens[b].tolist())
            assert len(accepted) == 1 + (step + b) % 4  # the oracle chain is accepted, the wrong leaf not
            path[b, :len(accepted)] = torch.tensor(accepted)
            generated[b] += [int(tokens[b, i]) for i in accepted[1:]] + [bonus]
        new_lengths = hf.compact_cache(cache, path)
        assert new_lengths.tolist() == (prefix + (path >= 0).sum(1)).tolist()
        assert cache.lengths.tolist() == new_lengths.tolist()
        step += 1
    # Plain decode steps on the compacted cache continue the same sequence.
    for _ in range(3):
        roots = torch.tensor([[g[-1]] for g in generated])
        with torch.no_grad():
            nxt = hf.prefill(model, cache, roots).logits.argmax(-1)
        for b in range(len(prompts)):
            generated[b].append(int(nxt[b]))
    for b in range(len(prompts)):
        assert generated[b] == reference[b][:len(generated[b])], f"request {b}"
        assert cache.lengths[b] == len(prompts[b]) + len(generated[b]) - 1


def test_plain_forward_is_sdpa():
    """Without a tree context the hook is transformers' sdpa attention (with its own mask)."""
    model = _model("llama")
    seq = [4, 8, 15, 16, 23, 42]
    ours = _plain_logits(model, seq)
    model.set_attn_implementation("sdpa")
    try:
        theirs = _plain_logits(model, seq)
    finally:
        hf.use_taps_attention(model)
    torch.testing.assert_close(ours, theirs, atol=0, rtol=0)


def test_tree_forward_requires_taps_attention():
    config, cls = _tiny_config("llama")
    model = cls(config).eval()
    model.set_attn_implementation("sdpa")
    cache = hf.TreeKVCache.for_model(model, 1, 16)
    tokens, _, depth, mask = _tree_tensors([[-1, 0]], [[1, 2]])
    with pytest.raises(ValueError, match="taps"):
        hf.tree_verify_forward(model, cache, tokens, mask, depth)


def test_sliding_window_beyond_context_is_refused():
    """Our masks hide no key by distance: a window shorter than the context must raise, not mislead."""
    config, cls = _tiny_config("mistral")
    config.sliding_window = 8
    torch.manual_seed(0)
    model = hf.use_taps_attention(cls(config).eval())
    cache = hf.TreeKVCache.for_model(model, 1, 32)
    with torch.no_grad():
        hf.prefill(model, cache, torch.tensor([[1, 2, 3, 4, 5]]))  # 5 <= 8: fine
        tokens, _, depth, mask = _tree_tensors([[-1, 0, 1]], [[6, 7, 8]])
        hf.tree_verify_forward(model, cache, tokens, mask, depth)  # 5 + 3 <= 8: fine
        tokens, _, depth, mask = _tree_tensors([[-1, 0, 1, 2]], [[6, 7, 8, 9]])
        with pytest.raises(NotImplementedError, match="sliding-window"):
            hf.tree_verify_forward(model, cache, tokens, mask, depth)
        with pytest.raises(NotImplementedError, match="sliding-window"):
            hf.prefill(model, cache, torch.tensor([[6, 7, 8, 9]]))


def test_tree_from_build_tree():
    """Trees as taps_ops.build_tree returns them (its padding rows included) verify correctly."""
    model = _model("llama")
    # EAGLE-2 style candidates for 2 requests: 3 children of the root, then children of the best ones.
    tokens = torch.tensor([[20, 21, 22, 30, 31, 32, 40, 41],
                           [50, 51, 52, 60, 61, 62, 70, -1]])
    parents = torch.tensor([[-1, -1, -1, 0, 0, 1, 3, 3],
                            [-1, -1, -1, 0, 1, 1, 5, -1]])
    scores = torch.tensor([[-0.1, -0.5, -2.0, -0.3, -0.9, -1.0, -0.6, -1.5],
                           [-0.2, -0.3, -3.0, -0.4, -0.5, -0.8, -1.1, 0.0]])
    prompts = [[5, 17, 42, 8, 61], [3, 90, 12, 7, 64, 100, 2]]
    roots = torch.tensor([11, 12])
    tree = taps_ops.build_tree(scores, tokens, parents, num_nodes=10, root_tokens=roots)
    real = (tree.tokens >= 0).sum(1).tolist()
    assert real == [9, 8]  # padding nodes in both trees
    cache, _ = _prefill_ragged(model, prompts)
    with torch.no_grad():
        logits = hf.tree_verify_forward(model, cache, tree.tokens, tree.tree_mask, tree.depth).logits
    for b, prompt in enumerate(prompts):
        par, tok = tree.parents[b].tolist(), tree.tokens[b].tolist()
        for i in range(real[b]):
            expected = _plain_logits(model, prompt + _path_tokens(par, tok, i))[-1]
            torch.testing.assert_close(logits[b, i], expected, **TOL, msg=f"request {b} node {i}")
