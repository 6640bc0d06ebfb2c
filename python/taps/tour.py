"""``taps tour``: the kernels on synthetic trees (two drafters' candidates, their trees built and merged,
verified losslessly, the output distribution checked, the speed against plain PyTorch), then the engine
on a small random Llama (:mod:`taps.synthetic`) with every combining strategy."""

from __future__ import annotations

import time

import torch


def _synthetic_drafter(batch, depth, top_k, vocab, seed):
    """EAGLE-2 style candidates of a synthetic drafter (cumulative log-probs along each path)."""
    g = torch.Generator().manual_seed(seed)
    scores, tokens, parents = [], [], []
    frontier_score = torch.zeros(batch, 1)
    frontier_idx = torch.full((batch, 1), -1, dtype=torch.int64)
    offset = 0
    for _ in range(depth):
        width = frontier_score.shape[1]
        logp = torch.log_softmax(torch.randn(batch, width, top_k, generator=g) * 2.5, -1)
        cum = (frontier_score.unsqueeze(-1) + logp).reshape(batch, -1)
        tok = torch.randint(0, vocab, (batch, width * top_k), generator=g)
        scores.append(cum)
        tokens.append(tok)
        parents.append(frontier_idx.repeat_interleave(top_k, dim=1))
        best = torch.topk(cum, min(top_k, cum.shape[1]), dim=-1)
        frontier_score, frontier_idx = best.values, best.indices + offset
        offset += cum.shape[1]
    return torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1)


def tour(args) -> int:
    import taps_ops

    torch.manual_seed(0)
    print(f"taps_ops loaded: CUDA kernels {'present' if taps_ops.has_cuda_kernels() else 'absent'}; "
          f"running on {'cuda' if torch.cuda.is_available() and taps_ops.has_cuda_kernels() else 'cpu'}\n")
    batch, depth, top_k, vocab, budget = 4, 5, 4, 50, 24

    # 1. two drafters propose candidates; build_tree keeps the best `budget` nodes of each
    cand_a = _synthetic_drafter(batch, depth, top_k, vocab, seed=1)
    # drafter B: its own scores, agreeing with A on about 60% of the candidate tokens
    scores_b, tokens_b, _ = _synthetic_drafter(batch, depth, top_k, vocab, seed=2)
    agree = torch.rand(tokens_b.shape, generator=torch.Generator().manual_seed(3)) < 0.6
    cand_b = (scores_b, torch.where(agree, cand_a[1], tokens_b), cand_a[2])
    root = torch.randint(0, vocab, (batch,))
    tree_a = taps_ops.build_tree(*cand_a, budget, root_tokens=root)
    tree_b = taps_ops.build_tree(*cand_b, budget, root_tokens=root)
    print(f"1. build_tree: {cand_a[0].shape[1]} candidates per drafter -> trees of {budget} nodes "
          f"(depth {int(tree_a.depth.max())})")

    # 2. merge them: trie union, deduplicated, with a source bitmask
    stack = lambda f: torch.stack([getattr(tree_a, f), getattr(tree_b, f)], 1)  # noqa: E731
    merged = taps_ops.merge_trees(stack("tokens"), stack("parents"), stack("scores"))
    equal = taps_ops.merge_trees(stack("tokens"), stack("parents"), stack("scores"), num_nodes=budget)
    sizes = (merged.tokens >= 0).sum(1).tolist()
    real = equal.tokens >= 0
    real[:, 0] = False
    print(f"2. merge_trees: deduplicated union sizes {sizes} (at most {2 * (budget - 1) + 1} without dedup); "
          f"cut to the single-drafter budget of {budget} nodes, the {int(real.sum())} non-root nodes of the "
          f"{batch} requests came from A only: {int((real & (equal.source == 1)).sum())}, B only: "
          f"{int((real & (equal.source == 2)).sum())}, both: {int((real & (equal.source == 3)).sum())}")

    # 3. a synthetic target that mostly agrees with drafter A's best path; verify the merged tree
    logits = torch.randn(batch, merged.tokens.shape[1], vocab) * 1.5
    first_child = torch.full(merged.tokens.shape, -1)
    for i in range(merged.tokens.shape[1] - 1, 0, -1):
        p = merged.parents[:, i]
        ok = p >= 0
        first_child[ok, p[ok]] = i
    has = first_child >= 0
    b_idx, n_idx = has.nonzero(as_tuple=True)
    logits[b_idx, n_idx, merged.tokens[b_idx, first_child[b_idx, n_idx]]] += 4.0
    greedy = taps_ops.verify_tree(logits, merged.tokens, merged.parents)
    sampled = taps_ops.verify_tree(logits, merged.tokens, merged.parents, temperature=1.0, top_p=0.95,
                                   generator=torch.Generator().manual_seed(0))
    print("3. verify_tree on the merged tree:")
    for b in range(batch):
        g_toks = greedy.tokens[b, : greedy.num_accepted[b] + 1].tolist()
        s_toks = sampled.tokens[b, : sampled.num_accepted[b] + 1].tolist()
        print(f"   request {b}: greedy accepted {int(greedy.num_accepted[b])} -> emits {g_toks};  "
              f"T=1 top-p 0.95 accepted {int(sampled.num_accepted[b])} -> emits {s_toks}")

    # 4. lossless: the first emitted token follows the target distribution exactly
    copies = 4000 if args.quick else 40000
    row = logits[0:1].expand(copies, -1, -1).contiguous()
    out = taps_ops.verify_tree(row, merged.tokens[0:1].expand(copies, -1).contiguous(),
                               merged.parents[0:1].expand(copies, -1).contiguous(), temperature=1.0,
                               generator=torch.Generator().manual_seed(1))
    counts = torch.bincount(out.tokens[:, 0], minlength=vocab).double()
    target = torch.softmax(logits[0, 0].double(), -1)
    tv = 0.5 * (counts / copies - target).abs().sum().item()
    print(f"4. lossless check: {copies} draws of the first emitted token vs softmax(target logits): "
          f"total variation {tv:.4f} (sampling noise alone ~{0.5 * (2 * vocab / (3.14159 * copies)) ** 0.5:.4f})")

    # 5. speed at a Llama-3 vocabulary
    b, n, v = (8, 64, 128256) if not args.quick else (4, 32, 32000)
    big = torch.randn(b, n, v)
    toks = torch.randint(0, v, (b, n))
    pars = torch.tensor([[-1] + [max(0, i // 3) for i in range(1, n)]] * b)
    uni = torch.rand(b, n)

    def best_of(fn, reps=5):
        best = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
        return best

    t_plain = best_of(lambda: torch.softmax(big, -1))
    t_ops = best_of(lambda: taps_ops.verify_tree(big, toks, pars, temperature=1.0, uniforms=uni))
    print(f"5. speed, B={b} N={n} V={v} fp32 on CPU, temperature 1: plain softmax over every node "
          f"{t_plain * 1e3:.1f} ms (before any walk) vs taps_ops.verify_tree {t_ops * 1e3:.2f} ms "
          f"({t_plain / t_ops:.0f}x); bench/bench_verify_tree.py has the full table")
    _demo_engine(args)
    return 0


def _demo_engine(args) -> None:
    """Speculative decoding end to end on a small randomly initialised Llama (no download): drafters are
    the target's first layer used as an early exit (A) and a perturbed copy of it (B)."""
    try:
        from taps.synthetic import early_exit as early_exit_of, perturbed, refined_llama
    except ImportError:
        print("6. engine: skipped (pip install transformers)")
        return
    from taps import ModelDrafter, SpeculativeDecoder

    target = refined_llama(vocab=512, hidden=128, layers=4, seed=0)
    early_exit = early_exit_of(target)
    noisy = perturbed(early_exit, noise=0.5, seed=1)
    prompts = [torch.randint(0, 512, (12 + 5 * i,), generator=torch.Generator().manual_seed(i)).tolist()
               for i in range(3)]
    new_tokens = 24 if args.quick else 48
    reference = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=new_tokens)
    print(f"6. engine on a small random Llama (4 layers; drafters: early exit A, perturbed copy B), "
          f"batch of 3 ragged prompts, {new_tokens} tokens, greedy:")
    for strategy, drafters in (("single", [early_exit]), ("route-confidence", [early_exit, noisy]),
                               ("merged", [early_exit, noisy]), ("merged-budget", [early_exit, noisy]),
                               ("adaptive", [early_exit, noisy])):
        dec = SpeculativeDecoder(target, [ModelDrafter(m) for m in drafters], strategy=strategy, depth=4, top_k=4,
                                 budget=16)
        out = dec.generate(prompts, max_new_tokens=new_tokens)
        same = out.tokens == reference.tokens
        taus = [round(s.tau, 2) for s in out.stats]
        print(f"   {strategy:16s} tau per request {taus}  identical to the target's own greedy output: {same}")
