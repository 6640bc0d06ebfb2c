"""Drafters (taps.drafters, taps.expansion) on tiny random Llama models, fp32 on CPU.

1. The EAGLE-2 expansion's candidate scores equal log-probs recomputed one path at a time through the
   drafter's plain committed-cache API (scratch masks, positions and parent features are right).
2. EAGLE checkpoints: the public layout (config.json + pytorch_model.bin, fc.*, layers.0.*) loads as
   it is; save_pretrained / from_pretrained round trip; bad weight names are refused.
3. Checkpoint averaging gives the mean weights; mismatched drafters are refused.
4. Bad input: vocab / hidden size / tokenizer mismatches, empty drafter lists, unknown strategies.
"""

import json
import os

import pytest
import torch
import transformers

import taps_ops  # noqa: F401
from taps import EagleDrafter, ModelDrafter, SpeculativeDecoder, average_drafters
from taps import hf

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def _config(hidden=32, layers=2, vocab=VOCAB):
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, initializer_range=0.1, tie_word_embeddings=False)


def _llama(seed=0, **kw):
    torch.manual_seed(seed)
    return hf.use_taps_attention(transformers.LlamaForCausalLM(_config(**kw)).eval())


def _eagle(target, seed=0, **kw):
    torch.manual_seed(seed)
    d = EagleDrafter(_config(hidden=target.config.hidden_size, layers=1), **kw)
    em.randomize_(d, 0.2)
    d.bind(target)
    return d


PROMPTS = [[5, 17, 42, 8, 61, 3], [3, 3, 9, 12]]


@torch.no_grad()
def _start(drafter, target, prompts, max_len=64):
    """Prefill the target, take the greedy root, start the drafter; returns (ids, lens, root, hidden)."""
    ids, lens = em.pad_prompts(prompts)
    cache = hf.TreeKVCache.for_model(target, len(prompts), max_len)
    out = hf.prefill(target, cache, ids, lens, return_hidden=True)
    root = out.logits.argmax(-1)
    drafter.start(ids, lens, root, out.hidden_states, max_len)
    return ids, lens, root, out.hidden_states


def _paths(parents, m):
    path = [m]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


@pytest.mark.parametrize("kind", ["model", "eagle"])
@torch.no_grad()
def test_expansion_scores_match_sequential_paths(kind):
    target = _llama(seed=1)
    drafter = ModelDrafter(_llama(seed=2, hidden=16, layers=1)) if kind == "model" else _eagle(target, seed=3)
    drafter.bind(target)
    depth, top_k = 3, 2
    start = _start(drafter, target, PROMPTS)
    cand = drafter.draft(depth, top_k)
    assert cand.scores.shape == (2, top_k + (depth - 1) * top_k * top_k)
    assert (cand.entropy > 0).all()
    for b in range(len(PROMPTS)):
        parents, tokens = cand.parents[b].tolist(), cand.tokens[b].tolist()
        for m in range(len(tokens)):
            path = _paths(parents, m)
            # recompute: commit the path's tokens one by one (for EAGLE, paired with the head's own
            # predicted feature of the previous node), then read the next-token log-prob
            drafter.start(*(t[b:b + 1] for t in start), 64)
            expected = 0.0
            for j, node in enumerate(path):
                logp = torch.log_softmax(drafter.root_logits[0].float(), -1)
                expected += float(logp[tokens[node]])
                if j + 1 < len(path):
                    feature = drafter.root_feature.view(1, 1, -1) if kind == "eagle" else None
                    drafter.advance(torch.tensor([[tokens[node]]]), torch.tensor([1]), feature)
            assert float(cand.scores[b, m]) == pytest.approx(expected, abs=1e-4), f"request {b} candidate {m}"
        drafter.start(*start, 64)
        cand = drafter.draft(depth, top_k)


# ---------------------------------------------------------------------------------------------------
# EAGLE checkpoints
# ---------------------------------------------------------------------------------------------------

def _eagle_layout_state(hidden, inter, heads, kv_heads, gen):
    """A state dict named as public EAGLE-1/2 checkpoints name it (fc with bias, no layer-0 input norm)."""
    d = hidden // heads
    shapes = {
        "fc.weight": (hidden, 2 * hidden), "fc.bias": (hidden,),
        "layers.0.self_attn.q_proj.weight": (heads * d, hidden),
        "layers.0.self_attn.k_proj.weight": (kv_heads * d, hidden),
        "layers.0.self_attn.v_proj.weight": (kv_heads * d, hidden),
        "layers.0.self_attn.o_proj.weight": (hidden, heads * d),
        "layers.0.mlp.gate_proj.weight": (inter, hidden), "layers.0.mlp.up_proj.weight": (inter, hidden),
        "layers.0.mlp.down_proj.weight": (hidden, inter),
        "layers.0.post_attention_layernorm.weight": (hidden,),
    }
    return {k: torch.randn(s, generator=gen) * 0.2 for k, s in shapes.items()}


def test_eagle_public_layout_loads_and_round_trips(tmp_path):
    target = _llama(seed=1)
    gen = torch.Generator().manual_seed(0)
    state = _eagle_layout_state(32, 64, 4, 2, gen)
    src = tmp_path / "eagle"
    os.makedirs(src)
    with open(src / "config.json", "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "bias": True,
                   "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                   "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": VOCAB,
                   "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
                   "hidden_act": "silu", "torch_dtype": "float16"}, f)
    torch.save({k: v.half() for k, v in state.items()}, src / "pytorch_model.bin")
    drafter = EagleDrafter.from_pretrained(str(src), target=target)
    assert drafter.fc.bias is not None and not hasattr(drafter.layers[0], "input_layernorm")
    assert set(drafter.state_dict()) == set(state)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(v, state[k].half().float(), atol=0, rtol=0)
    with torch.no_grad():
        _start(drafter, target, PROMPTS)
        before = drafter.draft(3, 2)
    dst = tmp_path / "saved"
    drafter.save_pretrained(str(dst))
    again = EagleDrafter.from_pretrained(str(dst), target=target)
    for k, v in drafter.state_dict().items():
        torch.testing.assert_close(again.state_dict()[k], v, atol=0, rtol=0)
    with torch.no_grad():
        _start(again, target, PROMPTS)
        after = again.draft(3, 2)
    for x, y in zip(before, after):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    # an extra, unknown weight name is refused
    torch.save({**state, "layers.0.mystery.weight": torch.zeros(3)}, src / "pytorch_model.bin")
    with pytest.raises(ValueError, match="mystery"):
        EagleDrafter.from_pretrained(str(src))


def test_eagle_own_embedding_and_input_norm_layout(tmp_path):
    target = _llama(seed=1)
    d = _eagle(target, seed=4, bias=False, input_norm_first_layer=True, own_embedding=True)
    d.save_pretrained(str(tmp_path), safe_serialization=False)
    again = EagleDrafter.from_pretrained(str(tmp_path), target=target)
    assert again.fc.bias is None and hasattr(again.layers[0], "input_layernorm")
    assert hasattr(again, "embed_tokens")


# ---------------------------------------------------------------------------------------------------
# Averaging
# ---------------------------------------------------------------------------------------------------

def test_average_gives_mean_weights():
    target = _llama(seed=1)
    a, b = _eagle(target, seed=5), _eagle(target, seed=6)
    avg = average_drafters([a, b])
    for k, v in avg.state_dict().items():
        torch.testing.assert_close(v, (a.state_dict()[k] + b.state_dict()[k]) / 2)
    assert avg is not a and a.fc.weight.data_ptr() != avg.fc.weight.data_ptr()
    m1, m2 = ModelDrafter(_llama(seed=7, hidden=16, layers=1)), ModelDrafter(_llama(seed=8, hidden=16, layers=1))
    mavg = average_drafters([m1, m2], weights=[3, 1])
    for k, v in mavg.state_dict().items():
        torch.testing.assert_close(v, 0.75 * m1.state_dict()[k] + 0.25 * m2.state_dict()[k])
    with pytest.raises(ValueError, match="shape"):
        average_drafters([m1, ModelDrafter(_llama(seed=9, hidden=32, layers=1))])
    with pytest.raises(ValueError, match="kinds"):
        average_drafters([a, m1])
    with pytest.raises(ValueError, match="no drafters"):
        average_drafters([])


# ---------------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------------

class _Tok:
    def __init__(self, vocab):
        self.vocab = vocab

    def __len__(self):
        return len(self.vocab)

    def get_vocab(self):
        return dict(self.vocab)


def test_bad_input_is_refused():
    target = _llama(seed=1)
    with pytest.raises(ValueError, match="vocabulary"):
        SpeculativeDecoder(target, [ModelDrafter(_llama(seed=2, vocab=VOCAB + 8))])
    with pytest.raises(ValueError, match="hidden size"):
        eagle = EagleDrafter(_config(hidden=48, layers=1))
        SpeculativeDecoder(target, [eagle])
    tok = _Tok({f"t{i}": i for i in range(VOCAB)})
    other = _Tok({f"t{i}": (i + 1) % VOCAB for i in range(VOCAB)})
    with pytest.raises(ValueError, match="tokenizer"):
        SpeculativeDecoder(target, [ModelDrafter(_llama(seed=2), tokenizer=other)], tokenizer=tok)
    SpeculativeDecoder(target, [ModelDrafter(_llama(seed=2), tokenizer=_Tok(tok.vocab))], tokenizer=tok)  # same: fine
    with pytest.raises(ValueError, match="at least one drafter"):
        SpeculativeDecoder(target, [], strategy="merged")
    with pytest.raises(ValueError, match="unknown strategy"):
        SpeculativeDecoder(target, [ModelDrafter(target)], strategy="mergd")
    with pytest.raises(ValueError, match="exactly one"):
        SpeculativeDecoder(target, [ModelDrafter(target), ModelDrafter(target)], strategy="single")
    with pytest.raises(ValueError, match="no drafter"):
        SpeculativeDecoder(target, [ModelDrafter(target)], strategy="autoregressive")
    with pytest.raises(TypeError, match="Drafter"):
        SpeculativeDecoder(target, [target])
    dec = SpeculativeDecoder(target, [ModelDrafter(target)])
    with pytest.raises(ValueError, match="text prompts"):
        dec.generate("hello")
    with pytest.raises(ValueError, match="token ids"):
        dec.generate([[1, VOCAB]])
    with pytest.raises(ValueError, match="at least one token"):
        dec.generate([[1, 2], []])
