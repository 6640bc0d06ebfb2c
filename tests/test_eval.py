"""`taps eval` (taps.eval) and the model loaders (taps.models) on a tiny random target, fp32 on CPU.

1. evaluate() over two benchmarks, five rows, temperatures 0 and 1: the result structure, finite
   tau >= 1, identical greedy outputs across rows, routing shares summing to 1, measured tree sizes
   within the configured ones; format_tables names every row.
2. run_eval() on a models folder written like the shipped one (HF target + tokenizer + manifest, drafters
   in models/drafters/<family>-<data>): the JSON and the PNG are written, absent rows are skipped.
3. The manifest check: a flipped byte or a missing file raises ValueError naming the file; a missing
   drafter raises FileNotFoundError listing the available ones.

The target uses the project's real tokenizer (models/tokenizer, 8192 tokens) with hidden size 32, so the
real evaluation prompts can be rendered and decoded; the EAGLE heads are built to draft it well.
"""

import argparse
import json
import math
import shutil
from pathlib import Path

import pytest
import torch
import transformers

import taps_ops  # noqa: F401
from taps import EagleDrafter, average_drafters
from taps import cli
from taps import eval as taps_eval
from taps import models as taps_models
from taps.chat import ChatTokenizer

pytestmark = pytest.mark.usefixtures("one_thread")

REPO = Path(__file__).resolve().parents[1]
TOKENIZER = REPO / "models" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SETTINGS = dict(max_new_tokens=8, depth=3, top_k=4, budget=10, batch_size=2)
ROWS = ["math", "chat", "avg", "route-confidence", "merged"]

_STATE = {}


def _models():
    """Tiny target (hidden 32, the real 8192-token vocabulary), three EAGLE heads, the tokenizer.

    The target's layers are damped so that it is nearly a bigram model, and the EAGLE heads are made to
    draft that bigram model (``fc`` passes the token embedding through, the layer is an identity), the
    "math" head exactly and the "chat" head with noise: the heads then get drafts accepted (tau > 1),
    which the greedy-equality check needs to mean something.
    """
    if not _STATE:
        tok = ChatTokenizer.from_pretrained(TOKENIZER)
        config = transformers.LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          max_position_embeddings=1024, initializer_range=0.1,
                                          tie_word_embeddings=False, bos_token_id=tok.bos_id,
                                          eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
        torch.manual_seed(1)
        target = transformers.LlamaForCausalLM(config).eval()
        with torch.no_grad():
            target.lm_head.weight.mul_(4.0)
            for layer in target.model.layers:
                layer.self_attn.o_proj.weight.mul_(0.3)
                layer.mlp.down_proj.weight.mul_(0.3)
        head_cfg = transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})
        hidden = config.hidden_size
        heads = {}
        for name, seed, noise in (("math", 5, 0.0), ("chat", 6, 0.6)):
            torch.manual_seed(seed)
            head = EagleDrafter(head_cfg)
            with torch.no_grad():
                head.fc.weight.zero_()
                head.fc.weight[:, :hidden] = torch.eye(hidden) + noise * torch.randn(hidden, hidden) / hidden ** 0.5
                head.fc.bias.zero_()
                head.layers[0].self_attn.o_proj.weight.zero_()
                head.layers[0].mlp.down_proj.weight.zero_()
            head.bind(target)
            heads[name] = head
        heads["avg"] = average_drafters([heads["math"], heads["chat"]])
        _STATE.update(tok=tok, target=target, heads=heads)
    return _STATE


@pytest.fixture(scope="module")
def results():
    m = _models()
    return taps_eval.evaluate(m["target"], m["tok"], {"eagle2": m["heads"]}, ["gsm8k", "svamp"], ROWS,
                              temperatures=[0.0, 1.0], limit=2, seed=3, progress=False, **SETTINGS)


def test_evaluate_structure(results):
    cells = results["cells"]
    assert len(cells) == len(ROWS) * 2 * 2
    assert results["notes"] == []
    for c in cells:
        assert c["prompts"] == 2
        assert math.isfinite(c["tau"]) and c["tau"] >= 1.0
        assert len(c["acceptance_rate_per_depth"]) == SETTINGS["depth"]
        assert all(0.0 <= r <= 1.0 for r in c["acceptance_rate_per_depth"])
        assert 1.0 <= c["nodes_per_step"] <= c["nodes_max"]
        assert c["nodes_max"] == (2 * (SETTINGS["budget"] - 1) + 1 if c["row"] == "merged" else SETTINGS["budget"])
        if c["temperature"] == 0.0:
            assert c["greedy_mismatches"] == 0, c
        else:
            assert c["greedy_mismatches"] is None
        if c["row"] == "route-confidence":
            assert set(c["route_share"]) == {"math", "chat"}
            assert sum(c["route_share"].values()) == pytest.approx(1.0)
        if c["row"] == "merged":
            assert set(c["drafter_share"]) == {"math", "chat"}
    assert results["greedy_mismatches"] == 0
    assert max(c["tau"] for c in cells if c["temperature"] == 0.0) > 1.2  # drafts do get accepted
    assert results["config"]["greedy_reference_row"] == "eagle2/math"
    for t in ("0", "1"):
        table = results["tables"]["eagle2"][t]
        assert list(table) == ROWS
        for row in ROWS:
            assert set(table[row]) == {"gsm8k", "svamp", "avg", "nodes", "tokens_per_s"}
            assert table[row]["tokens_per_s"] > 0
            assert table[row]["avg"] == pytest.approx((table[row]["gsm8k"] + table[row]["svamp"]) / 2)
        shares = results["routing"]["eagle2"][t]["route-confidence"]
        assert set(shares) == {"gsm8k", "svamp"}
        assert all(sum(s.values()) == pytest.approx(1.0) for s in shares.values())
    json.dumps(results)  # serialisable as it is


def test_per_prompt_tau_and_standard_error(results):
    import statistics

    for c in results["cells"]:
        taus = [t for t in c["tau_per_prompt"] if t == t]
        assert len(c["tau_per_prompt"]) == c["prompts"]
        assert abs(c["tau"] - sum(taus) / len(taus)) < 1e-12
        if len(taus) > 1:
            assert abs(c["tau_se"] - statistics.stdev(taus) / len(taus) ** 0.5) < 1e-12


def test_format_tables(results):
    text = taps_eval.format_tables(results)
    for row in ROWS:
        assert row in text
    assert "eagle2, temperature 0" in text and "eagle2, temperature 1" in text
    assert "routed to math / chat" in text
    assert "*" in text


def test_greedy_mismatch_is_reported(monkeypatch, capsys):
    """A row whose greedy output differs from the first row's is counted and warned about."""
    from taps.decoder import SpeculativeDecoder
    real = SpeculativeDecoder.generate

    def generate(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if self.strategy.name == "merged":
            out.tokens[0][-1] = (out.tokens[0][-1] + 1) % 8192
        return out

    monkeypatch.setattr(SpeculativeDecoder, "generate", generate)
    m = _models()
    out = taps_eval.evaluate(m["target"], m["tok"], {"eagle2": m["heads"]}, ["svamp"], ["math", "merged"],
                             temperatures=[0.0], limit=2, progress=False, **SETTINGS)
    assert [c["greedy_mismatches"] for c in out["cells"]] == [0, 1]
    assert out["cells"][1]["greedy_mismatch_prompts"] == [0]
    assert out["greedy_mismatches"] == 1
    assert "WARNING" in capsys.readouterr().err
    assert "WARNING" in taps_eval.format_tables(out)


def test_absent_rows_are_skipped():
    m = _models()
    out = taps_eval.evaluate(m["target"], m["tok"], {"eagle2": {"math": m["heads"]["math"]}},
                             {"mine": [[{"role": "user", "content": "What is 2 + 3?"}]]},
                             ["math", "mixed", "merged"], temperatures=[0.0], progress=False, **SETTINGS)
    assert [c["row"] for c in out["cells"]] == ["math"]
    assert any("mixed" in n for n in out["notes"]) and any("merged" in n for n in out["notes"])


def _manifest(folder: Path) -> None:
    from taps.train.tokenizer import file_hashes
    (folder / "manifest.json").write_text(json.dumps({"kind": "test", "files": file_hashes(folder)}))


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory):
    """A models folder laid out like the shipped one."""
    m = _models()
    root = tmp_path_factory.mktemp("models")
    target_dir = root / "target"
    m["target"].save_pretrained(str(target_dir))
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER / name, target_dir / name)
    _manifest(target_dir)
    for name, head in m["heads"].items():
        folder = root / "drafters" / f"eagle2-{name}"
        head.save_pretrained(str(folder))
        _manifest(folder)
    return root


def test_loaders(models_dir):
    target, tok = taps_models.load_target(models_dir / "target")
    assert tok.eos_id == _models()["tok"].eos_id and not target.training
    assert taps_models.available_drafters(models_dir / "drafters") == {"eagle2": ["avg", "chat", "math"]}
    d = taps_models.load_drafter("eagle2", "chat", target, models_dir / "drafters")
    ref = _models()["heads"]["chat"]
    assert torch.equal(d.fc.weight, ref.fc.weight)
    with pytest.raises(FileNotFoundError, match="eagle2-avg, eagle2-chat, eagle2-math"):
        taps_models.load_drafter("hass", "math", target, models_dir / "drafters")
    with pytest.raises(FileNotFoundError, match="no target"):
        taps_models.load_target(models_dir / "nowhere")


def test_taps_eval_command_writes_json_and_png(models_dir, tmp_path, capsys):
    """`taps eval ...` through the command line: exit status 0 (no greedy mismatch), the tables, the
    JSON and the PNG."""
    status = cli.main(["eval", "--models", str(models_dir), "--benchmarks", "svamp", "--families", "eagle2,hass",
                       "--strategies", "math,chat,mixed,avg,merged", "--temperatures", "0", "--limit", "2",
                       "--max-new-tokens", "6", "--depth", "3", "--top-k", "4", "--budget", "10",
                       "--batch-size", "2", "--out", str(tmp_path / "eval" / "results.json"),
                       "--plot", str(tmp_path / "eval" / "depth.png"), "--no-progress", "--device", "cpu"])
    assert status == 0
    out = capsys.readouterr().out
    assert "eagle2, temperature 0" in out and "skipped" in out
    saved = json.loads((tmp_path / "eval" / "results.json").read_text())
    assert saved["config"]["limit"] == 2 and "command" in saved["config"]
    assert [c["row"] for c in saved["cells"]] == ["math", "chat", "avg", "merged"]
    assert saved["greedy_mismatches"] == 0
    assert any("hass" in n for n in saved["notes"]) and any("mixed" in n for n in saved["notes"])
    assert (tmp_path / "eval" / "depth.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_manifest_catches_corruption(models_dir, tmp_path):
    folder = tmp_path / "eagle2-math"
    shutil.copytree(models_dir / "drafters" / "eagle2-math", folder)
    taps_models.verify_manifest(folder)  # intact
    weights = folder / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="model.safetensors"):
        taps_models.verify_manifest(folder)
    with pytest.raises(ValueError, match="model.safetensors"):
        taps_models.load_drafter("eagle2", "math", _models()["target"], tmp_path)
    (folder / "config.json").unlink()
    with pytest.raises(ValueError, match="config.json"):
        taps_models.verify_manifest(folder)


def test_merge_results_equals_one_run(results, tmp_path, capsys):
    """Result files of separate runs (here one per temperature) merged with --merge give the same tables
    as the run that had them all."""
    by_temp = {}
    for c in results["cells"]:
        by_temp.setdefault(c["temperature"], []).append(c)
    assert len(by_temp) == 2
    parts = []
    for temp, cells in by_temp.items():
        part = json.loads(json.dumps(taps_eval._finite({**results, "cells": cells})))
        path = tmp_path / f"t{temp}.json"
        path.write_text(json.dumps(part))
        parts.append(str(path))
    p = argparse.ArgumentParser()
    taps_eval.add_eval_arguments(p)
    merged = taps_eval.run_eval(p.parse_args(["--merge", *parts, "--out", str(tmp_path / "all.json"), "--plot", ""]))
    assert json.loads(json.dumps(taps_eval._finite(merged["tables"]))) == \
        json.loads(json.dumps(taps_eval._finite(results["tables"])))
    assert merged["greedy_mismatches"] == results["greedy_mismatches"]
    assert "temperature 0" in capsys.readouterr().out


def test_merge_later_cells_replace_earlier(results):
    rerun = json.loads(json.dumps(taps_eval._finite(results)))
    for c in rerun["cells"]:
        c["tau"] = 9.0
    rerun["cells"] = [c for c in rerun["cells"] if c["row"] == "merged"]
    merged = taps_eval.merge_results([json.loads(json.dumps(taps_eval._finite(results))), rerun])
    assert len(merged["cells"]) == len(results["cells"])
    for temps in merged["tables"].values():
        for rows in temps.values():
            assert rows["merged"]["avg"] == 9.0 and rows["math"]["avg"] != 9.0


def test_run_eval_eagle3_family(models_dir, tmp_path, capsys):
    """`taps eval --families eagle3` loads EAGLE-3 heads from the drafters folder (as from_pretrained
    recognises them) and evaluates them, losslessly, beside another family."""
    from taps.eagle3 import Eagle3Drafter, vocab_mapping

    root = tmp_path / "models"
    shutil.copytree(models_dir / "target", root / "target")
    shutil.copytree(models_dir / "drafters" / "eagle2-math", root / "drafters" / "eagle2-math")
    target = _models()["target"]
    vocab = target.config.vocab_size
    for name, seed in (("math", 1), ("chat", 2)):
        cfg = transformers.LlamaConfig(**{**target.config.to_dict(), "num_hidden_layers": 1, "draft_vocab_size": 512,
                                          "eagle_aux_hidden_state_layer_ids": [0, 1]})
        torch.manual_seed(seed)
        head = Eagle3Drafter(cfg)
        head.set_vocab_mapping(vocab_mapping(torch.arange(512) * 16, vocab)[0])
        head.bind(target)
        head.save_pretrained(str(root / "drafters" / f"eagle3-{name}"))
        _manifest(root / "drafters" / f"eagle3-{name}")
    p = argparse.ArgumentParser()
    taps_eval.add_eval_arguments(p)
    args = p.parse_args(["--models", str(root), "--benchmarks", "svamp", "--families", "eagle2,eagle3",
                         "--strategies", "math,merged", "--temperatures", "0", "--limit", "2",
                         "--max-new-tokens", "6", "--depth", "3", "--top-k", "4", "--budget", "10",
                         "--batch-size", "2", "--out", str(tmp_path / "results.json"), "--plot", "",
                         "--no-progress", "--device", "cpu"])
    results = taps_eval.run_eval(args)
    assert "eagle3, temperature 0" in capsys.readouterr().out
    cells = {(c["family"], c["row"]) for c in results["cells"]}
    assert {("eagle3", "math"), ("eagle3", "merged"), ("eagle2", "math")} <= cells
    assert results["greedy_mismatches"] == 0
