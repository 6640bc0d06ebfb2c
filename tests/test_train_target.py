"""Target training on a tiny config: loss goes down, a stopped run resumes to exactly the same loss
curve and weights as an uninterrupted one, and the export loads with transformers."""

import json

import pytest
import torch

from taps.data import Example
from taps.train.target import TargetTrainConfig, token_data_from_examples, train_target

CHAT = ["Hello! How can I help you today?", "Tell me a short story about a cat.",
        "Once upon a time a cat sat on a mat and watched the birds.", "Thanks, that was nice."]
MATH = ["Tom has 3 apples and buys 4 more. How many?", "3 + 4 = 7\n#### 7",
        "What is 12 * 2?", "12 * 2 = 24\n#### 24"]


def conv(i, texts, dom):
    return Example(f"{dom}/{i}", dom, [{"role": "user", "content": texts[i % 2 * 2] + f" ({i})"},
                                       {"role": "assistant", "content": texts[i % 2 * 2 + 1]}])


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    from taps.train.tokenizer import train_tokenizer

    torch.set_num_threads(1)
    tdir = tmp_path_factory.mktemp("tok")
    tok = train_tokenizer((CHAT + MATH) * 20, tdir, vocab_size=300)
    examples = {"chat": [conv(i, CHAT, "chat") for i in range(60)], "math": [conv(i, MATH, "math") for i in range(60)]}
    data = token_data_from_examples(examples, tok, tokens=4 * 32 * 10, math_fraction=0.5, heldout_tokens=64,
                                    seq_len=32, seed=0)
    return tdir, tok, data


def config(tmp_path, tdir, name, **kw):
    base = dict(tokenizer=tdir, out=tmp_path / f"{name}-out", run_dir=tmp_path / f"{name}-run", preset="tiny",
                seq_len=32, batch_size=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_every=4, threads=1,
                ckpt_minutes=60, device="cpu", quiet=True)
    base.update(kw)
    return TargetTrainConfig(**base)


def losses(run_dir):
    return [json.loads(ln) for ln in (run_dir / "log.jsonl").read_text().splitlines()]


def test_data_mix_and_heldout(setup):
    _, _, data = setup
    assert data.train.shape == (40, 32) and data.train.dtype == torch.int32
    counts = torch.bincount(data.domain.long(), minlength=2).tolist()
    assert counts == [20, 20]  # chat, math: half of the tokens each
    assert data.heldout["chat"].shape == data.heldout["math"].shape == (2, 32)


def test_loss_decreases_resume_is_exact_and_export_loads(tmp_path, setup):
    tdir, tok, data = setup
    full = train_target(config(tmp_path, tdir, "a"), data=data, tok=tok)
    assert full["finished"] and full["steps"] == 10 and full["tokens_seen"] == 10 * 4 * 32
    log_a = losses(tmp_path / "a-run")
    train_losses = [r["loss"] for r in log_a if "loss" in r]
    assert sum(train_losses[-3:]) < sum(train_losses[:3])
    assert [r["step"] for r in log_a if "heldout" in r] == [4, 8, 10]

    # stop after step 5, leave a stray log line as a killed run would, then rerun the same command
    part = train_target(config(tmp_path, tdir, "b", max_steps=5), data=data, tok=tok)
    assert not part["finished"] and part["steps"] == 5 and not (tmp_path / "b-out").exists()
    with open(tmp_path / "b-run" / "log.jsonl", "a") as f:
        f.write(json.dumps({"step": 6, "loss": 99.0}) + "\n")
    rest = train_target(config(tmp_path, tdir, "b"), data=data, tok=tok)
    assert rest["finished"] and rest["tokens_seen"] == full["tokens_seen"]
    strip = lambda log: [{k: v for k, v in r.items() if k != "elapsed_s"} for r in log]  # noqa: E731
    assert strip(losses(tmp_path / "b-run")) == strip(log_a)
    man_a = json.loads((tmp_path / "a-out" / "manifest.json").read_text())
    man_b = json.loads((tmp_path / "b-out" / "manifest.json").read_text())
    assert man_a["files"]["model.safetensors"] == man_b["files"]["model.safetensors"]

    # the export: a Hugging Face folder with the tokenizer and a manifest
    from transformers import AutoTokenizer, LlamaForCausalLM

    from taps.train.tokenizer import file_hashes

    out = tmp_path / "a-out"
    assert man_a["files"] == file_hashes(out)
    assert man_a["steps"] == 10 and man_a["seed"] == 0 and set(man_a["final_heldout_loss"]) == {"chat", "math"}
    model = LlamaForCausalLM.from_pretrained(str(out))
    assert model.dtype == torch.bfloat16 and sum(p.numel() for p in model.parameters()) == man_a["parameters"]
    hf = AutoTokenizer.from_pretrained(str(out))
    ids = hf.apply_chat_template([{"role": "user", "content": "What is 12 * 2?"}], add_generation_prompt=True,
                                 return_tensors="pt", return_dict=True)["input_ids"]
    with torch.no_grad():
        assert model(input_ids=ids).logits.shape == (1, ids.shape[1], len(hf))


def test_resume_refuses_other_settings_and_grad_accum_runs(tmp_path, setup):
    tdir, tok, data = setup
    train_target(config(tmp_path, tdir, "c", max_steps=2, grad_accum=2), data=data, tok=tok)
    with pytest.raises(RuntimeError, match="other settings"):
        train_target(config(tmp_path, tdir, "c", lr=5e-3), data=data, tok=tok)
