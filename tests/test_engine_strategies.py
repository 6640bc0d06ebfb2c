"""Combining drafters (taps.strategies): routing, merging, budgets.

1. Confidence routing picks the drafter whose tree has the higher mean node confidence, on constructed
   candidates and end to end (a sharp copy of the target against a flattened one); entropy routing the
   drafter with the lower entropy.
2. Merged trees deduplicate (identical drafters give the single tree, every node from both) and
   merged-budget / adaptive respect the node budget.
3. The adaptive split of the budget and the candidate cut it uses.
"""

import pytest
import torch
import transformers

import taps_ops
from taps import ModelDrafter, SpeculativeDecoder
from taps.drafters import DraftCandidates
from taps.strategies import allocate_budget, make_strategy, reserve_nodes, tree_confidence

pytestmark = pytest.mark.usefixtures("one_thread")


def _cands(batch, m, seed, sharp=1.0, depth=3, top_k=2, vocab=50):
    """Synthetic EAGLE-2 candidates: level 1 = top_k root children, then top_k children of the best
    top_k nodes of the previous level; `sharp` scales the log-probs (higher = less confident)."""
    g = torch.Generator().manual_seed(seed)
    scores, tokens, parents = [], [], []
    front_s = torch.zeros(batch, 1)
    front_i = torch.full((batch, 1), -1)
    offset = 0
    for _ in range(depth):
        w = front_s.shape[1]
        logp = torch.log_softmax(torch.randn(batch, w, top_k, generator=g), -1).sort(-1, descending=True).values * sharp
        cum = (front_s.unsqueeze(-1) + logp).reshape(batch, -1)
        tok = torch.randint(0, vocab, (batch, w * top_k), generator=g)
        scores.append(cum), tokens.append(tok), parents.append(front_i.repeat_interleave(top_k, 1))
        best = cum.topk(min(top_k, cum.shape[1]), -1)
        front_s, front_i = best.values, best.indices + offset
        offset += cum.shape[1]
    return DraftCandidates(torch.cat(scores, 1), torch.cat(tokens, 1), torch.cat(parents, 1),
                           torch.rand(batch, generator=g))


def test_confidence_routing_picks_the_confident_drafter():
    batch, budget = 4, 7
    root = torch.arange(batch)
    sure = _cands(batch, 0, seed=1, sharp=0.2)
    unsure = _cands(batch, 0, seed=2, sharp=3.0)
    strat = make_strategy("route-confidence", 2, budget)
    strat.reset(batch, torch.device("cpu"))
    out = strat.combine({0: unsure, 1: sure}, root)
    assert out.choice.tolist() == [1] * batch
    tree = taps_ops.build_tree(sure.scores, sure.tokens, sure.parents, budget, root_tokens=root)
    assert torch.equal(out.tokens, tree.tokens) and torch.equal(out.parents, tree.parents)
    assert ((out.source == 2) | (out.tokens < 0) | (torch.arange(budget) == 0)).all()
    conf_sure = tree_confidence(tree)
    conf_unsure = tree_confidence(taps_ops.build_tree(unsure.scores, unsure.tokens, unsure.parents, budget))
    assert (conf_sure > conf_unsure).all()
    # mixed per request: request 0 gets the sure drafter's candidates in slot 0
    mixed0 = DraftCandidates(*(torch.cat([s[:1], u[1:]]) for s, u in zip(sure, unsure)))
    mixed1 = DraftCandidates(*(torch.cat([u[:1], s[1:]]) for s, u in zip(sure, unsure)))
    assert strat.combine({0: mixed0, 1: mixed1}, root).choice.tolist() == [0, 1, 1, 1]
    # entropy routing: the lower entropy wins
    ent = make_strategy("route-entropy", 2, budget)
    ent.reset(batch, torch.device("cpu"))
    low = sure._replace(entropy=torch.tensor([0.1, 2.0, 0.1, 2.0]))
    high = unsure._replace(entropy=torch.tensor([1.0, 1.0, 1.0, 1.0]))
    assert ent.combine({0: low, 1: high}, root).choice.tolist() == [0, 1, 0, 1]


def test_prompt_routing_decides_once():
    batch, budget = 2, 7
    root = torch.zeros(batch, dtype=torch.int64)
    strat = make_strategy("route-confidence-prompt", 3, budget, route_steps=2)
    strat.reset(batch, torch.device("cpu"))
    a, b, c = _cands(batch, 0, 1, sharp=0.2), _cands(batch, 0, 2, sharp=3.0), _cands(batch, 0, 3, sharp=1.0)
    assert strat.combine({0: b, 1: a, 2: c}, root).choice.tolist() == [1, 1]
    assert strat.alive() == [0, 1, 2]
    strat.combine({0: b, 1: a, 2: c}, root)
    assert strat.alive() == [1]  # decided: only drafter 1 drafts from now on
    assert strat.combine({1: b}, root).choice.tolist() == [1, 1]  # fixed, whatever its trees look like


def _target():
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(3)
    return transformers.LlamaForCausalLM(config).eval()


def test_routing_end_to_end_prefers_the_sharp_drafter():
    import copy
    target = _target()
    sharp, flat = copy.deepcopy(target), copy.deepcopy(target)
    with torch.no_grad():
        sharp.lm_head.weight.mul_(8.0)
        flat.lm_head.weight.mul_(0.05)
    for name in ("route-confidence", "route-entropy"):
        dec = SpeculativeDecoder(target, [ModelDrafter(flat), ModelDrafter(sharp)], strategy=name, depth=3, top_k=2)
        out = dec.generate([[1, 2, 3], [9, 8, 7, 6, 5]], max_new_tokens=8)
        for s in out.stats:
            assert s.route_decisions and set(s.route_decisions) == {1}, name


def test_merged_trees_deduplicate_and_respect_budget():
    batch, budget = 3, 9
    root = torch.tensor([4, 5, 6])
    a, b = _cands(batch, 0, seed=1), _cands(batch, 0, seed=2)
    tree_a = taps_ops.build_tree(a.scores, a.tokens, a.parents, budget, root_tokens=root)
    # identical drafters: the union is the single tree, every node from both
    same = make_strategy("merged", 2, budget)
    same.reset(batch, torch.device("cpu"))
    out = same.combine({0: a, 1: a}, root)
    assert out.tokens.shape == (batch, 2 * (budget - 1) + 1)
    real = out.tokens >= 0
    assert torch.equal(real.sum(1), (tree_a.tokens >= 0).sum(1))
    assert torch.equal(out.tokens[:, :budget], tree_a.tokens) and torch.equal(out.parents[:, :budget], tree_a.parents)
    assert (out.source[:, 1:][real[:, 1:]] == 3).all() and (out.source[:, 0] == 0).all()
    # different drafters: every token path appears once; merged-budget keeps `budget` nodes
    for name, cap in (("merged", 2 * (budget - 1) + 1), ("merged-budget", budget), ("adaptive", budget)):
        s = make_strategy(name, 2, budget)
        s.reset(batch, torch.device("cpu"))
        out = s.combine({0: a, 1: b}, root)
        assert out.tokens.shape[1] == cap
        for r in range(batch):
            par, tok = out.parents[r].tolist(), out.tokens[r].tolist()
            n = sum(t >= 0 for t in tok)
            assert n <= cap
            keys = [(par[i], tok[i]) for i in range(1, n)]
            assert len(keys) == len(set(keys)), f"{name}: duplicate child"
            assert all(out.source[r, i] in (1, 2, 3) for i in range(1, n))


@pytest.mark.parametrize("name", ["merged", "merged-budget"])
@pytest.mark.parametrize("seed", range(6))
def test_one_drafters_step_is_its_tree_unmerged(name, seed):
    """A step where one drafter of several drafted (a tuner's choice, prompt lookup alone) skips
    merge_trees: its tree as built equals the trie union of that one tree (its siblings distinct, as every
    drafter's are), field for field, with the drafter's bit as the draft nodes' source."""
    batch, budget, t = 3, 5 + seed, seed % 3
    root = torch.tensor([4, 5, 6])
    a = _cands(batch, 0, seed=seed, depth=2 + seed % 3, top_k=2 + seed % 2, vocab=10 ** 6)  # distinct siblings
    s = make_strategy(name, 3, budget)
    s.reset(batch, torch.device("cpu"))
    out = s.combine({t: a}, root)
    tree = taps_ops.build_tree(a.scores, a.tokens, a.parents, budget, root_tokens=root)
    union = taps_ops.merge_trees(tree.tokens.unsqueeze(1), tree.parents.unsqueeze(1), tree.scores.unsqueeze(1),
                                 num_nodes=budget if name == "merged-budget" else None)
    for field in ("tokens", "parents", "depth", "tree_mask"):
        assert torch.equal(getattr(out, field), getattr(union, field)), field
    draft = union.tokens >= 0
    draft[:, 0] = False
    assert torch.equal(out.source, torch.where(draft, union.source << t, 0))
    assert draft.any()


def test_adaptive_split_and_cut():
    alloc = allocate_budget(torch.tensor([[3.0, 1.0], [1.0, 1.0], [0.0, 5.0], [1.0, 0.0]]), 10)
    assert alloc.tolist() == [[7, 3], [5, 5], [1, 9], [9, 1]]
    assert allocate_budget(torch.tensor([[1.0, 1.0, 1.0]]), 2).sum().item() == 2
    # reserve_nodes: the root and the best alloc[b, t] nodes of each tree, closed under ancestors
    cand = _cands(2, 0, seed=4, depth=3, top_k=3)
    tree = taps_ops.build_tree(cand.scores, cand.tokens, cand.parents, 10, root_tokens=torch.tensor([0, 0]))
    alloc = torch.tensor([[4], [0]])
    raised = reserve_nodes(tree.scores.unsqueeze(1), tree.tokens.unsqueeze(1), alloc)[:, 0]
    kept = raised > tree.scores + 1
    assert kept.sum(1).tolist() == [5, 1] and kept[:, 0].all()
    for m in kept[0].nonzero().flatten().tolist():
        p = int(tree.parents[0, m])
        assert p < 0 or kept[0, p]
    draft = tree.scores[0, 1:][tree.tokens[0, 1:] >= 0]
    assert sorted(tree.scores[0, 1:][kept[0, 1:]].tolist()) == sorted(draft.topk(4).values.tolist())
    # the adaptive strategy moves budget to the drafter that gets accepted
    s = make_strategy("adaptive", 2, 9)
    s.reset(1, torch.device("cpu"))
    s.observe(torch.tensor([[10, 0]]))
    a, b = _cands(1, 0, seed=5), _cands(1, 0, seed=6)
    out = s.combine({0: a, 1: b}, torch.tensor([0]))
    src = out.source[0][out.tokens[0] >= 0][1:]
    assert int(((src & 1) > 0).sum()) > int(((src & 2) > 0).sum())
    # the reserved sets overlap less than the budget: the rest is filled, the tree is full
    assert int((out.tokens[0] >= 0).sum()) == 9


def test_padding_columns_are_trimmed_before_the_target_forward():
    """A merged tree is padded to room for the whole union; on the CPU the decoder cuts the columns past
    the batch's largest real node count (and the mask words past them) before the target forward, and
    the output is unchanged: two identical drafters merge into one tree of at most `budget` nodes."""
    from taps.decoder import _trim
    from taps.strategies import Combined

    target = _target()
    budget = 6
    ref = SpeculativeDecoder(target, [ModelDrafter(target)], strategy="single", depth=3, top_k=2, budget=budget)
    dec = SpeculativeDecoder(target, [ModelDrafter(target), ModelDrafter(target)], strategy="merged", depth=3,
                             top_k=2, budget=budget)
    widths = []
    tree_fn = dec.forward.tree

    def spy(cache, tokens, *args, **kwargs):
        widths.append(tokens.shape[1])
        return tree_fn(cache, tokens, *args, **kwargs)

    dec.forward.tree = spy
    prompts = [[1, 2, 3], [9, 8, 7, 6, 5]]
    out = dec.generate(prompts, max_new_tokens=8)
    assert widths and max(widths) <= budget < dec.strategy.num_nodes
    assert out.tokens == ref.generate(prompts, max_new_tokens=8).tokens
    # the cut itself: 70 columns (2 mask words) with at most 40 real nodes -> 40 columns, 1 word
    tokens = torch.full((2, 70), -1)
    tokens[0, :40], tokens[1, :25] = 5, 7
    mask = torch.randint(0, 2 ** 40, (2, 70, 2))
    tree = Combined(tokens, tokens.clone(), tokens.clone(), mask, tokens.clone(), None)
    cut = _trim(tree)
    assert cut.tokens.shape == (2, 40) and cut.tree_mask.shape == (2, 40, 1)
    assert torch.equal(cut.tree_mask, mask[:, :40, :1]) and torch.equal(cut.tokens, tokens[:, :40])
    assert _trim(Combined(tokens[:, :40], *(t[:, :40] for t in (tokens, tokens)), mask[:, :40, :1],
                          tokens[:, :40], None)).tokens.shape == (2, 40)


def test_a_user_registered_strategy_decodes_end_to_end():
    """A strategy registered with taps.register_strategy after import is usable by name: the decoder asks
    it for its drafters (prepare_drafters), it combines every step (here: the second drafter's tree only),
    and greedy output stays the target's own."""
    import engine_models as em
    import taps
    from taps.strategies import Single, strategy_names

    combined = []

    @taps.register_strategy("second-only")
    class SecondOnly(Single):
        @classmethod
        def prepare_drafters(cls, drafters, target):
            return drafters[1:]   # of two drafters, the second

        def _combine(self, cands, root):
            combined.append(cands.drafters)
            return super()._combine(cands, root)

    assert "second-only" in strategy_names() and "second-only" not in taps.STRATEGIES
    target = em.llama(64, 32, 2, seed=1)
    near, far = ModelDrafter(em.early_exit(target)), ModelDrafter(em.llama(64, 32, 1, seed=5))
    dec = SpeculativeDecoder(target, [far, near], strategy="second-only", depth=3, top_k=2, budget=6)
    assert dec.drafters == [near]
    prompts = [[3, 9, 27, 17, 5], [1, 2]]
    with torch.no_grad():
        out = dec.generate(prompts, max_new_tokens=10)
        ref = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=10)
    assert out.tokens == ref.tokens
    assert combined and all(d == (0,) for d in combined)
    with pytest.raises(ValueError, match="unknown strategy 'second-oly'"):
        SpeculativeDecoder(target, [near], strategy="second-oly")


def test_host_tallies_are_added_when_read():
    """observe_drafter queues each step's host counts; the tally read afterwards (accepted, directly or through
    requests joining and leaving) equals the tally added at once, step by step, also past the 64 steps a queue
    holds."""
    gen = torch.Generator().manual_seed(3)
    lazy, eager = make_strategy("adaptive", 3, 9), make_strategy("adaptive", 3, 9)
    for s in (lazy, eager):
        s.reset(4, torch.device("cpu"))

    def step():
        drafter = int(torch.randint(0, 3, (1,), generator=gen))
        counts = torch.randint(0, 5, (eager.accepted.shape[0],), generator=gen).tolist()
        lazy.observe_drafter(drafter, counts)
        eager.accepted[:, drafter] += torch.tensor(counts, dtype=torch.float64)

    for _ in range(70):  # (past the queue's 64)
        step()
    assert torch.equal(lazy.accepted, eager.accepted)
    for _ in range(5):
        step()
    keep = torch.tensor([3, 0, 2])
    for s in (lazy, eager):
        s.select_requests(keep)
        s.add_requests(2, torch.device("cpu"))
    for _ in range(7):
        step()
    mixed = torch.randint(0, 3, (5, 3), generator=gen)
    lazy.observe(mixed)
    eager.accepted += mixed.double()
    for _ in range(3):
        step()
    assert lazy.accepted.shape == (5, 3) and torch.equal(lazy.accepted, eager.accepted)
