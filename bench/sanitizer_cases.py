"""Small CUDA calls of every op, for compute-sanitizer (memcheck / racecheck) in bench/gpu_check.sh."""

import torch

import taps_ops

dev = "cuda"
g = torch.Generator().manual_seed(0)
# a tree with odd sizes: V = 111 (rows not 16-byte aligned), padding, duplicate sibling tokens
tokens = torch.tensor([[5, 1, 1, 2, 3, -1, -1], [7, 4, 9, 9, -1, -1, -1]])
parents = torch.tensor([[-1, 0, 0, 1, 3, -1, -1], [-1, 0, 1, 0, -1, -1, -1]])
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    logits = torch.randn(2, 7, 111, generator=g).to(dtype)
    for kw in (dict(), dict(temperature=1.0), dict(temperature=0.7, top_k=5, top_p=0.9)):
        taps_ops.verify_tree(logits.to(dev), tokens.to(dev), parents.to(dev), uniforms=torch.rand(2, 7, generator=g).to(dev), **kw)
    q = torch.softmax(torch.randn(2, 7, 111, generator=g), -1).to(dtype)
    taps_ops.verify_tree(logits.to(dev), tokens.to(dev), parents.to(dev), temperature=1.0, draft_probs=q.to(dev),
                         uniforms=torch.rand(2, 7, generator=g).to(dev))
scores = -torch.rand(3, 40, generator=g).cumsum(1)
cand_tokens = torch.randint(0, 100, (3, 40), generator=g)
cand_parents = torch.tensor([[-1 if i < 4 else (i - 4) // 3 for i in range(40)]] * 3)
tree = taps_ops.build_tree(scores.to(dev), cand_tokens.to(dev), cand_parents.to(dev), 17)
t = lambda x: torch.stack([x, x], 1)  # noqa: E731
taps_ops.merge_trees(t(tree.tokens), t(tree.parents), t(tree.scores), 20)
for dtype, heads_q in ((torch.float32, 4), (torch.bfloat16, 4), (torch.bfloat16, 8)):  # bf16 Hq 8: tensor cores
    for d in (64, 128):
        q = torch.randn(2, heads_q, 7, d, generator=g).to(dev, dtype)
        k = torch.randn(2, 2, 50, d, generator=g).to(dev, dtype)
        v = torch.randn(2, 2, 50, d, generator=g).to(dev, dtype)
        mask = torch.full((2, 7, 1), -1, dtype=torch.int64)
        taps_ops.tree_attention(q, k, v, mask.to(dev), torch.tensor([30, 50]).to(dev))
        # ragged queries: request 0's first 3 only, request 1's none (blocks without a live row return)
        taps_ops.tree_attention(q, k, v, mask.to(dev), torch.tensor([30, 50]).to(dev),
                                num_queries=torch.tensor([3, 0]).to(dev))
caches = [torch.randn(2, 2, 50, 16, generator=g).to(dev) for _ in range(4)]
taps_ops.compact_kv(caches, torch.tensor([[0, 1, 3, -1], [0, 2, -1, -1]]).to(dev), torch.tensor([10, 20]).to(dev))
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    x = torch.randn(5, 37, generator=g).to(dev, dtype)  # a width not a multiple of the warp
    taps_ops.rms_norm(x, torch.randn(37, generator=g).to(dev, dtype), 1e-6)
    qk = torch.randn(2, 3, 5, 16, generator=g).to(dev, dtype)[:, :, :4]  # strided heads, as in a fused qkv
    taps_ops.rope_(qk, torch.randn(2, 3, 16, generator=g).to(dev, dtype), torch.randn(2, 3, 16, generator=g).to(dev, dtype))
    lg = torch.randn(3, 5, 77, generator=g).to(dtype)  # an expansion level: V = 77, k = 6, a token map
    taps_ops.expand_level(lg.to(dev), torch.randn(3, 5, generator=g).to(dev), torch.arange(15).view(3, 5).to(dev), 6,
                          12, 40, torch.randperm(200, generator=g)[:77].to(dev), with_entropy=True)
torch.cuda.synchronize()
print("sanitizer cases done")
