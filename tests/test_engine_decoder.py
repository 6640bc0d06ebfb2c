"""The speculative decoding loop (taps.SpeculativeDecoder) on tiny random Llama models, fp32 on CPU:
greedy decoding and the API. Sampling is in test_engine_sampling.py.

1. Greedy: every strategy reproduces the target's own greedy generation (a plain Hugging Face forward
   per token) token for token, batch 1 and a ragged batch of 3, on the lean and the Hugging Face target
   paths, with drafters that agree with the target (engine_models: trained EAGLE heads, their
   checkpoint average, the target's first layer, the target itself), and reaches a minimum acceptance
   length, so that acceptance is exercised, not only bonus tokens.
2. A reduced draft vocabulary: the trees hold target ids from that vocabulary only, output unchanged.
3. A drafter that is the target accepts whole chains; EOS, max_new_tokens (0 included), streaming; text
   in and out through a tokenizer; ModelDrafter.from_pretrained; the autoregressive baseline.
"""

import pytest
import torch
import transformers

import taps_ops  # noqa: F401
from taps import ModelDrafter, SpeculativeDecoder, STRATEGIES

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 90, 2, 33, 41, 11], [70, 1]]
NEW = 14
_REF = {}


def _models():
    return em.greedy_models()


def _reference(i, steps=NEW):
    if (i, steps) not in _REF:
        _REF[(i, steps)] = em.greedy_reference(_models()["target"], PROMPTS[i], steps)
    return _REF[(i, steps)]


def _drafters(strategy):
    m = _models()
    if strategy == "autoregressive":
        return []
    if strategy == "single":
        return [m["eagle"]]
    if strategy == "average":
        return [m["eagle"], m["eagle2"]]
    # three kinds: the target's first layer as an LM, a trained EAGLE head, an unrelated small LM
    return [ModelDrafter(m["early_exit"]), m["eagle"], ModelDrafter(m["other"])]


GREEDY_CASES = [(s, b, None) for s in STRATEGIES for b in (1, 3)] + [(s, 3, False) for s in ("single", "average", "merged")]


@pytest.mark.parametrize("strategy,batch,lean", GREEDY_CASES)
def test_greedy_equals_target(strategy, batch, lean):
    m = _models()
    dec = SpeculativeDecoder(m["target"], _drafters(strategy), strategy=strategy, depth=3, top_k=3, budget=8,
                             route_steps=2, lean=lean)
    assert dec.forward.use_lean == (lean is not False)
    prompts = PROMPTS[:1] if batch == 1 else PROMPTS
    out = dec.generate(prompts, max_new_tokens=NEW)
    for b in range(len(prompts)):
        assert out.tokens[b] == _reference(b), f"{strategy}: request {b}"
        assert out.stats[b].new_tokens == NEW
        assert len(out.stats[b].tree_nodes) == out.stats[b].target_forwards
    if strategy == "autoregressive":
        assert out.summary["tau"] == 1.0 and out.steps == NEW - 1
        return
    # every strategy gets drafts accepted (1.4 to 2.3 here; unrelated drafters give 1.0 to 1.1)
    assert out.summary["tau"] > 1.3, f"{strategy}: tau {out.summary['tau']:.2f}"
    assert sum(sum(s.drafter_accepted) for s in out.stats) > 0
    if len(dec.drafters) == 1:  # every accepted draft token is the one drafter's (counted from the path)
        assert all(s.drafter_accepted == [sum(s.accepted)] for s in out.stats), strategy
    else:  # a node several drafters proposed counts for each
        assert all(sum(s.drafter_accepted) >= sum(s.accepted) for s in out.stats), strategy
    cap = len(dec.drafters) * (dec.budget - 1) + 1 if strategy == "merged" else dec.budget
    assert all(1 < n <= cap for s in out.stats for n in s.tree_nodes), strategy
    if strategy.startswith("route"):
        assert all(len(s.route_decisions) == s.target_forwards for s in out.stats)


def test_small_model_drafter_greedy():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["early_exit"])], strategy="single", depth=4, top_k=2)
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [_reference(i) for i in range(3)]
    assert out.summary["tau"] > 1.3


@pytest.mark.parametrize("lean", [None, False])
def test_reduced_draft_vocab_greedy(lean):
    """Drafters restricted to the 40 most frequent tokens of the target's greedy outputs (in a shuffled
    order): every tree node is a target id of that vocabulary, the output is the target's, and drafts
    are still accepted."""
    m = _models()
    vocab = em.frequent_tokens(m["seqs"], 40)
    eagle, lm = m["eagle"].clone(), ModelDrafter(m["early_exit"])
    eagle.set_draft_vocab(vocab)
    lm.set_draft_vocab(vocab.flip(0))
    dec = SpeculativeDecoder(m["target"], [eagle, lm], strategy="merged", depth=3, top_k=3, budget=8, lean=lean)
    trees = []
    combine = dec.strategy.combine

    def record(cands, root):
        tree = combine(cands, root)
        trees.append(tree.tokens[:, 1:].clone())
        return tree

    dec.strategy.combine = record
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [_reference(i) for i in range(3)]
    assert out.summary["tau"] > 1.3
    nodes = torch.cat([t.flatten() for t in trees])
    nodes = nodes[nodes >= 0]
    assert nodes.numel() > 0 and torch.isin(nodes, vocab).all(), "a tree node outside the draft vocabulary"


def test_copy_of_target_accepts_whole_chains():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=4, top_k=1)
    out = dec.generate(PROMPTS, max_new_tokens=21)
    assert out.tokens == [_reference(i, 21) for i in range(3)]
    assert out.summary["tau"] == pytest.approx(5.0)
    assert out.summary["acceptance_rate_per_depth"] == [1.0] * 4
    assert out.summary["drafter_share"] == [1.0]


@pytest.mark.parametrize("eos_kind", ["int", "set"])
def test_eos_max_new_and_stream(eos_kind):
    m = _models()
    ref = _reference(1)
    eos = ref[5]
    stop = ref.index(eos)
    eos_arg = eos if eos_kind == "int" else {eos, 95}
    streamed = {}
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["early_exit"]), m["eagle"]], strategy="merged",
                             depth=3, top_k=2)
    out = dec.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=eos_arg,
                       stream=lambda b, toks: streamed.setdefault(b, []).extend(toks))
    assert out.tokens[1] == ref[:stop + 1]
    assert out.stats[1].finish_reason == "eos"
    for b in (0, 2):
        r = _reference(b)
        expected = r[:r.index(eos) + 1] if eos in r else r
        assert out.tokens[b] == expected
        assert out.stats[b].finish_reason == ("eos" if eos in r else "length")
    assert streamed == {b: out.tokens[b] for b in range(3)}
    short = dec.generate(PROMPTS[0], max_new_tokens=3)
    assert short.tokens == [_reference(0)[:3]] and short.stats[0].finish_reason == "length"


def test_max_new_tokens_zero():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=2)
    out = dec.generate(PROMPTS, max_new_tokens=0)
    assert out.tokens == [[], [], []] and out.steps == 0 and out.text is None
    assert all(s.new_tokens == 0 and s.finish_reason == "length" and s.target_forwards == 0 for s in out.stats)
    assert dec.generate(PROMPTS, max_new_tokens=2).tokens == [_reference(i)[:2] for i in range(3)]  # still usable
    with pytest.raises(ValueError, match="max_new_tokens"):
        dec.generate(PROMPTS, max_new_tokens=-1)


def test_tensor_input_and_profile():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=2)
    out = dec.generate(torch.tensor(PROMPTS[0]), max_new_tokens=6, profile=True)
    assert out.tokens == [_reference(0)[:6]]
    for phase in ("draft", "draft_forward", "target_forward", "verify", "compact", "draft_update"):
        assert phase in out.profile


# ---------------------------------------------------------------------------------------------------
# text through a tokenizer; ModelDrafter.from_pretrained
# ---------------------------------------------------------------------------------------------------

def _word_tokenizer(vocab, shift=0):
    """A whitespace tokenizer over the words w0 .. w{vocab-1} (word i has id (i + shift) % vocab)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"w{i}": (i + shift) % vocab for i in range(vocab)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0")


def test_text_in_and_out():
    m = _models()
    tok = _word_tokenizer(96)
    dec = SpeculativeDecoder(m["target"], [m["eagle"]], strategy="single", depth=3, top_k=3, tokenizer=tok)
    prompts = [" ".join(f"w{t}" for t in p) for p in PROMPTS[:2]]
    out = dec.generate(prompts, max_new_tokens=NEW)
    assert out.tokens == [_reference(0), _reference(1)]
    assert out.text == [tok.decode(_reference(0)), tok.decode(_reference(1))]
    assert out.text[0].split() == [f"w{t}" for t in _reference(0)]
    single = dec.generate(prompts[1], max_new_tokens=4)  # one string
    assert single.tokens == [_reference(1)[:4]] and single.text == [tok.decode(_reference(1)[:4])]
    assert dec.generate(prompts, max_new_tokens=0).text == ["", ""]


def test_model_drafter_from_pretrained(tmp_path):
    m = _models()
    tok = _word_tokenizer(96)
    m["early_exit"].save_pretrained(tmp_path / "drafter")
    tok.save_pretrained(tmp_path / "drafter")
    drafter = ModelDrafter.from_pretrained(str(tmp_path / "drafter"), tokenizer=True)
    assert drafter.tokenizer is not None and drafter.tokenizer.get_vocab() == tok.get_vocab()
    for name, value in m["early_exit"].state_dict().items():
        assert torch.equal(drafter.model.state_dict()[name], value), name
    dec = SpeculativeDecoder(m["target"], [drafter], strategy="single", depth=3, top_k=3, tokenizer=tok)
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [_reference(i) for i in range(3)] and out.summary["tau"] > 1.3
    # the drafter's saved tokenizer is checked against the target's
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeDecoder(m["target"], [drafter], strategy="single", tokenizer=_word_tokenizer(96, shift=1))
    # kwargs reach from_pretrained (here the dtype)
    half = ModelDrafter.from_pretrained(str(tmp_path / "drafter"), dtype=torch.bfloat16)
    assert half.tokenizer is None and next(half.model.parameters()).dtype == torch.bfloat16


@pytest.mark.parametrize("kind", ["lookup", "merged", "lookup-auto"])
def test_packed_batches_decode_what_padded_ones_do(kind, monkeypatch):
    """A ragged batch's tree forward over each request's real nodes only (SpeculativeDecoder.pack_trees, on
    by default) decodes the target's greedy tokens, as the padded forward does; it runs packed on the steps
    whose trees differ enough in size (counted), never with pack_trees off."""
    from taps import PromptLookupDrafter
    from taps.forward import TargetForward

    m = _models()
    packed = []
    tree = TargetForward.tree

    def counting(self, *args, **kwargs):
        out = tree(self, *args, **kwargs)
        packed.append(out.packed is not None)
        return out
    monkeypatch.setattr(TargetForward, "tree", counting)
    if kind.startswith("lookup"):
        drafters, strategy = [PromptLookupDrafter(max_ngram=2, min_ngram=1)], "single"
    else:
        drafters, strategy = [m["eagle"], PromptLookupDrafter(max_ngram=2, min_ngram=1)], "merged"
    budget = "auto" if kind.endswith("auto") else 8
    prompts = PROMPTS + [PROMPTS[1][::-1]]
    for pack in (True, False):
        dec = SpeculativeDecoder(m["target"], drafters, strategy=strategy, depth=3, top_k=3, budget=budget)
        dec.pack_trees = pack
        packed.clear()
        out = dec.generate(prompts, max_new_tokens=NEW)
        for b in range(len(prompts)):
            ref = _reference(b) if b < len(PROMPTS) else em.greedy_reference(m["target"], prompts[b], NEW)
            assert out.tokens[b] == ref, f"{kind}, pack_trees={pack}: request {b}"
        if pack and not kind.endswith("auto"):
            assert any(packed), kind
        if not pack:
            assert not any(packed)


@pytest.mark.parametrize("kind", ["eagle", "lookup"])
def test_finished_requests_draft_nothing(kind, monkeypatch):
    """A request that finished (EOS) while the others go on stays a row of the batch (while the finished ones are
    fewer than 1 / DROP_SHARE of its rows; here with drops off), but proposes nothing: its tree is its root on every
    later step (the target's forward computes no node of it), and every request's output is the target's greedy
    output with that EOS. With drops on, the finished request leaves the batch: the later steps run fewer rows, and
    the outputs are the same."""
    from taps import PromptLookupDrafter
    import taps.decoder as decoder_module

    m = _models()
    prompts = PROMPTS + [PROMPTS[1][::-1]]
    auto = SpeculativeDecoder(m["target"], [], strategy="autoregressive")
    first = auto.generate(prompts, max_new_tokens=NEW).tokens
    # an EOS that ends request 0 early and some other request late
    eos = next(t for i, t in enumerate(first[0]) if 2 <= i and t not in first[0][:i]
               and any(t not in other[:NEW - 2] for other in first[1:]))
    ref = auto.generate(prompts, max_new_tokens=NEW, eos_token_id=eos).tokens
    assert len(ref[0]) < NEW - 3 and max(len(t) for t in ref) > len(ref[0]) + 2
    trees = []
    verify = SpeculativeDecoder._verify

    def spy(self, state, tree, nodes=None):
        trees.append(([r.done for r in state.requests], (tree.tokens >= 0).sum(1).tolist()))
        return verify(self, state, tree, nodes)
    monkeypatch.setattr(SpeculativeDecoder, "_verify", spy)
    drafter = m["eagle"] if kind == "eagle" else PromptLookupDrafter(max_ngram=2, min_ngram=1)
    dec = SpeculativeDecoder(m["target"], [drafter], strategy="single", depth=3, top_k=3, budget=8)
    monkeypatch.setattr(decoder_module, "DROP_SHARE", None)
    out = dec.generate(prompts, max_new_tokens=NEW, eos_token_id=eos)
    assert out.tokens == ref
    late = [(done, nodes) for done, nodes in trees if any(done)]
    assert late and any(max(nodes) > 1 for _, nodes in late)  # the others still drafted
    for done, nodes in late:
        assert all(n == 1 for d, n in zip(done, nodes) if d), (done, nodes)
    monkeypatch.setattr(decoder_module, "DROP_SHARE", len(prompts))
    trees.clear()
    out = dec.generate(prompts, max_new_tokens=NEW, eos_token_id=eos)
    assert out.tokens == ref
    rows = [len(done) for done, _ in trees]
    assert rows[0] == len(prompts) and min(rows) < len(prompts) and rows == sorted(rows, reverse=True), rows
