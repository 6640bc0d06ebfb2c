"""The speculative decoding loop (taps.SpeculativeDecoder) on tiny random Llama models, fp32 on CPU.

1. Greedy: every strategy reproduces the target's own greedy generation token for token (batch 1 and a
   ragged batch of 3), with EAGLE heads, independent small LMs and a copy of the target as drafters.
2. Sampling: with temperature 1 and with top-p 0.9 the first three tokens of `merged` decoding with two
   drafters follow the target's own distribution (chi-square against the exact joint distribution).
3. A drafter that is the target accepts whole chains; EOS, max_new_tokens, streaming; the
   autoregressive baseline.
"""

import pytest
import torch

transformers = pytest.importorskip("transformers")

import taps_ops  # noqa: E402,F401
from taps import EagleDrafter, ModelDrafter, SpeculativeDecoder, STRATEGIES  # noqa: E402

VOCAB = 96


def _llama(hidden=32, layers=2, vocab=VOCAB, seed=0, head_scale=1.0):
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=512, initializer_range=0.1,
                                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    if head_scale != 1.0:
        with torch.no_grad():
            model.lm_head.weight.mul_(head_scale)
    return model


def _eagle(target, seed):
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    torch.manual_seed(seed)
    return EagleDrafter(cfg)


_STATE = {}


def _models():
    if not _STATE:
        # A peaky target (scaled head) so that drafters agree with it sometimes.
        target = _llama(seed=1, head_scale=4.0)
        _STATE.update(target=target, small=_llama(hidden=16, layers=1, seed=2), small2=_llama(hidden=16, layers=1, seed=3))
    return _STATE


@torch.no_grad()
def _greedy_reference(model, prompt, steps):
    seq = list(prompt)
    for _ in range(steps):
        seq.append(int(model(input_ids=torch.tensor([seq])).logits[0, -1].argmax()))
    return seq[len(prompt):]


PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 90, 2, 33, 41, 11], [70, 1]]
NEW = 14
_REF = {}


def _reference(i):
    if i not in _REF:
        _REF[i] = _greedy_reference(_models()["target"], PROMPTS[i], NEW)
    return _REF[i]


def _drafters(strategy):
    m = _models()
    target = m["target"]
    if strategy == "autoregressive":
        return []
    if strategy == "single":
        return [_eagle(target, 5)]
    if strategy == "average":
        return [_eagle(target, 5), _eagle(target, 6)]
    # two or three different kinds: a copy of the target (long acceptance), a small LM, an EAGLE head
    return [ModelDrafter(m["small"]), ModelDrafter(target), _eagle(target, 7)]


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize("batch", [1, 3])
def test_greedy_equals_target(strategy, batch):
    m = _models()
    dec = SpeculativeDecoder(m["target"], _drafters(strategy), strategy=strategy, depth=3, top_k=3, budget=8,
                             route_steps=2)
    prompts = PROMPTS[:1] if batch == 1 else PROMPTS
    out = dec.generate(prompts, max_new_tokens=NEW)
    for b in range(len(prompts)):
        assert out.tokens[b] == _reference(b), f"{strategy}: request {b}"
        assert out.stats[b].new_tokens == NEW
    if strategy not in ("autoregressive", "single", "average"):
        assert out.summary["tau"] > 1.3  # the copy of the target is in the mix
    if strategy.startswith("route"):
        assert all(len(s.route_decisions) == s.target_forwards for s in out.stats)
    if strategy == "autoregressive":
        assert out.summary["tau"] == 1.0 and out.steps == NEW - 1


def test_single_small_model_drafter_greedy():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["small2"])], strategy="single", depth=4, top_k=2)
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [_reference(i) for i in range(3)]


def test_copy_of_target_accepts_whole_chains():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=4, top_k=1)
    out = dec.generate(PROMPTS, max_new_tokens=21)
    assert out.tokens == [_greedy_reference(m["target"], p, 21) for p in PROMPTS]
    assert out.summary["tau"] == pytest.approx(5.0)
    assert out.summary["acceptance_rate_per_depth"] == [1.0] * 4
    assert out.summary["drafter_share"] == [1.0]


def test_eos_max_new_and_stream():
    m = _models()
    ref = _reference(1)
    eos = ref[5]
    stop = ref.index(eos)
    streamed = {}
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"]), ModelDrafter(m["small"])], strategy="merged",
                             depth=3, top_k=2)
    out = dec.generate(PROMPTS, max_new_tokens=NEW, eos_token_id=eos,
                       stream=lambda b, toks: streamed.setdefault(b, []).extend(toks))
    assert out.tokens[1] == ref[:stop + 1]
    assert out.stats[1].finish_reason == "eos"
    for b in (0, 2):
        r = _reference(b)
        expected = r[:r.index(eos) + 1] if eos in r else r
        assert out.tokens[b] == expected
    assert streamed == {b: out.tokens[b] for b in range(3)}
    short = dec.generate(PROMPTS[0], max_new_tokens=3)
    assert short.tokens == [_reference(0)[:3]] and short.stats[0].finish_reason == "length"


def test_tensor_input_and_profile():
    m = _models()
    dec = SpeculativeDecoder(m["target"], [ModelDrafter(m["target"])], strategy="single", depth=3, top_k=2)
    out = dec.generate(torch.tensor(PROMPTS[0]), max_new_tokens=6, profile=True)
    assert out.tokens == [_reference(0)[:6]]
    for phase in ("draft", "draft_forward", "target_forward", "verify", "compact", "draft_update"):
        assert phase in out.profile


# ---------------------------------------------------------------------------------------------------
# Sampling is lossless
# ---------------------------------------------------------------------------------------------------

def _truncated_probs(logits, temperature, top_p):
    """The target distribution of docs/SEMANTICS.md (no ties in random float logits)."""
    p = torch.softmax(logits.double() / temperature, -1)
    if top_p < 1.0:
        sorted_p, order = p.sort(-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p
        keep = torch.zeros_like(p, dtype=torch.bool).scatter(-1, order, before < top_p)
        p = torch.where(keep, p, torch.zeros_like(p))
        p = p / p.sum(-1, keepdim=True)
    return p


@torch.no_grad()
def _exact_joint(model, prompt, temperature, top_p):
    """{(x1, x2, x3): probability} over every triple with probability > 1e-7."""
    vocab = model.config.vocab_size
    p1 = _truncated_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], temperature, top_p)
    firsts = p1.nonzero().flatten().tolist()
    seqs = torch.tensor([prompt + [x] for x in firsts])
    p2 = _truncated_probs(model(input_ids=seqs).logits[:, -1], temperature, top_p)  # [F, V]
    pairs = [(x1, x2) for i, x1 in enumerate(firsts) for x2 in range(vocab) if p1[x1] * p2[i, x2] > 1e-7]
    joint2 = {(x1, x2): float(p1[x1] * p2[firsts.index(x1), x2]) for x1, x2 in pairs}
    seqs = torch.tensor([prompt + list(pair) for pair in pairs])
    p3 = _truncated_probs(model(input_ids=seqs).logits[:, -1], temperature, top_p)
    out = {}
    for i, pair in enumerate(pairs):
        for x3 in p3[i].nonzero().flatten().tolist():
            out[pair + (x3,)] = joint2[pair] * float(p3[i, x3])
    return out


@pytest.mark.parametrize("temperature,top_p", [(1.0, 1.0), (1.0, 0.9)])
def test_sampling_matches_target(temperature, top_p):
    from scipy.stats import chisquare
    vocab, samples = 32, 3000
    target = _llama(hidden=16, layers=1, vocab=vocab, seed=11, head_scale=6.0)
    other = _llama(hidden=16, layers=1, vocab=vocab, seed=12, head_scale=3.0)
    prompt = [3, 9, 1, 30]
    dec = SpeculativeDecoder(target, [ModelDrafter(target), ModelDrafter(other)], strategy="merged",
                             depth=3, top_k=2, budget=6)
    out = dec.generate([prompt] * samples, max_new_tokens=3, temperature=temperature, top_p=top_p, seed=1234)
    assert out.summary["tau"] > 1.5  # acceptance paths are exercised, not only bonus tokens
    counts = {}
    for toks in out.tokens:
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    joint = _exact_joint(target, prompt, temperature, top_p)
    assert set(counts) <= set(joint), "a sampled triple the target cannot produce"
    cells = sorted((c for c in joint if joint[c] * samples >= 5), key=lambda c: -joint[c])
    assert len(cells) >= 8
    observed = [counts.get(c, 0) for c in cells]
    expected = [joint[c] * samples for c in cells]
    rest_p = 1.0 - sum(joint[c] for c in cells)
    observed.append(samples - sum(observed))
    expected.append(rest_p * samples)
    scale = samples / sum(expected)
    stat = chisquare(observed, [e * scale for e in expected])
    assert stat.pvalue > 1e-3, (stat, list(zip(observed, expected))[:10])
