"""The shipped models (models/): manifests and sha256, losslessness of speculative greedy decoding with
every strategy, and the README's main job (`taps demo`, reduced size)."""

import json

import pytest
import torch

from taps import models
from taps.decoder import SpeculativeDecoder
from taps.strategies import STRATEGIES

import engine_models as em

pytestmark = pytest.mark.usefixtures("one_thread")

FAMILIES = ("eagle2", "hass", "eagle3")
DATA = ("math", "chat", "mixed", "mixed2", "avg")


@pytest.fixture(scope="module")
def target_and_tok():
    torch.manual_seed(0)
    return models.load_target()


def test_manifests_and_sha256():
    root = models.models_dir()
    folders = [root / "tokenizer", root / "target"] + [root / "drafters" / f"{f}-{d}" for f in FAMILIES for d in DATA]
    for folder in folders:
        assert (folder / "manifest.json").is_file(), f"{folder} has no manifest"
        models.verify_manifest(folder)  # raises on a missing file or a sha256 mismatch
    total = sum(p.stat().st_size for f in folders for p in f.iterdir() if p.is_file())
    assert total < 50e6, f"shipped models are {total / 1e6:.1f} MB (limit ~50 MB)"


def test_drafter_manifests_record_the_training():
    target_sha = json.loads((models.models_dir() / "target" / "manifest.json").read_text())["files"]["model.safetensors"]
    for fam in FAMILIES:
        for d in ("math", "chat", "mixed", "mixed2"):
            m = json.loads((models.models_dir() / "drafters" / f"{fam}-{d}" / "manifest.json").read_text())
            assert m["family"] == fam and m["finished"] and m["tokens_seen"] > 0 and m["steps"] > 0
            assert m["target_sha256"] == target_sha, f"{fam}-{d} was trained on another target"
            assert m["seed"] == 0 and "final_heldout" in m and "command" in m
        mixed, mixed2 = (json.loads((models.models_dir() / "drafters" / f"{fam}-{n}" / "manifest.json").read_text())
                         for n in ("mixed", "mixed2"))
        assert abs(mixed2["tokens_seen"] - 2 * mixed["tokens_seen"]) <= 0.01 * mixed2["tokens_seen"]
        avg = json.loads((models.models_dir() / "drafters" / f"{fam}-avg" / "manifest.json").read_text())
        assert sorted(avg["inputs"]) == sorted(f"models/drafters/{fam}-{d}" for d in ("math", "chat"))


def test_specialists_specialise():
    """Held-out top-1 agreement with the target: each specialist is best on its own domain."""
    for fam in FAMILIES:
        acc = {d: json.loads((models.models_dir() / "drafters" / f"{fam}-{d}" / "manifest.json").read_text())
               ["final_heldout"] for d in ("math", "chat")}
        assert acc["math"]["math"]["acc@1"] > acc["chat"]["math"]["acc@1"]
        assert acc["chat"]["chat"]["acc@1"] > acc["math"]["chat"]["acc@1"]


def test_greedy_equals_target_for_every_strategy(target_and_tok):
    from taps.data import load_eval_prompts

    target, tok = target_and_tok
    prompts = [tok.encode_chat(load_eval_prompts(b)[i].messages, add_generation_prompt=True)
               for b, i in (("gsm8k", 3), ("mt_bench", 5))]
    ref = [em.hf_greedy(target, p, 20, tok.eos_id) for p in prompts]  # Hugging Face's own generate
    for i, strategy in enumerate(STRATEGIES):
        fam = FAMILIES[i % len(FAMILIES)]
        names = () if strategy == "autoregressive" else ("mixed",) if strategy == "single" else ("math", "chat")
        ds = [models.load_drafter(fam, n, target, verify=False) for n in names]
        out = SpeculativeDecoder(target, ds, strategy=strategy, depth=4, top_k=6, budget=20).generate(
            prompts, max_new_tokens=20, eos_token_id=tok.eos_id)
        assert out.tokens == ref, f"{strategy} ({fam}) differs from the target's greedy output"
        if strategy != "autoregressive":
            assert out.summary["tau"] > 1.3, f"{strategy} ({fam}): tau {out.summary['tau']:.2f}"


def test_eagle3_single_and_average_accept_and_stay_lossless(target_and_tok):
    """The strategies the loop above gives to other families, with the shipped EAGLE-3 heads (trained,
    so drafts are accepted; the random heads of test_eagle3 rarely are)."""
    from taps.data import load_eval_prompts

    target, tok = target_and_tok
    prompts = [tok.encode_chat(load_eval_prompts(b)[i].messages, add_generation_prompt=True)
               for b, i in (("gsm8k", 3), ("mt_bench", 5))]
    ref = [em.hf_greedy(target, p, 20, tok.eos_id) for p in prompts]
    for strategy, names in (("single", ("mixed",)), ("average", ("math", "chat"))):
        ds = [models.load_drafter("eagle3", n, target, verify=False) for n in names]
        out = SpeculativeDecoder(target, ds, strategy=strategy, depth=4, top_k=6, budget=20).generate(
            prompts, max_new_tokens=20, eos_token_id=tok.eos_id)
        assert out.tokens == ref, strategy
        assert out.summary["tau"] > 1.3, f"{strategy}: tau {out.summary['tau']:.2f}"


def test_demo_quick(capsys):
    from taps import cli

    with em.GreedyCalls() as calls:
        assert cli.main(["demo", "--quick", "--no-color", "--dtype", "fp32"]) == 0
    captured = capsys.readouterr()
    out = captured.out
    assert out.count("identical to the target's own greedy output (Hugging Face generate): True") == 2
    assert "5.2M-parameter" in out and "nonsense" in out and ", fp32, " in out
    # beside each fixed-settings answer, the same drafters with prompt lookup and a tuner: the same tokens
    assert out.count('with prompt lookup with its token store and budget="auto"') == 2
    assert out.count("; same output: True") == 2
    assert "Loading weights" not in captured.err + out  # Hugging Face's progress bar stays off
    for row in ("math", "chat", "avg", "route-confidence", "merged", "adaptive"):
        assert f"\n{row} " in out or f" {row} " in out
    assert "demo finished" in out
    # every answer the demo decoded, its table included, is the target's own (Hugging Face) greedy output
    assert {"merged", "route-confidence", "adaptive", "single"} <= calls.check(min_calls=10)


def test_demo_quick_with_prompt_lookup(capsys):
    """``--lookup`` adds taps' prompt-lookup drafter to the streamed answers (with single: it alone), which
    stay the target's own greedy output, and the share line names it."""
    from taps import cli

    for strategy in ("single", "merged-budget"):
        assert cli.main(["demo", "--quick", "--no-color", "--lookup", "--strategy", strategy, "--limit", "0",
                         "--dtype", "bf16"]) == 0
        out = capsys.readouterr().out
        # bf16: the reference is taps' own autoregressive decoding, Hugging Face's shown beside it (its bf16
        # products round as oneDNN's kernel does, taps' projections as taps' panels where those time faster: on
        # a near tie the two greedy outputs part, which the line says)
        assert out.count("identical to the target's own greedy output (taps autoregressive, same dtype): True; "
                         "to Hugging Face generate's: ") == 2, strategy
        assert out.count("to Hugging Face generate's: True") + out.count(
            "to Hugging Face generate's: False (its one-token forwards round differently in bf16)") == 2, strategy
        assert out.count("proposed by") == 2 and out.count("prompt lookup ") >= 2
        assert ("the math drafter" in out) == ("the chat drafter" in out) == (strategy != "single")


def test_ragged_batch_with_prompt_lookup_past_max_new(target_and_tok):
    """A ragged batch whose longest-prompt request finishes with a prompt-lookup chain (16 tokens, past
    the decoder's depth 3) beyond its max_new and stays in the batch: the others' trees still fit the cache
    (it was sized with the decoder's depth: "TargetForward.tree: 134 positions needed, the cache holds
    131"), and every request's tokens equal its own greedy decoding."""
    from taps import PromptLookupDrafter
    from taps.data import load_eval_prompts

    target, tok = target_and_tok
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True)
               for b in ("gsm8k", "mt_bench") for ex in load_eval_prompts(b)[:4]]
    dec = SpeculativeDecoder(target, [PromptLookupDrafter()], strategy="single")
    out = dec.generate(prompts, max_new_tokens=32, eos_token_id=tok.eos_id)
    solo = SpeculativeDecoder(target, [], strategy="autoregressive")
    assert out.tokens == [solo.generate([p], max_new_tokens=32, eos_token_id=tok.eos_id).tokens[0] for p in prompts]
    # the case the test is for: a request accepted more in one step than the decoder's depth
    assert max(max(s.accepted, default=0) for s in out.stats) > dec.depth


def test_shipped_table():
    """models/tables/sampled: its manifest holds, it was built from the shipped target (models.load_table checks
    both), and its drawn chains at T = 1 are accepted (a few prompts' tokens per step well above one)."""
    from taps import NgramTableDrafter
    from taps.data import load_eval_prompts

    folder = models.models_dir() / "tables" / "sampled"
    models.verify_manifest(folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    target_sha = json.loads((models.models_dir() / "target" / "manifest.json").read_text())["files"]["model.safetensors"]
    assert manifest["kind"] == "ngram-table" and manifest["target_weights_sha256"] == target_sha
    assert "command" in manifest and manifest["temperature"] == 1.0
    table = models.load_table()
    assert table.num_contexts == manifest["contexts"] and table.vocab_size == 8192
    target, tok = models.load_target()
    dec = SpeculativeDecoder(target, [NgramTableDrafter(table)], strategy="single", depth=3, top_k=1, budget=4,
                             sampled_drafts=True)
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True) for ex in load_eval_prompts("gsm8k")[:2]]
    out = dec.generate(prompts, max_new_tokens=48, temperature=1.0, seed=0)
    assert out.summary["tau"] > 1.3, out.summary["tau"]
