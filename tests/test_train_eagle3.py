"""EAGLE-3 training (taps.train.eagle3): the unrolled training forward equals the inference forward at
every step (the context of each draft depth), the unrolled attention equals a masked reference, the draft
vocabulary comes from the token counts, and a tiny run lowers its loss, resumes exactly, and exports a
checkpoint that loads and decodes losslessly."""

import json

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from taps import EagleDrafter  # noqa: E402
from taps.eagle3 import Eagle3Drafter, Eagle3Weights, feature_layers  # noqa: E402
from taps.train import drafter as TD  # noqa: E402
from taps.train import eagle3 as TE  # noqa: E402

from test_train_drafter import assert_resume_equals_uninterrupted, tiny_setup, tiny_target  # noqa: E402,F401


def _target(layers=4, vocab=97):
    import transformers

    from taps import hf

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                                   tie_word_embeddings=True)
    return hf.use_taps_attention(transformers.LlamaForCausalLM(cfg).eval())


def test_unrolled_attention_equals_masked_reference():
    """Step i's query at column t sees step 0's keys <= t and the keys of steps 1 .. i at column t."""
    g = torch.Generator().manual_seed(0)
    b, n, hq, hkv, d, steps = 2, 7, 4, 2, 8, 3
    att = TE.UnrolledAttention(scale=d ** -0.5)
    qs = [torch.randn(b, n, hq, d, generator=g) for _ in range(steps)]
    ks = [torch.randn(b, n, hkv, d, generator=g) for _ in range(steps)]
    vs = [torch.randn(b, n, hkv, d, generator=g) for _ in range(steps)]
    for i in range(steps):
        got = att(0, qs[i], ks[i], vs[i])
        keys = torch.cat(ks[:i + 1], 1).transpose(1, 2).repeat_interleave(2, 1)    # [B, H, (i+1) n, D]
        values = torch.cat(vs[:i + 1], 1).transpose(1, 2).repeat_interleave(2, 1)
        mask = torch.zeros(n, (i + 1) * n, dtype=torch.bool)
        for t in range(n):
            mask[t, :t + 1] = True                                                  # step 0, causal
            for j in range(1, i + 1):
                mask[t, j * n + t] = True                                           # steps 1 .. i, own column
        ref = torch.nn.functional.scaled_dot_product_attention(qs[i].transpose(1, 2), keys, values, attn_mask=mask)
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("draft", [40, None])
def test_unrolled_steps_equal_the_inference_forward(draft):
    """Unrolled step i at column t equals the inference logits of a depth-i draft node whose root is
    committed entry t (prefix 0 .. t with target features, then draft ancestors fed their parent's
    output), for every step and several columns."""
    target = _target()
    ids = None if draft is None else torch.randperm(97, generator=torch.Generator().manual_seed(2))[:draft]
    d = TE.new_eagle3_drafter(target, ids, feature_layers(4))
    with torch.no_grad():
        for p in d.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    g = torch.Generator().manual_seed(1)
    n, steps = 10, 5
    tokens = torch.randint(0, 97, (2, n), generator=g)
    fused = torch.randn(2, n, 96, generator=g)
    with torch.no_grad():
        unrolled = TE.unrolled_logits(d, Eagle3Weights([d]), tokens, fused, steps)
        for t in (0, 2, 4):
            lengths = torch.full((2,), t + 1)
            d.start(tokens[:, :t + 1], lengths, tokens[:, t + 1], fused[:, :t + 1], 32)
            torch.testing.assert_close(d.root_logits, unrolled[0][:, t], atol=1e-5, rtol=1e-5)
            for i in range(1, steps):
                mask = torch.cat([torch.ones(2, 1, t + 1, dtype=torch.bool), torch.ones(2, 1, i, dtype=torch.bool)], -1)
                logits = d.forward_nodes(tokens[:, t + 1 + i:t + 2 + i], torch.full((2, 1), -1 if i == 1 else 0),
                                         torch.full((2, 1), t + i), (lengths + i - 1).unsqueeze(1),
                                         mask.unsqueeze(1), i)
                torch.testing.assert_close(logits[:, 0], unrolled[i][:, t], atol=1e-5, rtol=1e-5, msg=f"t={t} i={i}")


def test_losses_mask_tokens_outside_the_draft_vocabulary():
    target = _target()
    ids = torch.arange(0, 97, 2)  # even ids only
    d = TE.new_eagle3_drafter(target, ids, feature_layers(4))
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 97, (2, 12), generator=g)
    fused, final = torch.randn(2, 12, 96, generator=g), torch.randn(2, 12, 32, generator=g)
    head = target.get_output_embeddings().weight.detach()
    loss, m = TE.eagle3_losses(d, head, tokens, fused, final, 3)
    assert loss.requires_grad and set(m) == {"ce@1", "ce@2", "ce@3", "acc@1", "acc@2", "acc@3"}
    loss.backward()
    assert all(p.grad is not None for p in d.parameters())
    # the batch's top-1 tokens and counts given (as training passes them) or computed: the same loss; two
    # halves given the whole batch's counts times 1/2, weighted 1/2 each (as accumulate_gradients does),
    # sum to it
    with torch.no_grad():
        top1 = TE.target_top1(head, final, micro=1)
        counts = TE.masked_counts(d, top1, 3)
        given, m2 = TE.eagle3_losses(d, head, tokens, fused, final, 3, counts=counts, top1=top1)
        halves = sum(TE.eagle3_losses(d, head, tokens[r], fused[r], final[r], 3, counts=[c / 2 for c in counts],
                                      top1=top1[r])[0] for r in (slice(0, 1), slice(1, 2)))
    torch.testing.assert_close(given, loss.detach())
    torch.testing.assert_close(halves / 2, loss.detach())
    assert m2 == m
    # a target whose top-1 token is always outside the draft vocabulary gives no loss terms
    odd = torch.zeros_like(head)
    odd[1] = 50.0
    with torch.no_grad():
        loss, m = TE.eagle3_losses(d, odd, tokens, fused, final.abs() + 1, 3)
    assert float(loss) == 0.0 and m["acc@1"] == 0.0


def test_draft_vocabulary_from_counts_or_data(tmp_path):
    from taps.vocab import save_token_counts

    cfg = TD.DrafterTrainConfig(target=tmp_path, family="eagle3", draft_vocab=3)
    blocks = [torch.tensor([[5, 5, 5, 1], [2, 2, 7, 7]])]
    ids, info = TE.draft_vocabulary(cfg, 10, blocks)
    assert ids.tolist() == [2, 5, 7] and info["source"]["file"] is None  # counted over the blocks
    counts = torch.zeros(10, dtype=torch.int64)
    counts[[0, 3, 9]] = torch.tensor([4, 9, 1])
    save_token_counts(tmp_path, counts)
    ids, info = TE.draft_vocabulary(cfg, 10, blocks)
    assert ids.tolist() == [0, 3, 9] and info["source"]["file"] == "token_counts.json of the target"
    assert TE.draft_vocabulary(TD.DrafterTrainConfig(target=tmp_path, family="eagle3", draft_vocab=0), 10,
                               blocks)[0] is None


def test_layer_feature_cache_is_reused_only_for_the_same_target_and_blocks(tmp_path, monkeypatch):
    target = _target(layers=4)
    blocks = torch.randint(0, 97, (5, 16), dtype=torch.int32, generator=torch.Generator().manual_seed(0))
    cfg = TD.DrafterTrainConfig(target=tmp_path, family="eagle3", feature_dir=tmp_path / "features", quiet=True)
    calls = []
    real = TE.target_layer_features

    def counted(*a, **k):
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(TE, "target_layer_features", counted)

    def feats(key, train=blocks[:3]):
        return TD.DomainFeatures(train, None, blocks[3:], None, {"key": key})

    train, held = TE.load_layer_features("math", cfg, feats({"target_sha256": "a"}), (1, 2, 3), target, "cpu")
    assert train.shape == (3, 16, 3 * 32) and held.shape == (2, 16, 3 * 32) and len(calls) == 2
    with torch.no_grad():
        hs = target.model(input_ids=blocks[:3].long(), output_hidden_states=True).hidden_states
    torch.testing.assert_close(train.float(), torch.cat([hs[i] for i in (1, 2, 3)], -1).bfloat16().float())
    TE.load_layer_features("math", cfg, feats({"target_sha256": "a"}, blocks[:2]), (1, 2, 3), target, "cpu")
    assert len(calls) == 2  # a prefix of the cached blocks: reused
    TE.load_layer_features("math", cfg, feats({"target_sha256": "b"}), (1, 2, 3), target, "cpu")
    assert len(calls) == 4  # another target: computed again
    TE.load_layer_features("math", cfg, feats({"target_sha256": "b"}, blocks[1:4]), (1, 2, 3), target, "cpu")
    assert len(calls) == 6  # other blocks: computed again


def test_tiny_run_trains_resumes_exports_and_decodes(tiny_setup, tmp_path):
    cfg, tdir = tiny_setup
    common = dict(family="eagle3", data="mixed", tokens=8192, lr=1e-2, draft_vocab=512, ttt_steps=3)
    full = cfg(**common, run_dir=tmp_path / "runs" / "full", out=tmp_path / "out" / "full")
    summary = TE.train_eagle3(full)
    assert summary["finished"] and summary["steps"] == 8192 // 64 // 4
    log = [json.loads(x) for x in (full.run_dir / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    assert "acc@3" in log[-1] and "ce@3" in log[-1]
    m = json.loads((full.out / "manifest.json").read_text())
    assert m["family"] == "eagle3" and m["tokens_seen"] == 8192 and m["draft_vocab"]["size"] == 512
    assert m["feature_layers"] == [0, 1] and "acc@5" in m["final_heldout"]["math"]
    from taps import models

    models.verify_manifest(full.out)

    assert_resume_equals_uninterrupted(cfg, tmp_path, 11, **common)

    from transformers import AutoModelForCausalLM

    from taps.decoder import SpeculativeDecoder

    target = AutoModelForCausalLM.from_pretrained(str(tdir)).eval()
    d = EagleDrafter.from_pretrained(str(full.out), target=target, dtype=torch.float32)
    assert isinstance(d, Eagle3Drafter) and d.draft_vocab_size == 512 and d.feature_layers == (0, 1)
    prompts = torch.randint(6, 400, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
    ref = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=16)
    out = SpeculativeDecoder(target, [d], strategy="single", depth=4, top_k=3, budget=12).generate(
        prompts, max_new_tokens=16)
    assert out.tokens == ref.tokens

    avg = tmp_path / "out" / "avg"
    TD.average_checkpoints([full.out, tmp_path / "out" / "part"], avg, tdir)
    assert isinstance(EagleDrafter.from_pretrained(str(avg), target=target), Eagle3Drafter)
    assert json.loads((avg / "manifest.json").read_text())["family"] == "eagle3"
