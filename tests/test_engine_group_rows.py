"""Request rows of drafter groups (spawn, append_requests, select_requests), for every group kind, on tiny
random models (fp32, CPU, one thread).

A group whose requests were joined from spawned groups and selected, with caches of different capacities
and requests that arrived at different steps, drafts for each of its requests what a group started on
those requests alone and advanced with the same tokens drafts: the same candidate tokens and parents,
scores within float rounding. Groups of one drafter and of two (rows group-major) are covered, ragged
requests, an emptied group that takes requests again, and a drafter run through the interface group.
"""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_ops  # noqa: E402,F401
from taps import EagleDrafter, ModelDrafter, NgramTable, NgramTableDrafter, PromptLookupDrafter  # noqa: E402
from taps.drafters import Drafter, make_groups  # noqa: E402
from taps.drafters.eagle3 import Eagle3Drafter  # noqa: E402

import engine_models as em  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 80
PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 19, 12, 7, 64, 9, 2, 33, 41, 11], [7, 8, 9, 4, 7, 8, 5, 6, 7, 22],
           [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [40, 41, 40, 41, 40]]
DEPTH, TOP_K = 3, 3


class TableDrafter(Drafter):
    """A drafter of the public interface only (it runs through the interface group): the logits of a
    token at position p are ``table[token] + pos[p]``; it implements the interface's request rows."""

    def __init__(self, seed: int):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.table = torch.randn(VOCAB, VOCAB, generator=gen) * 3
        self.pos = torch.randn(256, VOCAB, generator=gen)
        self._last = None

    @property
    def vocab_size(self) -> int:
        return VOCAB

    def bind(self, target) -> None:
        pass

    def _set_root(self, last: torch.Tensor) -> None:
        self._last = last
        self._root_logits = self.table[last] + self.pos[self._lengths]

    def start(self, input_ids, prompt_lens, root, hidden, max_len):
        self._lengths = prompt_lens + 1
        self._set_root(root.clone())

    def advance(self, tokens, num_new, hidden):
        self._lengths = self._lengths + num_new
        self._set_root(tokens.gather(1, (num_new - 1).unsqueeze(1)).squeeze(1).clamp_min(0))

    def forward_nodes(self, tokens, parent_slot, write_pos, rope_pos, mask, level):
        return self.table[tokens] + self.pos[rope_pos + 1]

    def clone(self) -> "TableDrafter":
        return copy.deepcopy(self)

    def select_requests(self, keep):
        index = torch.tensor(keep, dtype=torch.int64)
        self._lengths, self._last = self._lengths[index], self._last[index]
        self._root_logits = self._root_logits[index]

    def append_requests(self, other):
        self._lengths = torch.cat([self._lengths, other._lengths])
        self._last = torch.cat([self._last, other._last])
        self._root_logits = torch.cat([self._root_logits, other._root_logits])
        other.release()


def _target():
    return em.llama(VOCAB, 32, 3, seed=1, head_scale=4.0)


def _eagle(target, seed):
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(seed)
    return em.randomize_(EagleDrafter(cfg), 0.2)


def _eagle3(target, seed):
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1, "draft_vocab_size": 60})
    torch.manual_seed(seed)
    head = em.randomize_(Eagle3Drafter(cfg), 0.2)
    return head.set_vocab_mapping(torch.arange(VOCAB)[torch.randperm(VOCAB)[:60].sort().values] - torch.arange(60))


def _hf_lm(seed):
    cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, hidden_act="gelu",
                                   max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).eval()


def _ngram_table():
    """An n-gram table over the prompts' contexts, random distributions at each position."""
    import numpy as np

    rng = np.random.default_rng(3)
    rows = [(np.asarray(p), rng.integers(0, VOCAB, (len(p) - 1, 6)), rng.random((len(p) - 1, 6)), 0)
            for p in PROMPTS for _ in range(3)]
    return NgramTable.from_distributions(rows, VOCAB, max_order=2, entries=5, min_count=1)


KINDS = {  # kind: (drafters for a target, the group class expected)
    "lean-lm": (lambda t: [ModelDrafter(em.llama(VOCAB, 16, 1, seed=5, head_scale=4.0))], "_LeanLMGroup"),
    "lean-lm-pair": (lambda t: [ModelDrafter(em.llama(VOCAB, 16, 1, seed=s, head_scale=4.0)) for s in (5, 6)],
                     "_LeanLMGroup"),
    "hf-lm": (lambda t: [ModelDrafter(_hf_lm(7))], "_HFLMGroup"),
    "eagle": (lambda t: [_eagle(t, 3)], "EagleGroup"),
    "eagle-pair": (lambda t: [_eagle(t, 3), _eagle(t, 4)], "EagleGroup"),
    "eagle3": (lambda t: [_eagle3(t, 2)], "_Eagle3Group"),
    "prompt-lookup": (lambda t: [PromptLookupDrafter(max_ngram=2, depth=None)], "LookupGroup"),
    "interface": (lambda t: [TableDrafter(9)], "_InterfaceGroup"),
    "ngram-table": (lambda t: [NgramTableDrafter(_ngram_table())], "TableGroup"),
}


class Request:
    """A request's data, the same whichever group serves it: prompt, root, the target features over the
    prompt, and the tokens (with their features) each verification step accepts (slices of the prompt,
    so that prompt lookup finds matches)."""

    def __init__(self, r: int, width: int):
        gen = torch.Generator().manual_seed(100 + r)
        self.prompt = PROMPTS[r]
        self.root = int(torch.randint(VOCAB, (1,), generator=gen))
        self.hidden = torch.randn(len(self.prompt), width, generator=gen) if width else None
        self.steps = []
        for _ in range(6):
            n = 1 + int(torch.randint(3, (1,), generator=gen))
            at = int(torch.randint(len(self.prompt) - n + 1, (1,), generator=gen))
            self.steps.append((self.prompt[at:at + n], torch.randn(n, width, generator=gen) if width else None))
        self.done = 0  # steps the group serving it has advanced


def _width(group, target) -> int:
    spec = group.target_features
    hidden = target.config.hidden_size
    return 0 if spec is None else hidden if spec == "final" else len(spec) * hidden


def _start(group, reqs, max_len):
    ids, lens = em.pad_prompts([q.prompt for q in reqs])
    hidden = None
    if reqs[0].hidden is not None:
        hidden = torch.zeros(len(reqs), ids.shape[1], reqs[0].hidden.shape[1])
        for b, q in enumerate(reqs):
            hidden[b, :len(q.prompt)] = q.hidden
    group.start(ids, lens, torch.tensor([q.root for q in reqs]), hidden, max_len, lens.tolist())


def _advance(group, reqs, steps):
    """One verification step, as the decoding loop commits it: request b's step steps[b] (None: nothing
    new, num_new 0)."""
    chunks = [([], None) if s is None else q.steps[s] for q, s in zip(reqs, steps)]
    width = max(len(t) for t, _ in chunks)
    tokens = torch.full((len(reqs), width), -1, dtype=torch.int64)
    feats = torch.zeros(len(reqs), width, reqs[0].hidden.shape[1]) if reqs[0].hidden is not None else None
    for b, (toks, f) in enumerate(chunks):
        tokens[b, :len(toks)] = torch.tensor(toks, dtype=torch.int64)
        if feats is not None and toks:
            feats[b, :len(toks)] = f
    num = [len(t) for t, _ in chunks]
    group.advance(tokens, torch.tensor(num), feats, num, [list(t) for t, _ in chunks])


def _tick(group, reqs):
    """Every request of the group takes its next step."""
    _advance(group, reqs, [q.done for q in reqs])
    for q in reqs:
        q.done += 1


def _reference(drafters, reqs):
    """A group of copies of the drafters started on `reqs` alone and advanced with their steps, the last
    step of every request together (a request with fewer steps commits nothing in the first ones)."""
    group, = make_groups([d.clone() for d in drafters])
    _start(group, reqs, 96)
    most = max(q.done for q in reqs)
    for t in range(most):
        _advance(group, reqs, [t - most + q.done if t >= most - q.done else None for q in reqs])
    return group


def _check(group, drafters, reqs):
    assert all(q.done >= 1 for q in reqs)  # (a request's first advance sets its root state in the reference)
    ref = _reference(drafters, reqs)
    assert group.host_lengths == ref.host_lengths and torch.equal(group.lengths, ref.lengths)
    mine, theirs = group.draft(DEPTH, TOP_K), ref.draft(DEPTH, TOP_K)
    assert torch.equal(mine.tokens, theirs.tokens)
    assert torch.equal(mine.parents, theirs.parents)
    # fp32 rounding of batches of other compositions (ragged or not), compounded over the levels
    finite = theirs.scores[theirs.scores.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 1.0
    torch.testing.assert_close(mine.scores, theirs.scores, atol=5e-5 * scale, rtol=0)
    ref.release()


@pytest.mark.parametrize("kind", list(KINDS))
@torch.no_grad()
def test_joined_and_selected_requests_draft_as_fresh_groups(kind):
    build, group_class = KINDS[kind]
    target = _target()
    drafters = build(target)
    for d in drafters:
        d.bind(target)
    a, = make_groups(drafters)
    assert type(a).__name__ == group_class and a.groups == len(drafters)
    a.sampling = True
    reqs = [Request(r, _width(a, target)) for r in range(len(PROMPTS))]

    # A on two ragged prompts, B (spawned) on a third with a smaller cache; both advance, B joins A
    b = a.spawn()
    assert b.members == a.members and b.sampling and b.batch == 0
    live, new = [reqs[0], reqs[1]], [reqs[2]]
    _start(a, live, 96)
    _start(b, new, 64)
    for _ in range(2):
        _tick(a, live)
        _tick(b, new)
    a.append_requests(b)
    assert b.lengths_b is None  # released
    live += new
    a.select_requests([0, 2])
    live = [live[0], live[2]]
    _check(a, drafters, live)
    _tick(a, live)  # the joined caches take new entries
    _check(a, drafters, live)

    # emptied, then requests again
    a.select_requests([])
    assert a.batch == 0 and a.lengths.numel() == 0
    c = a.spawn()
    live = [reqs[3]]
    _start(c, live, 96)
    _tick(c, live)
    a.append_requests(c)
    _check(a, drafters, live)

    # a request arriving later, with a larger cache, joined, then the order changed and one dropped
    d = a.spawn()
    new = [reqs[4]]
    _start(d, new, 128)
    _tick(a, live)
    _tick(d, new)
    a.append_requests(d)
    live += new
    a.select_requests([1, 0])
    live = live[::-1]
    _check(a, drafters, live)
    _tick(a, live)
    _check(a, drafters, live)
    a.select_requests([1])
    live = [live[1]]
    _tick(a, live)
    _check(a, drafters, live)
    a.release()


def test_request_row_errors():
    target = _target()
    drafters = [_eagle(target, 3)]
    for d in drafters:
        d.bind(target)
    a, = make_groups(drafters)
    twin = _eagle(target, 3)
    twin.bind(target)
    other, = make_groups([twin])
    reqs = [Request(r, target.config.hidden_size) for r in range(2)]
    _start(a, reqs, 64)
    _start(other, reqs, 64)
    with pytest.raises(ValueError, match="distinct requests in \\[0, 2\\)"):
        a.select_requests([2])
    with pytest.raises(ValueError, match="distinct"):
        a.select_requests([0, 0])
    with pytest.raises(ValueError, match="spawn"):
        a.append_requests(other)  # other drafters
    with pytest.raises(ValueError, match="spawn"):
        a.append_requests(a)
    with pytest.raises(RuntimeError, match="start"):
        a.append_requests(a.spawn())
