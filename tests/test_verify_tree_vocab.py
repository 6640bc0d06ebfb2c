"""verify_tree at real vocabulary sizes.

The CPU kernel draws the token past the children by skipping whole 2,048-token blocks by their weight
sums (child tokens' weights taken out), then scanning one block; the CUDA kernel splits rows into
chunks. These tests put the probability mass where such code goes wrong: on tokens on both sides of
block edges, at the start of the last (partial) block and at the very end of the vocabulary, with
child tokens on edges too, at V = 5,000, 6,144, 32,000, 32,768 and 128,256 (multiples of 2,048 and
not).

- every mode (greedy, temperature, top-k with a tie across a block edge, top-p, draft_probs) equals
  the reference under identical coins;
- the emitted token's distribution (chi-square) equals the target distribution written from the spec
  (sampling_checks.spec_probs), at the root and after an accepted child.
"""

import zlib

import pytest
import torch

from conftest import verify_on as _verify
from sampling_checks import assert_distribution, assert_matches_reference, spec_probs

BLOCK = 2048
VOCABS = [5000, 6144, 32000, 32768, 128256]


def hot_tokens(v):
    """Tokens on both sides of the first block edges, around the start of the last block, in the middle
    and at the end of the vocabulary."""
    edge = last_block(v)
    return sorted({0, BLOCK - 1, BLOCK, 2 * BLOCK - 1, 2 * BLOCK, edge - 1, edge, v // 2 + 1, v - 2, v - 1})


def last_block(v):
    """First token of the last block."""
    return (v - 1) // BLOCK * BLOCK


def tree(v):
    """Root children: the start of the last block, the last token, a middle token; node 1's children:
    the token before the last block and the second last token. N = 6."""
    tokens = [0, last_block(v), v - 1, v // 2 + 1, last_block(v) - 1, v - 2]
    parents = [-1, 0, 0, 0, 1, 1]
    return tokens, parents


TIE = [BLOCK - 1, BLOCK]  # either side of the first edge


def hot_row(v, gen, tie=False, boost=(), boost_by=1.0):
    """A logits row: small noise everywhere (about a tenth of the mass), the hot tokens each about as
    likely as the whole background, the `boost` tokens exp(boost_by) times more. With `tie`, the TIE tokens get
    exactly the same logit, between the 3rd and 4th largest of the other hot tokens (so the 4th
    largest value of the row is the tie)."""
    row = torch.randn(v, generator=gen) * 0.5
    hot = torch.tensor(hot_tokens(v))
    row[hot] = torch.log(torch.tensor(float(v))) + torch.randn(len(hot), generator=gen) * 0.7
    row[list(boost)] += boost_by
    if tie:
        others = row[[t for t in hot.tolist() if t not in TIE]].sort(descending=True).values
        row[TIE] = (others[2] + others[3]) / 2
    return row


def draft_rows(v, rows, gen):
    """Proposal distributions [rows, v] concentrated on the hot tokens."""
    q = torch.full((rows, v), 0.05 / v)
    hot = torch.tensor(hot_tokens(v))
    q[:, hot] += torch.softmax(torch.randn(rows, len(hot), generator=gen), -1) * 0.95
    return q / q.sum(-1, keepdim=True)


MODES = {
    "greedy": dict(temperature=0.0),
    "temperature": dict(temperature=0.8),
    "top_k": dict(temperature=1.0, top_k=4),  # the 4th largest value is the tie across the first edge
    "top_p": dict(temperature=0.9, top_p=0.7),  # the cut falls among the hot tokens, not in the noise
    "draft_probs": dict(temperature=0.9, top_p=0.95),
}


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("v", VOCABS)
def test_large_vocab_vs_reference(device, v, mode):
    gen = torch.Generator().manual_seed(zlib.crc32(f"{v} {mode}".encode()))
    batch = 8 if v < 100000 else 3
    tokens, parents = tree(v)
    n = len(tokens)
    # each node's children are likely at it, so that walks go deep
    kids = [[tokens[j] for j in range(1, n) if parents[j] == i] for i in range(n)]
    logits = torch.stack([torch.stack([hot_row(v, gen, mode == "top_k", kids[i]) for i in range(n)])
                          for _ in range(batch)])
    tokens = torch.tensor(tokens).expand(batch, n).contiguous()
    parents = torch.tensor(parents).expand(batch, n).contiguous()
    uniforms = torch.rand(batch, n, generator=gen)
    uniforms[0, 0], uniforms[1, 0] = 0.9995, 0.995  # draws at the far end of the order
    params = dict(MODES[mode])
    if mode == "draft_probs":
        params["draft_probs"] = draft_rows(v, batch * n, gen).view(batch, n, v)
    dtype = torch.bfloat16 if v == 32000 else torch.float32  # bf16: ties everywhere in the background
    logits = logits.to(dtype)
    out = _verify(device, logits, tokens, parents, uniforms=uniforms, **params)
    assert_matches_reference(out, (logits, tokens, parents), dict(uniforms=uniforms, **params))


def _draw_copies(device, v, copies, root, child, child_token, params, gen, sampled_children):
    """Verify `copies` copies of a 3-node tree (root with children; the first child's row is `child`),
    in chunks of about 256 MB of logits. Returns the outputs' tokens [copies, 3] and paths."""
    n = 3
    chunk = max(1, (64 << 20) // (n * v))
    toks, paths = [], []
    for start in range(0, copies, chunk):
        m = min(chunk, copies - start)
        logits = torch.empty(m, n, v)
        logits[:, 0] = root
        logits[:, 1] = child
        logits[:, 2] = root
        parents = torch.tensor([[-1, 0, 0]]).expand(m, n).contiguous()
        kw = dict(params)
        if sampled_children:
            q = kw.pop("q")
            tokens = torch.zeros(m, n, dtype=torch.int64)
            tokens[:, 1:] = torch.multinomial(q, 2 * m, replacement=True, generator=gen).view(m, 2)
            kw["draft_probs"] = q.expand(m, n, v).contiguous()
            logits[:, 1] = child  # the child row depends on nothing in this test: one row for both children
            logits[:, 2] = child
        else:
            tokens = torch.tensor([[0, child_token, v - 1]]).expand(m, n).contiguous()
        out = _verify(device, logits, tokens, parents, uniforms=torch.rand(m, n, generator=gen), **kw)
        toks.append(out.tokens.cpu())
        paths.append(out.path.cpu())
    return torch.cat(toks), torch.cat(paths)


@pytest.mark.parametrize("v,mode", [
    (5000, "temperature"), (5000, "top_k"), (5000, "top_p"), (5000, "draft_probs"),
    (32000, "top_p"), (32000, "draft_probs"), (128256, "temperature"), (128256, "top_k"),
])
def test_large_vocab_chi_square(device, v, mode):
    gen = torch.Generator().manual_seed(zlib.crc32(f"chi {v} {mode}".encode()))
    copies = 2000
    # the first child (the first token of the last block) takes about 40% of the mass
    root = hot_row(v, gen, mode == "top_k", boost=[last_block(v)], boost_by=2.0)
    child = hot_row(v, gen, mode == "top_k")
    params = dict(MODES[mode])
    sampled = mode == "draft_probs"
    if sampled:
        params["q"] = draft_rows(v, 1, gen)[0]
    t, k, p = params["temperature"], params.get("top_k", 0), params.get("top_p", 1.0)
    toks, paths = _draw_copies(device, v, copies, root, child, last_block(v), params, gen, sampled)
    first = toks[:, 0]
    assert_distribution(first, spec_probs(root, t, k, p), what="first token: ")
    # After an accepted child the next token is drawn from the child's row.
    accepted = paths[:, 1] >= 1
    if not sampled:
        accepted = paths[:, 1] == 1
        assert (first[accepted] == last_block(v)).all()
    assert accepted.sum() >= 250
    assert_distribution(toks[:, 1][accepted], spec_probs(child, t, k, p), what="after the child: ")
    # the mass at the far end of the vocabulary is reached
    far = spec_probs(root, t, k, p)[-2:].sum()
    if far > 0.02:
        assert ((first == v - 1) | (first == v - 2)).any()
