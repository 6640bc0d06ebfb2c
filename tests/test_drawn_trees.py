"""The parts of drawn trees (taps.expansion.DraftSampler, expand_sampled; taps.strategies.sampled_tree).

The end-to-end losslessness of drawn trees is tested in test_engine_sampling.py (chi-square against the
target's exact distribution); here: the distribution a drafter's children are drawn from is the target's
sampling rule applied to the drafter's logits, the draws follow it, a row's draws come from its own generator,
and the tree keeps every draw in the order drawn.
"""

import numpy as np
import pytest
import torch

from sampling_checks import assert_distribution, spec_probs
from taps.expansion import DraftCandidates, DraftSampler, expand_sampled, target_probs
from taps.strategies import Candidates, sampled_tree

import taps_ops


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 7, 0.9)])
def test_q_is_the_sampling_rule_on_the_drafters_logits(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(3, 2, 40, generator=gen) * 3
    q = DraftSampler(temperature, top_k, top_p).dist(logits)
    for r in range(3):
        for f in range(2):
            np.testing.assert_allclose(q[r, f].double().numpy(), spec_probs(logits[r, f], temperature, top_k, top_p),
                                       atol=2e-6)


def test_per_row_settings():
    logits = torch.randn(2, 1, 30, generator=torch.Generator().manual_seed(2)) * 2
    q = DraftSampler(torch.tensor([0.6, 1.4]), torch.tensor([4, 0]), torch.tensor([1.0, 0.7])).dist(logits)
    np.testing.assert_allclose(q[0, 0].double().numpy(), spec_probs(logits[0, 0], 0.6, 4, 1.0), atol=2e-6)
    np.testing.assert_allclose(q[1, 0].double().numpy(), spec_probs(logits[1, 0], 1.4, 0, 0.7), atol=2e-6)


def test_draws_follow_q(device):
    logits = torch.randn(1, 1, 12, generator=torch.Generator().manual_seed(3)).to(device)
    sampler = DraftSampler(1.0, generator=torch.Generator(device=device).manual_seed(4))
    q = sampler.dist(logits)
    draws = sampler.draw(q.expand(1, 1, 12).contiguous(), 20000)
    assert draws.shape == (1, 1, 20000) and draws.device.type == device
    assert_distribution(draws.flatten().cpu().numpy(), q[0, 0].double().cpu().numpy())


def test_a_rows_draws_come_from_its_own_generator(device):
    q = torch.softmax(torch.randn(2, 3, 50, generator=torch.Generator().manual_seed(5)), -1).to(device)

    def draws(seed0, seed1):
        gens = [torch.Generator(device=device).manual_seed(seed0), torch.Generator(device=device).manual_seed(seed1)]
        return DraftSampler(torch.tensor([1.0, 0.8], device=device), generators=gens).draw(q, 4)

    a, b = draws(10, 11), draws(12, 11)
    assert torch.equal(a[1], b[1]) and not torch.equal(a[0], b[0])


class _Oracle:
    """A drafting unit for depth-1 expansions: fixed root logits and a token map."""

    def __init__(self, logits, token_map=None):
        self.root_logits, self.token_map = logits, token_map


def test_a_depth_one_draw_keeps_every_draw_in_order_with_its_row():
    logits = torch.randn(2, 6, generator=torch.Generator().manual_seed(6))
    token_map = torch.tensor([40, 3, 17, 8, 22, 9])
    sampler = DraftSampler(1.0, generator=torch.Generator().manual_seed(7))
    draft = expand_sampled(_Oracle(logits, token_map), 1, 5, sampler)
    c = draft.candidates
    assert c.tokens.shape == (2, 5) and bool((c.parents == -1).all())
    ids = [[token_map.tolist().index(t) for t in row] for row in c.tokens.tolist()]  # back to draft ids
    q = torch.softmax(logits, -1)
    np.testing.assert_allclose(draft.probs[:, 0].numpy(), q.numpy(), atol=1e-6)          # the root's row
    assert bool((draft.probs[:, 1:] == 0).all())                                           # leaves draw nothing
    np.testing.assert_allclose(c.scores.numpy(), np.log(q.gather(1, torch.tensor(ids)).numpy()), atol=1e-5)
    full = target_probs(draft.probs, token_map, 50)
    assert full.shape == (2, 6, 50)
    np.testing.assert_allclose(full[:, 0, token_map].numpy(), q.numpy(), atol=1e-6)
    assert float(full[:, 0].sum(-1).sub(1).abs().max()) < 1e-5


def test_the_tree_keeps_every_draw_in_draw_order():
    """Candidates level by level (two chains of two, a duplicate pair at the root): node 1 + m is
    candidate m, whatever the scores say; parents and depths follow."""
    tokens = torch.tensor([[5, 5, 7, 2]])
    parents = torch.tensor([[-1, -1, 0, 1]])
    scores = torch.tensor([[-3.0, -0.5, -0.1, -4.0]])  # not in draw order: the tree must not sort by them
    cands = Candidates(scores.unsqueeze(0), tokens.unsqueeze(0), parents.unsqueeze(0), torch.zeros(1, 1), (2,))
    tree = sampled_tree(cands, torch.tensor([11]))
    assert tree.tokens.tolist() == [[11, 5, 5, 7, 2]]
    assert tree.parents.tolist() == [[-1, 0, 0, 1, 2]]
    assert tree.depth.tolist() == [[0, 1, 1, 2, 2]]
    assert tree.source.tolist() == [[0, 4, 4, 4, 4]]  # drafter 2's bit
    both = sampled_tree(cands._replace(drafters=(0, 3)), torch.tensor([11]))  # drawn from two heads' mean
    assert both.source.tolist() == [[0, 9, 9, 9, 9]]
    with pytest.raises(ValueError, match="one slab"):
        sampled_tree(Candidates(*(f.expand(2, *f.shape[1:]) for f in cands[:4]), (0, 1)), torch.tensor([11]))


def test_a_draw_from_the_targets_own_distribution_is_accepted(device):
    """Chains drawn from q = the target's p at the root: recursive rejection sampling (``verify_tree`` with
    ``draft_probs``) accepts the first draw (min(1, p / q) = 1), and the walk then continues at its node."""
    gen = torch.Generator().manual_seed(8)
    batch, vocab, width = 4, 60, 3
    logits = (torch.randn(batch, vocab, generator=gen) * 2).to(device)
    draft = expand_sampled(_Oracle(logits), 1, width, DraftSampler(0.9, generator=torch.Generator(device=device)
                                                                   .manual_seed(9)))
    tree = sampled_tree(Candidates(*(f.unsqueeze(0) for f in draft.candidates), (0,)),
                        torch.zeros(batch, dtype=torch.int64, device=device))
    rows = torch.randn(batch, 1 + width, vocab, generator=gen).to(device)
    rows[:, 0] = logits                                               # the target's row at the root is q's
    out = taps_ops.verify_tree(rows, tree.tokens, tree.parents, temperature=0.9, draft_probs=draft.probs,
                               generator=torch.Generator(device=device).manual_seed(10))
    assert out.num_accepted.tolist() == [1] * batch
    assert out.tokens[:, 0].tolist() == tree.tokens[:, 1].tolist()   # the first draw, whatever it is


def test_draws_never_take_a_token_of_zero_mass(monkeypatch):
    """Inverse-CDF draws: tokens of zero mass (between, before and after the others) are never drawn, also when
    the uniform is the largest float below 1 (its product with the row's total may round up to the total)."""
    q = torch.zeros(3, 1, 9)
    q[0, 0, [1, 4]] = torch.tensor([0.25, 0.75])
    q[1, 0, 0] = 1.0
    q[2, 0, [2, 3, 5]] = torch.tensor([1 / 3, 1 / 3, 1 / 3])
    sampler = DraftSampler(1.0, generator=torch.Generator().manual_seed(9))
    draws = sampler.draw(q, 5000)
    for r in range(3):
        assert set(draws[r].flatten().tolist()) == set(torch.nonzero(q[r, 0]).flatten().tolist())
    top = 1.0 - 2.0 ** -24
    monkeypatch.setattr(torch, "rand", lambda *a, **k: torch.full(a[0], top))
    edge = sampler.draw(q, 3)
    assert edge[:, 0, 0].tolist() == [4, 0, 5], "the largest uniform takes the last token of positive mass"


@pytest.mark.parametrize("batch,width,depth", [(1, 1, 1), (1, 1, 3), (3, 2, 3), (2, 3, 1), (5, 1, 7), (2, 4, 17)])
def test_the_drawn_layout_equals_build_tree(batch, width, depth):
    """sampled_tree(..., depth): the roots and candidates on the drawn layout's shared fields equal the tree
    ``build_tree`` makes of the same candidates (every field), for odd batches, widths and depths (a mask past
    one 64-bit word included); the shared fields are not written by a later call."""
    gen = torch.Generator().manual_seed(batch * 100 + width * 10 + depth)
    m = width * depth
    index = torch.arange(m)
    parents = torch.where(index < width, -1, index - width).expand(batch, m).clone()
    for drafters in ((0,), (1, 3)):
        tokens = torch.randint(0, 50, (1, batch, m), generator=gen)
        scores = -torch.rand((1, batch, m), generator=gen).cumsum(-1)
        cands = Candidates(scores, tokens, parents.unsqueeze(0), torch.zeros(1, batch), drafters)
        root = torch.randint(0, 50, (batch,), generator=gen)
        built, laid = sampled_tree(cands, root), sampled_tree(cands, root, depth)
        for field in ("tokens", "parents", "depth", "tree_mask", "source"):
            assert torch.equal(getattr(laid, field), getattr(built, field)), field
        again = sampled_tree(cands._replace(tokens=tokens + 1), root + 1, depth)
        assert torch.equal(again.tokens, torch.cat([(root + 1).view(batch, 1), tokens[0] + 1], 1))
        assert torch.equal(laid.tree_mask, built.tree_mask) and again.tree_mask is laid.tree_mask
    odd = Candidates(torch.zeros(1, 1, 3), torch.ones(1, 1, 3, dtype=torch.int64),
                     torch.tensor([[[-1, 0, 1]]]), torch.zeros(1, 1), (0,))
    with pytest.raises(ValueError, match="3 candidates are not 2 levels"):
        sampled_tree(odd, torch.tensor([4]), 2)
