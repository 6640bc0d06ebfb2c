"""EAGLE-3 drafters (taps.eagle3) on tiny random Llama models, fp32 on CPU.

1. The feature-layer rule on literal depths (the shipped 4-layer target reads layers 1, 2, 3).
2. Published checkpoints: both file formats, with and without d2t / t2d, fp16, ``model.`` prefixes,
   ``layers.0.`` naming and the layers named in config.json load through EagleDrafter.from_pretrained,
   decode, and round-trip through save_pretrained; heads that do not fit the target fail with clear errors.
3. Batched groups: two heads run as one stacked group draft exactly what each drafts alone.
4. Greedy equality with the target for every strategy with EAGLE-3 drafters (mixed with an EAGLE-2 head
   and a small LM where the strategy combines drafters), and with a restricted draft vocabulary.
5. Sampling at T = 1: merged trees of one EAGLE-3 and one EAGLE-2 head follow the target's distribution
   (chi-square against the exact joint distribution of three tokens).
"""

import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import taps_ops  # noqa: E402,F401
from taps import Eagle3Drafter, EagleDrafter, ModelDrafter, SpeculativeDecoder, STRATEGIES  # noqa: E402
from taps import average_drafters  # noqa: E402
from taps.eagle3 import feature_layers, vocab_mapping  # noqa: E402

import engine_models as em  # noqa: E402

VOCAB = 96


def _config(hidden=32, layers=4, vocab=VOCAB, **kw):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=512, initializer_range=0.1, tie_word_embeddings=False,
                                    **kw)


def _target(seed=1, head_scale=4.0, **kw):
    from taps import hf

    torch.manual_seed(seed)
    model = hf.use_taps_attention(transformers.LlamaForCausalLM(_config(**kw)).eval())
    with torch.no_grad():  # a peaky target, so that drafters agree with it sometimes
        model.lm_head.weight.mul_(head_scale)
    return model


def _eagle3(target, seed=0, draft=None, vocab_seed=0, scale=0.2):
    """A random EAGLE-3 head for `target` over `draft` random target ids (None: the whole vocabulary)."""
    cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1})
    vocab = target.config.vocab_size
    cfg.draft_vocab_size = draft or vocab
    torch.manual_seed(seed)
    d = Eagle3Drafter(cfg)
    if draft:
        ids = torch.randperm(vocab, generator=torch.Generator().manual_seed(vocab_seed))[:draft]
        d.set_vocab_mapping(vocab_mapping(ids, vocab)[0])
    em.randomize_(d, scale)
    d.bind(target)
    return d


def _eagle2(target, seed):
    torch.manual_seed(seed)
    d = EagleDrafter(transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1}))
    d.bind(target)
    return d


PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 90, 12, 7, 64, 90, 2, 33, 41, 11], [70, 1]]
NEW = 14


def test_feature_layers_rule():
    assert feature_layers(32) == (2, 16, 29)  # the reference's low / middle / high
    assert feature_layers(7) == (2, 3, 4)
    assert feature_layers(6) == (1, 3, 5)
    assert feature_layers(4) == (1, 2, 3)  # the shipped target
    assert feature_layers(3) == (0, 1, 2)
    assert feature_layers(1) == (0,)
    with pytest.raises(ValueError, match="at least one layer"):
        feature_layers(0)


def test_vocab_mapping_literal():
    d2t, t2d = vocab_mapping(torch.tensor([7, 2, 5]), 9)
    assert d2t.tolist() == [2, 4, 5]  # draft ids 0, 1, 2 -> target ids 2, 5, 7
    assert t2d.tolist() == [False, False, True, False, False, True, False, True, False]
    with pytest.raises(ValueError, match="distinct"):
        vocab_mapping(torch.tensor([1, 1]), 9)


# ---------------------------------------------------------------------------------------------------
# Published checkpoints
# ---------------------------------------------------------------------------------------------------

def _published_state(hidden, inter, heads, kv_heads, draft, vocab, gen, features=3, d2t=True):
    """A state dict named as published EAGLE-3 checkpoints name it."""
    d = hidden // heads
    shapes = {
        "fc.weight": (hidden, features * hidden),
        "midlayer.input_layernorm.weight": (hidden,), "midlayer.hidden_norm.weight": (hidden,),
        "midlayer.post_attention_layernorm.weight": (hidden,),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": (kv_heads * d, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": (kv_heads * d, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": (hidden, heads * d),
        "midlayer.mlp.gate_proj.weight": (inter, hidden), "midlayer.mlp.up_proj.weight": (inter, hidden),
        "midlayer.mlp.down_proj.weight": (hidden, inter),
        "norm.weight": (hidden,), "lm_head.weight": (draft, hidden),
    }
    state = {k: (torch.randn(s, generator=gen) * 0.2 if len(s) > 1 else 1 + 0.1 * torch.randn(s, generator=gen))
             for k, s in shapes.items()}
    if d2t:
        ids = torch.randperm(vocab, generator=gen)[:draft]
        state["d2t"], state["t2d"] = vocab_mapping(ids, vocab)
    return state


def _write(folder, config, state, fmt, prefix=""):
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)
    state = {prefix + k: v for k, v in state.items()}
    if fmt == "bin":
        torch.save(state, os.path.join(folder, "pytorch_model.bin"))
    else:
        from safetensors.torch import save_file
        save_file(state, os.path.join(folder, "model.safetensors"))


def _published_config(draft, **extra):
    return {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": 32,
            "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
            "vocab_size": VOCAB, "draft_vocab_size": draft, "max_position_embeddings": 512, "rms_norm_eps": 1e-6,
            "rope_theta": 10000.0, "hidden_act": "silu", "torch_dtype": "float16", **extra}


@pytest.mark.parametrize("fmt", ["bin", "safetensors"])
@pytest.mark.parametrize("with_d2t", [True, False])
def test_published_layout_loads_decodes_and_round_trips(tmp_path, fmt, with_d2t):
    target = _target()
    gen = torch.Generator().manual_seed(3)
    draft = 40 if with_d2t else VOCAB  # without d2t / t2d the draft vocabulary is the whole vocabulary
    state = _published_state(32, 64, 4, 2, draft, VOCAB, gen, d2t=with_d2t)
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in state.items()}
    _write(tmp_path / "src", _published_config(draft), half, fmt)
    d = EagleDrafter.from_pretrained(str(tmp_path / "src"), target=target, dtype=torch.float32)
    assert isinstance(d, Eagle3Drafter) and d.feature_layers == (1, 2, 3) and d.draft_vocab_size == draft
    for k, v in d.state_dict().items():
        if k in half:
            torch.testing.assert_close(v, half[k].float() if v.is_floating_point() else half[k], atol=0, rtol=0)
    if with_d2t:
        assert sorted(d.token_map.tolist()) == state["t2d"].nonzero().flatten().tolist()
    else:
        assert d.token_map is None and not bool(d.d2t.any())
    fp16 = EagleDrafter.from_pretrained(str(tmp_path / "src"))  # the stored dtype is kept
    assert fp16.fc.weight.dtype == torch.float16

    ref = [em.greedy_reference(target, p, NEW) for p in PROMPTS]
    out = SpeculativeDecoder(target, [d], strategy="single", depth=3, top_k=3, budget=8).generate(
        PROMPTS, max_new_tokens=NEW)
    assert out.tokens == ref
    with torch.no_grad():
        d.start(*_prefill(target, PROMPTS, d.feature_layers))
        before = d.draft(3, 3)
    assert set(before.tokens.flatten().tolist()) <= set(range(VOCAB))
    if with_d2t:  # every proposed token is a target id of the draft vocabulary
        assert set(before.tokens.flatten().tolist()) <= set(d.token_map.tolist())

    d.save_pretrained(str(tmp_path / "saved"), safe_serialization=(fmt == "safetensors"))
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert saved["draft_vocab_size"] == draft and saved["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    again = EagleDrafter.from_pretrained(str(tmp_path / "saved"), target=target)
    assert set(again.state_dict()) == set(d.state_dict())
    for k, v in d.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, atol=0, rtol=0)
    with torch.no_grad():
        again.start(*_prefill(target, PROMPTS, again.feature_layers))
        after = again.draft(3, 3)
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, atol=0, rtol=0)


def test_prefixed_renamed_and_configured_layouts(tmp_path):
    """``model.`` prefixes, ``layers.0.`` for ``midlayer.``, an own embedding and layers named in config.json
    (under eagle_config, as SGLang / vLLM configs do) load too."""
    target = _target()
    gen = torch.Generator().manual_seed(4)
    state = _published_state(32, 64, 4, 2, 40, VOCAB, gen, features=2)
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v for k, v in state.items()}
    state["embed_tokens.weight"] = torch.randn(VOCAB, 32, generator=gen)
    cfg = _published_config(40, eagle_config={"eagle_aux_hidden_state_layer_ids": [0, 3]})
    _write(tmp_path / "a", cfg, state, "safetensors", prefix="model.")
    d = EagleDrafter.from_pretrained(str(tmp_path / "a"), target=target)
    assert isinstance(d, Eagle3Drafter) and d.feature_layers == (0, 3) and hasattr(d, "embed_tokens")
    out = SpeculativeDecoder(target, [d], strategy="single", depth=3, top_k=2).generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [em.greedy_reference(target, p, NEW) for p in PROMPTS]


def test_heads_that_do_not_fit_are_refused(tmp_path):
    target = _target()
    gen = torch.Generator().manual_seed(5)

    def load(name, state, cfg=None, to=target):
        _write(tmp_path / name, cfg or _published_config(40), state, "safetensors")
        return EagleDrafter.from_pretrained(str(tmp_path / name), target=to)

    good = _published_state(32, 64, 4, 2, 40, VOCAB, gen)
    wide = _published_state(48, 96, 4, 2, 40, VOCAB, gen)  # a head for a 48-wide target
    with pytest.raises(ValueError, match="hidden size 48, the target's is 32"):
        load("wide", wide, _published_config(40, hidden_size=48, intermediate_size=96))
    with pytest.raises(ValueError, match="vocabulary of 120 tokens"):
        load("vocab", _published_state(32, 64, 4, 2, 40, 120, gen), _published_config(40, vocab_size=120))
    with pytest.raises(ValueError, match="missing"):
        load("missing", {k: v for k, v in good.items() if k != "midlayer.hidden_norm.weight"})
    with pytest.raises(ValueError, match="unexpected.*mystery"):
        load("unknown", {**good, "midlayer.mystery.weight": torch.zeros(3)})
    with pytest.raises(ValueError, match="no d2t"):
        load("nod2t", {k: v for k, v in good.items() if k not in ("d2t", "t2d")})
    bad_t2d = dict(good)
    bad_t2d["t2d"] = good["t2d"].roll(1)
    with pytest.raises(ValueError, match="t2d does not mark"):
        load("t2d", bad_t2d)
    with pytest.raises(ValueError, match="draft_vocab_size is 50"):
        load("draftsize", good, _published_config(50))
    with pytest.raises(ValueError, match="fc reads 3 target layers.*2-layer"):
        load("shallow", good, to=_target(layers=2))
    with pytest.raises(ValueError, match="not an EAGLE-3 checkpoint"):
        load("nofc", {k: v for k, v in good.items() if k != "fc.weight"})
    with pytest.raises(ValueError, match="another d2t"):
        average_drafters([_eagle3(target, 1, draft=40, vocab_seed=1), _eagle3(target, 2, draft=40, vocab_seed=2)])


# ---------------------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------------------

@torch.no_grad()
def _prefill(target, prompts, layers, max_len=64):
    """(ids, lens, greedy root, fused features, max_len) after the target's prefill."""
    from taps import hf

    ids, lens = em.pad_prompts(prompts)
    cache = hf.TreeKVCache.for_model(target, len(prompts), max_len)
    out = hf.prefill(target, cache, ids, lens, capture_layers=layers)
    return ids, lens, out.logits.argmax(-1), torch.cat([out.layers[i] for i in layers], -1), max_len


@torch.no_grad()
def test_stacked_group_drafts_what_each_head_drafts():
    target = _target()
    heads = [_eagle3(target, seed=s, draft=40) for s in (1, 2)]
    from taps.drafters import make_groups

    groups = make_groups(heads)
    assert len(groups) == 1 and groups[0].groups == 2  # one batched group
    start = _prefill(target, PROMPTS, heads[0].feature_layers)
    groups[0].start(*start)
    together = groups[0].draft(3, 3)
    for g, head in enumerate(heads):
        head.start(*start)
        alone = head.draft(3, 3)
        rows = slice(g * len(PROMPTS), (g + 1) * len(PROMPTS))
        for x, y in zip(together, alone):
            torch.testing.assert_close(x[rows], y, atol=1e-5, rtol=1e-5)
    # different kinds run as different groups
    kinds = make_groups([heads[0], _eagle2(target, 3), heads[1]])
    assert [g.members for g in kinds] == [[0, 2], [1]]


def _drafters(strategy, target):
    if strategy == "autoregressive":
        return []
    if strategy == "single":
        return [_eagle3(target, 5, draft=40)]
    if strategy == "average":
        return [_eagle3(target, 5, draft=40), _eagle3(target, 6, draft=40)]
    # an EAGLE-3 head, an EAGLE-2 head and a copy of the target (long acceptance)
    return [_eagle3(target, 7, draft=40), _eagle2(target, 8), ModelDrafter(target)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_equals_target_for_every_strategy(strategy):
    target = _target()
    ref = [em.greedy_reference(target, p, NEW) for p in PROMPTS]
    dec = SpeculativeDecoder(target, _drafters(strategy, target), strategy=strategy, depth=3, top_k=3, budget=8,
                             route_steps=2)
    out = dec.generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == ref, strategy
    if strategy not in ("autoregressive", "single", "average"):
        assert out.summary["tau"] > 1.3


def test_hugging_face_target_path():
    """The target's layer inputs reach the head through the Hugging Face forward too (lean=False)."""
    target = _target()
    heads = [_eagle3(target, 10, draft=40), _eagle2(target, 11)]
    out = SpeculativeDecoder(target, heads, strategy="merged", depth=3, top_k=3, lean=False).generate(
        PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [em.greedy_reference(target, p, NEW) for p in PROMPTS]
    lean = SpeculativeDecoder(target, heads, strategy="merged", depth=3, top_k=3).generate(PROMPTS, max_new_tokens=NEW)
    assert [s.accepted for s in out.stats] == [s.accepted for s in lean.stats]


def test_restricted_draft_vocabulary_stays_lossless():
    target = _target()
    d = _eagle3(target, 9, draft=40)
    allowed = d.token_map[:25].flip(0)
    outside = [t for t in range(VOCAB) if t not in d.token_map.tolist()][:5]
    d.set_draft_vocab(torch.cat([allowed, torch.tensor(outside)]))
    assert sorted(d.token_map.tolist()) == sorted(allowed.tolist())  # the head's vocabulary, restricted
    out = SpeculativeDecoder(target, [d], strategy="single", depth=3, top_k=3).generate(PROMPTS, max_new_tokens=NEW)
    assert out.tokens == [em.greedy_reference(target, p, NEW) for p in PROMPTS]
    with torch.no_grad():
        d.start(*_prefill(target, PROMPTS, d.feature_layers))
        assert set(d.draft(3, 3).tokens.flatten().tolist()) <= set(allowed.tolist())
    with pytest.raises(ValueError, match="no token of the restricted vocabulary"):
        d.set_draft_vocab(torch.tensor([t for t in range(VOCAB) if t not in d.draft_token_ids().tolist()][:3]))
        d.token_map


# ---------------------------------------------------------------------------------------------------
# Sampling is lossless
# ---------------------------------------------------------------------------------------------------

def test_sampling_merged_eagle3_and_eagle2_matches_target():
    from sampling_checks import assert_counts, spec_probs

    vocab, samples = 24, 3000
    target = _target(seed=11, head_scale=6.0, hidden=16, vocab=vocab)
    prompt = [3, 9, 1, 20]
    e3 = _eagle3(target, 12, draft=16, scale=0.6)
    e2 = _eagle2(target, 13)
    dec = SpeculativeDecoder(target, [e3, e2], strategy="merged", depth=3, top_k=3, budget=8)
    out = dec.generate([prompt] * samples, max_new_tokens=3, temperature=1.0, seed=4321)
    assert out.summary["tau"] > 1.2  # acceptance paths are exercised, not only bonus tokens
    assert min(out.summary["drafter_share"]) > 0.05  # both heads' nodes are accepted
    counts = {}
    for toks in out.tokens:
        counts[tuple(toks)] = counts.get(tuple(toks), 0) + 1
    joint = em.exact_joint(target, prompt, 3, lambda row: spec_probs(row, 1.0))
    assert set(counts) <= set(joint), "a sampled triple the target cannot produce"
    cells = list(joint)
    assert sum(joint[c] * samples >= 5 for c in cells) >= 8
    assert_counts([counts.get(c, 0) for c in cells], [joint[c] for c in cells])
