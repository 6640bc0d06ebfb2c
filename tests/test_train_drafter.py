"""Drafter training (taps.train.drafter): the training forward equals the drafter's inference forward,
HASS context alignment sees exactly the context of a deeper draft step, and a tiny run trains, resumes,
exports in the EAGLE layout and averages."""

import json

import pytest
import torch

from taps.drafters import EagleDrafter
from taps.train import drafter as TD

from tiny_training import fake_blocks, tiny_target, tiny_target_dir  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral"])
def test_drafter_config_of_other_families(arch):
    """The drafter is Llama-shaped whatever the target's family, with the target's heads, head dim and
    rotary settings (Qwen2 configs lack mlp_bias, so copying the target's config class failed)."""
    target = tiny_target(vocab=97, arch=arch)
    cfg = TD.drafter_config(target.config, 2)
    assert type(cfg).__name__ == "LlamaConfig" and cfg.num_hidden_layers == 2
    for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rms_norm_eps"):
        assert getattr(cfg, k) == getattr(target.config, k), k
    assert cfg.head_dim == (16 if arch == "qwen3" else 8)
    assert cfg.rope_parameters["rope_theta"] == target.config.rope_parameters["rope_theta"]
    drafter = TD.new_drafter(target)
    assert drafter.layers[0].self_attn.q_proj.out_features == 4 * cfg.head_dim


def test_alignment_mask_literal():
    m = TD.alignment_mask(4, 1, "cpu")
    assert torch.equal(m, torch.tril(torch.ones(4, 4, dtype=torch.bool)))
    m = TD.alignment_mask(4, 3, "cpu").view(4, 3, 4)
    # query t: key t from step 3, key t-1 from step 2, keys <= t-2 from step 1
    for t in range(4):
        for s in range(4):
            step = [i + 1 for i in range(3) if m[t, i, s]]
            assert step == ([] if s > t else [max(1, 3 - (t - s))]), (t, s, step)


def _inference_features(drafter, tokens, feats):
    """EagleDrafter.features over one causal sequence (its own cache): the inference path."""
    b, n, _ = feats.shape
    pos = torch.arange(n).unsqueeze(0).expand(b, -1)
    mask = torch.tril(torch.ones(n, n, dtype=torch.bool)).expand(b, 1, n, n)
    return drafter.features(tokens, feats, pos, pos, mask)


@pytest.mark.parametrize("layers,arch", [(1, "llama"), (2, "llama"), (1, "qwen3")])
def test_unrolled_steps_equal_the_inference_context(layers, arch):
    """Step j's prediction at position t equals the inference forward over a sequence whose last j - 1
    inputs are the drafter's own earlier predictions: the context it has at depth j of a draft."""
    target = tiny_target(vocab=97, arch=arch)
    drafter = TD.new_drafter(target, num_layers=layers)
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(1)
    n = 9
    tokens = torch.randint(0, 97, (2, n), generator=g)
    feats = torch.randn(2, n, 32, generator=g)
    emb = target.get_input_embeddings()(tokens)
    with torch.no_grad():
        preds = TD.unrolled_predictions(drafter, emb, feats, 3)
        ref1 = _inference_features(drafter, tokens, feats)
        torch.testing.assert_close(preds[0], ref1, atol=1e-5, rtol=1e-5)
        for t in (2, 5, 8):
            # step 2 at t: inputs f_0 .. f_{t-1} (target), then pred1_{t-1}
            x2 = torch.cat([feats[:, :t], preds[0][:, t - 1:t]], 1)
            torch.testing.assert_close(_inference_features(drafter, tokens[:, :t + 1], x2)[:, -1], preds[1][:, t],
                                       atol=1e-5, rtol=1e-5)
            # step 3 at t: f_0 .. f_{t-2}, pred1_{t-2}, pred2_{t-1}
            x3 = torch.cat([feats[:, :t - 1], preds[0][:, t - 2:t - 1], preds[1][:, t - 1:t]], 1)
            torch.testing.assert_close(_inference_features(drafter, tokens[:, :t + 1], x3)[:, -1], preds[2][:, t],
                                       atol=1e-5, rtol=1e-5)


@pytest.fixture()
def tiny_setup(tmp_path, monkeypatch, request):
    """A tiny target folder (the shipped tokenizer's files) and random token blocks instead of the
    real data (so the test does not read ShareGPT). Llama unless parametrized (indirect) with an arch."""
    tdir = tiny_target_dir(tmp_path / "target", arch=getattr(request, "param", "llama"))

    monkeypatch.setattr(TD, "domain_blocks", fake_blocks)

    def cfg(**kw):
        base = dict(target=tdir, feature_dir=tmp_path / "features", tokens=4096, heldout_tokens=256, seq_len=64,
                    batch_size=4, eval_every=0, quiet=True, threads=1, device="cpu", warmup_steps=2)
        base.update(kw)
        base.setdefault("out", tmp_path / "out" / f"{base.get('family', 'eagle2')}-{base.get('data', 'math')}")
        base.setdefault("run_dir", tmp_path / "runs" / f"{base.get('family', 'eagle2')}-{base.get('data', 'math')}")
        return TD.DrafterTrainConfig(**base)

    return cfg, tdir


@pytest.mark.parametrize("family", ["eagle2", "hass"])
def test_tiny_run_trains_and_exports(tiny_setup, family):
    cfg, tdir = tiny_setup
    c = cfg(family=family, tokens=8192, lr=1e-2)
    summary = TD.train_drafter(c)
    assert summary["finished"] and summary["steps"] == 8192 // 64 // 4
    log = [json.loads(x) for x in (c.run_dir / "log.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in log if "loss" in r]
    assert sum(losses[-4:]) < sum(losses[:4]), losses
    if family == "hass":
        assert "acc@3" in log[-1] and "acc@2" in log[-1]
    m = json.loads((c.out / "manifest.json").read_text())
    assert m["family"] == family and m["tokens_seen"] == 8192 and m["seed"] == 0
    assert set(m["final_heldout"]) == {"math", "chat"} and "acc@3" in m["final_heldout"]["math"]
    from taps import models

    models.verify_manifest(c.out)
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(str(tdir))
    d = EagleDrafter.from_pretrained(str(c.out), target=target)
    assert d.fc.weight.dtype == torch.float32 and len(d.layers) == 1


@pytest.mark.parametrize("tiny_setup", ["qwen3"], indirect=True)
def test_qwen3_target_trains_exports_and_drafts(tiny_setup):
    """The whole path on a Qwen3 target: train, export, load, and draft losslessly (greedy output of a
    speculative decode with the trained drafter equals the target's own greedy output)."""
    cfg, tdir = tiny_setup
    c = cfg(family="hass", tokens=4096, lr=1e-2)
    summary = TD.train_drafter(c)
    assert summary["finished"]
    from transformers import AutoModelForCausalLM

    from taps.decoder import SpeculativeDecoder

    target = AutoModelForCausalLM.from_pretrained(str(tdir)).eval()
    d = EagleDrafter.from_pretrained(str(c.out), target=target, dtype=torch.float32)
    assert type(d.config).__name__ == "LlamaConfig" and d.config.head_dim == 16
    prompts = torch.randint(6, 400, (2, 12), generator=torch.Generator().manual_seed(3)).tolist()
    ref = SpeculativeDecoder(target, [], strategy="autoregressive").generate(prompts, max_new_tokens=24,
                                                                               temperature=0.0)
    out = SpeculativeDecoder(target, [d], strategy="single", depth=4, top_k=3, budget=12).generate(
        prompts, max_new_tokens=24, temperature=0.0)
    assert out.tokens == ref.tokens
    assert out.summary["tau"] >= 1.0


def assert_resume_equals_uninterrupted(cfg, tmp_path, stop: int, **kw) -> None:
    """A run stopped after `stop` steps and resumed exports the weights of the finished run
    ``tmp_path/out/full`` (same settings `kw`), bit for bit."""
    from taps.train.cli import train_drafter_family

    part = cfg(**kw, run_dir=tmp_path / "runs" / "part", out=tmp_path / "out" / "part", max_steps=stop)
    assert not train_drafter_family(part)["finished"]
    part.max_steps = None
    train_drafter_family(part)
    a = EagleDrafter.from_pretrained(str(tmp_path / "out" / "full")).state_dict()
    b = EagleDrafter.from_pretrained(str(part.out)).state_dict()
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=0, rtol=0, msg=k)


def test_resume_equals_uninterrupted(tiny_setup, tmp_path):
    cfg, _ = tiny_setup
    TD.train_drafter(cfg(family="hass", data="mixed", run_dir=tmp_path / "runs" / "full",
                         out=tmp_path / "out" / "full"))
    assert_resume_equals_uninterrupted(cfg, tmp_path, 5, family="hass", data="mixed")


def test_mixed_uses_both_domains_and_average(tiny_setup, tmp_path):
    cfg, tdir = tiny_setup
    for data in ("math", "chat", "mixed"):
        TD.train_drafter(cfg(data=data))
    log = [json.loads(x) for x in (tmp_path / "runs" / "eagle2-mixed" / "log.jsonl").read_text().splitlines()]
    seen = {k: sum(r["blocks"][k] for r in log if "blocks" in r) for k in ("math", "chat")}
    assert seen == {"math": 32, "chat": 32}
    out = tmp_path / "out" / "eagle2-avg"
    TD.average_checkpoints([tmp_path / "out" / "eagle2-math", tmp_path / "out" / "eagle2-chat"], out, tdir)
    sa, sb, sm = (EagleDrafter.from_pretrained(str(tmp_path / "out" / n), dtype=torch.float32).state_dict()
                  for n in ("eagle2-math", "eagle2-chat", "eagle2-avg"))
    for k in sa:
        torch.testing.assert_close(sm[k], ((sa[k] + sb[k]) / 2).to(torch.bfloat16).float(), atol=1e-2, rtol=1e-2)
    m = json.loads((out / "manifest.json").read_text())
    assert m["data"] == "avg" and len(m["inputs"]) == 2


def test_bad_config():
    with pytest.raises(ValueError, match="family"):
        TD.DrafterTrainConfig(family="medusa")
    with pytest.raises(ValueError, match="data"):
        TD.DrafterTrainConfig(data="code")
    with pytest.raises(ValueError, match="tokens"):
        TD.DrafterTrainConfig(tokens=0)


def test_weights_sha256_single_and_sharded(tmp_path):
    """The target's weights digest: the file's own sha256 for one model.safetensors (as the shipped
    manifests record it), a digest over every shard otherwise (real targets are sharded)."""
    from taps.files import sha256_file, weights_sha256

    target = tiny_target(vocab=97)
    one, sharded = tmp_path / "one", tmp_path / "sharded"
    target.save_pretrained(str(one))
    target.save_pretrained(str(sharded), max_shard_size="20KB")
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) > 1
    assert weights_sha256(one) == sha256_file(one / "model.safetensors")
    before = weights_sha256(sharded)
    assert len(before) == 64 and before != weights_sha256(one)
    with open(shards[-1], "r+b") as f:  # change one byte of the last shard's payload (size unchanged)
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 1]))
    import os
    os.utime(shards[-1], ns=(1, 1))  # a new mtime: the remembered digest is not reused
    assert weights_sha256(sharded) != before
    with pytest.raises(FileNotFoundError, match="weights"):
        weights_sha256(tmp_path)


def test_bf16_target_features(tiny_setup, tmp_path):
    """--target-dtype bfloat16: the features come from the target in bf16 (close to the fp32 ones, not
    equal), the cache records the dtype (an fp32 cache is not reused), and the run trains and exports."""
    cfg, _ = tiny_setup
    TD.train_drafter(cfg(tokens=1024, run_dir=tmp_path / "r32", out=tmp_path / "o32"))
    f32 = (tmp_path / "features" / "math" / "train.bf16").read_bytes()
    c = cfg(tokens=1024, target_dtype="bfloat16", run_dir=tmp_path / "r16", out=tmp_path / "o16")
    assert TD.train_drafter(c)["finished"]
    index = json.loads((tmp_path / "features" / "math" / "index.json").read_text())
    assert index["key"]["target_dtype"] == "bfloat16"
    f16 = (tmp_path / "features" / "math" / "train.bf16").read_bytes()
    a, b = (torch.frombuffer(bytearray(x), dtype=torch.bfloat16).float() for x in (f32, f16))
    assert not torch.equal(a, b) and (a - b).abs().max() < 0.1 and (a - b).abs().mean() < 0.01
    assert json.loads((c.out / "manifest.json").read_text())["train_config"]["target_dtype"] == "bfloat16"
