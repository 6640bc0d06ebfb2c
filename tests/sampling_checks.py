"""Checks of sampled outputs shared by the op and engine suites.

- :func:`spec_probs`: the target distribution at one node, written from docs/SEMANTICS.md in numpy,
  independently of ``taps_ops.reference`` (whose ``target_probs_ref`` the tests cross-check against it),
  so that a misreading of the temperature / top-k / top-p rules made in the reference cannot also make
  the expected distributions of the chi-square tests.
- :func:`assert_counts` / :func:`assert_distribution`: chi-square tests of observed counts / integer
  samples against a distribution; outcomes of probability 0 must never appear.
- :func:`assert_matches_reference`: a verify_tree output equals the reference's under identical coins,
  except requests whose coins are within MARGIN of a decision boundary.
"""

import numpy as np
import torch
from scipy.stats import chisquare

from taps_ops.reference import verify_tree_ref

MARGIN = 1e-5  # coins closer than this to a CDF boundary may legitimately differ (float32 vs float64)


def spec_probs(row, temperature, top_k=0, top_p=1.0) -> np.ndarray:
    """p over the vocabulary ([V] float64) at a node whose logits row is `row` ([V], any float dtype).

    SEMANTICS.md, verify_tree: x = the row as float32. T = 0: one-hot on the first maximum. Else top-k
    keeps every token >= the k-th largest value (counted with multiplicity); w = exp((x - max) / T) on
    the kept tokens; top-p then keeps a token iff the kept weight *strictly above* its value is below
    P * Z (the smallest set of most likely tokens reaching P, with every token tied with the last one).
    T and P are used as the float32 values the kernels receive.
    """
    x = torch.as_tensor(row).detach().cpu().to(torch.float32).to(torch.float64).numpy()
    v = x.size
    t = float(np.float32(temperature))
    if t == 0.0:
        p = np.zeros(v)
        p[int(np.argmax(x))] = 1.0
        return p
    kept = np.ones(v, dtype=bool)
    if 0 < top_k < v:
        kth_largest = np.sort(x)[v - top_k]
        kept = x >= kth_largest
    w = np.where(kept, np.exp((x - x.max()) / t), 0.0)
    p_cut = float(np.float32(top_p))
    if p_cut < 1.0:
        desc = np.sort(x[kept])[::-1]
        mass = np.concatenate([[0.0], np.cumsum(np.sort(w[kept])[::-1])])
        first_equal = np.searchsorted(-desc, -x, side="left")  # kept tokens with a larger value come first
        kept &= mass[first_equal] < p_cut * w.sum()
        w = np.where(kept, w, 0.0)
    return w / w.sum()


def assert_counts(counts, p, min_p_value=1e-3, what="") -> None:
    """Chi-square test that `counts` ([K] observations per outcome) follow `p` ([K], summing to 1).
    Outcomes of probability 0 must have no observation; outcomes with fewer than 5 expected
    observations are pooled (into one cell, or into the largest when the pool is too small)."""
    counts = np.asarray(counts, dtype=np.float64)
    p = np.asarray(p, dtype=np.float64)
    assert counts.shape == p.shape, f"{what}{counts.shape} outcomes vs {p.shape} probabilities"
    n = counts.sum()
    assert n >= 200, f"{what}too few samples ({n:.0f}) for a chi-square test"
    impossible = counts[p == 0].sum()
    assert impossible == 0, f"{what}{impossible:.0f} samples of probability-0 outcomes"
    expected = p * n
    big = expected >= 5
    obs, exp = counts[big].tolist(), expected[big].tolist()
    small_obs, small_exp = counts[~big].sum(), expected[~big].sum()
    if small_exp >= 5 or not obs:
        obs.append(small_obs)
        exp.append(small_exp)
    elif small_exp > 0 or small_obs > 0:
        k = int(np.argmax(exp))
        obs[k] += small_obs
        exp[k] += small_exp
    if len(obs) < 2:
        return
    exp = np.array(exp) * (sum(obs) / sum(exp))  # exact normalisation against float rounding
    p_value = chisquare(np.array(obs), exp).pvalue
    assert p_value > min_p_value, \
        f"{what}chi-square p-value {p_value:.3g}: observed {obs} vs expected {exp.round(1).tolist()}"


def assert_distribution(samples, p, min_p_value=1e-3, what="") -> None:
    """Chi-square test that integer `samples` are draws from `p` ([V])."""
    samples = torch.as_tensor(samples).flatten().cpu()
    p = np.asarray(p, dtype=np.float64)
    counts = torch.bincount(samples, minlength=p.size).numpy()
    assert counts.size == p.size, f"{what}sample out of the vocabulary"
    assert_counts(counts, p, min_p_value, what)


def assert_matches_reference(out, ref_args, ref_kwargs, allow_near_boundary=True):
    """Exact equality with the reference, except requests whose coin is within MARGIN of a boundary.
    Returns the reference's num_accepted."""
    ref_tokens, ref_acc, ref_path, margin = verify_tree_ref(*ref_args, **ref_kwargs, return_margin=True)
    tokens, acc, path = (t.cpu() for t in out)
    mismatched = ((tokens != ref_tokens).any(1) | (acc != ref_acc) | (path != ref_path).any(1)).nonzero().flatten()
    for b in mismatched.tolist():
        if allow_near_boundary and margin[b] < MARGIN:
            continue
        raise AssertionError(
            f"request {b} differs from the reference (margin {margin[b]:.3g}): tokens {tokens[b].tolist()} vs "
            f"{ref_tokens[b].tolist()}, num_accepted {acc[b].item()} vs {ref_acc[b].item()}, path {path[b].tolist()} "
            f"vs {ref_path[b].tolist()}")
    return ref_acc
