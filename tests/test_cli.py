"""The `taps` command line on user errors: one clear line on stderr, a non-zero exit, no traceback."""

import os
import shutil
import subprocess
import sys

import pytest

from taps import cli
from taps.data import REPO_ROOT

pytestmark = pytest.mark.usefixtures("one_thread")


def _one_line_error(capsys, rc, *words):
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    for w in words:
        assert w in err, err


def test_missing_and_corrupted_model_files(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TAPS_MODELS_DIR", str(tmp_path / "nowhere"))
    _one_line_error(capsys, cli.main(["demo", "--quick"]), "taps demo: error", "no target model")
    models = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "models" / "target", models / "target")
    for name in ("hass-math", "hass-chat"):  # the demo's drafters are present: the target's file is what fails
        shutil.copytree(REPO_ROOT / "models" / "drafters" / name, models / "drafters" / name)
    weights = models / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    monkeypatch.setenv("TAPS_MODELS_DIR", str(models))
    _one_line_error(capsys, cli.main(["demo", "--quick"]), "model.safetensors", "does not match")


def test_missing_token_store(capsys):
    _one_line_error(capsys, cli.main(["demo", "--quick", "--store", "nonesuch"]), "taps demo: error",
                    "no token store", "taps train store")


# (argv, words the error line must hold): bad values and names of every subcommand; each must fail
# before a model or a data file is read
BAD_ARGUMENTS = [
    (["demo", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["demo", "--max-new-tokens", "-5"], "--max-new-tokens"),
    (["demo", "--threads", "-3"], "--threads"),
    (["demo", "--strategy", "bogus"], "bogus"),
    (["demo", "--family", "nonesuch"], "nonesuch"),
    (["demo", "--limit", "-1"], "--limit"),
    (["demo", "--depth", "0"], "--depth"),
    (["demo", "--top-k", "x"], "--top-k"),
    (["demo", "--budget", "1"], "--budget"),
    (["demo", "--draft-vocab", "-1"], "--draft-vocab"),
    (["demo", "--dtype", "fp8"], "--dtype"),
    (["demo", "--device", "tpu"], "--device"),
    (["demo", "--bogus"], "--bogus"),
    (["demo", "--strategy", "average", "--lookup"], "--lookup"),
    (["eval", "--limit", "-2"], "--limit"),
    (["eval", "--families", "eagle9"], "eagle9"),
    (["eval", "--benchmarks", "gsm9k"], "gsm9k"),
    (["eval", "--strategies", "merged,nope"], "nope"),
    (["eval", "--temperatures", "abc"], "--temperatures"),
    (["eval", "--temperatures", "0,-1"], "--temperatures"),
    (["eval", "--max-new-tokens", "0"], "--max-new-tokens"),
    (["eval", "--batch-size", "0"], "--batch-size"),
    (["eval", "--threads", "-1"], "--threads"),
    (["eval", "--device", "bogus"], "--device"),
    (["eval", "--dtype", "fp8"], "--dtype"),
    (["eval", "--merge", "/nonexistent/results.json"], "results.json"),
    (["tour", "--bogus"], "--bogus"),
    (["info", "--bogus"], "--bogus"),
    (["train", "tokenizer", "--vocab-size", "x"], "--vocab-size"),
    (["train", "store", "--math", "-1"], "--math"),
    (["train", "store", "--new-tokens", "0"], "--new-tokens"),
    (["train", "store", "--temperature", "-1"], "--temperature"),
    (["train", "tokenizer", "--chat-fraction", "2"], "--chat-fraction"),
    (["train", "target", "--tokens", "0"], "--tokens"),
    (["train", "target", "--lr", "0"], "--lr"),
    (["train", "target", "--preset", "huge"], "huge"),
    (["train", "target", "--batch-size", "0"], "--batch-size"),
    (["train", "drafter", "--family", "eagle2", "--tokens", "-5"], "--tokens"),
    (["train", "drafter", "--family", "medusa"], "medusa"),
    (["train", "drafter", "--max-steps", "0"], "--max-steps"),
    (["train", "drafter", "--micro-batch", "-1"], "--micro-batch"),
    (["train", "average", "/nonexistent/a", "/nonexistent/b", "--out", "/nonexistent/c"], "/nonexistent/a"),
    (["train", "average", "--out", "x"], "inputs"),
    (["train", "vocab", "--tokens", "0"], "--tokens"),
    (["serve", "--port", "70000"], "--port"),
    (["serve", "--max-batch", "0"], "--max-batch"),
    (["serve", "--max-queue", "-1"], "--max-queue"),
    (["serve", "--timeout", "0"], "--timeout"),
    (["serve", "--budget", "1"], "--budget"),
    (["serve", "--dtype", "fp8"], "--dtype"),
    (["serve", "--drafter", "x=medusa"], "medusa"),
    (["serve", "--drafter", "x=eagle:/nonexistent/head"], "/nonexistent/head"),
    (["serve", "--drafter", "x=shipped:hass-algebra"], "hass-algebra"),
    (["serve", "--drafter", "lookup"], "NAME=KIND"),
    (["serve", "--target", "/nonexistent/model"], "/nonexistent/model"),
    (["serve", "--strategy", "nope"], "nope"),
    (["serve", "--strategy", "single", "--default-drafters", "math,chat"], "exactly one drafter"),
    (["serve", "--default-drafters", "math,nope"], "nope"),
    (["serve", "--config", "/nonexistent/serve.toml"], "serve.toml"),
    (["train"], "train_command"),
    ([], "command"),
    (["bogus"], "bogus"),
]


@pytest.fixture
def nothing_loads(monkeypatch):
    """Every loader of models and training data raises: a command that reaches one has not checked its
    arguments first."""
    import taps.train.drafter
    import taps.train.target
    import taps.train.tokenizer
    import taps.train.vocab
    from taps import models

    def loaded(*args, **kwargs):
        raise AssertionError("a model or data loader ran before the arguments were checked")

    for module, name in ((models, "load_target"), (models, "load_drafter"), (taps.train.target, "train_target"),
                         (taps.train.drafter, "train_drafter"), (taps.train.tokenizer, "mixed_corpus"),
                         (taps.train.vocab, "write_token_counts")):
        monkeypatch.setattr(module, name, loaded)


def _prog(argv):
    """The command an error line names: taps, taps <command> or taps train <subcommand>."""
    if argv[:1] == ["train"] and len(argv) > 1:
        return "taps train " + argv[1]
    return "taps " + argv[0] if argv and argv[0] in ("demo", "eval", "tour", "train", "serve", "info") else "taps"


def _exit_status(argv):
    try:
        return cli.main(argv)
    except SystemExit as e:  # argparse's errors exit from inside parse_args
        return e.code


@pytest.mark.parametrize("argv, word", BAD_ARGUMENTS, ids=[" ".join(a) or "(nothing)" for a, _ in BAD_ARGUMENTS])
def test_bad_arguments_fail_in_one_line_before_loading(argv, word, capsys, nothing_loads):
    _one_line_error(capsys, _exit_status(argv), f"{_prog(argv)}: error: ", word)


def test_bad_arguments_in_a_real_process():
    """The same line from the installed entry points, in a fresh interpreter (no traceback on stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT / "python")}
    for argv, prog in ((["-m", "taps.cli", "demo", "--max-new-tokens", "-5"], "taps demo"),
                       (["-m", "taps.eval", "--limit", "-2"], "taps eval"),
                       (["-m", "taps.train", "drafter", "--tokens", "0"], "taps train drafter"),
                       (["-m", "taps.train", "vocab", "--tokens", "0"], "taps train vocab")):
        run = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, timeout=120)
        err = [line for line in run.stderr.splitlines() if "cpp_extension" not in line]  # torch's CUDA_HOME note
        assert run.returncode == 2 and len(err) == 1 and err[0].startswith(f"{prog}: error: "), run.stderr
        assert run.stdout == ""


def test_no_verify_on_a_truncated_weights_file(tmp_path, monkeypatch, capsys):
    """Without the manifest check a truncated safetensors file is still one line, naming the folder."""
    models = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "models" / "target", models / "target")
    shutil.copytree(REPO_ROOT / "models" / "drafters" / "eagle2-math", models / "drafters" / "eagle2-math")
    weights = models / "target" / "model.safetensors"
    for size in (weights.stat().st_size // 2, 5):
        weights.write_bytes(weights.read_bytes()[:size])
        rc = cli.main(["eval", "--models", str(models), "--families", "eagle2", "--strategies", "math",
                       "--no-verify", "--no-progress", "--plot", "", "--out", str(tmp_path / "r.json")])
        _one_line_error(capsys, rc, "taps eval: error: ", str(models / "target"), "model.safetensors",
                        "truncated or corrupted")


def test_missing_training_data_says_where_it_comes_from(tmp_path, capsys):
    rc = cli.main(["train", "tokenizer", "--shared-data", str(tmp_path), "--out", str(tmp_path / "tok")])
    _one_line_error(capsys, rc, "taps train tokenizer: error: ", str(tmp_path / "gsm8k" / "train.jsonl"),
                    "github.com/openai/grade-school-math", "JSON Lines", "docs/TRAINING.md")


def test_traceback_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPS_MODELS_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("TAPS_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["demo", "--quick"])


def test_info_reports_this_installation(capsys):
    """`taps info`: the facts as the library and torch give them, as text and as JSON."""
    import json

    import torch

    import taps_ops

    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    cpu = taps_ops.cpu_info()
    assert f"taps kernels at {cpu['isa']}" in text and f"torch {torch.__version__}" in text
    assert ("CUDA kernels: yes" if taps_ops.has_cuda_kernels() else "CUDA kernels: no") in text
    assert "--device auto -> " in text and "shipped models in " in text
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["cpu"]["ops"] == cpu["ops"] and report["library"]["cuda_kernels"] == taps_ops.has_cuda_kernels()
    assert len(report["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert report["models"]["target"] and "hass" in report["models"]["drafters"]
    assert report["models"]["stores"] == ["greedy"] and "token stores greedy" in text


def test_info_verify_names_a_corrupted_file(tmp_path, monkeypatch, capsys):
    models = tmp_path / "models"
    shutil.copytree(REPO_ROOT / "models" / "target", models / "target")
    shutil.copytree(REPO_ROOT / "models" / "drafters" / "hass-math", models / "drafters" / "hass-math")
    shutil.copytree(REPO_ROOT / "models" / "stores" / "greedy", models / "stores" / "greedy")
    monkeypatch.setenv("TAPS_MODELS_DIR", str(models))
    assert cli.main(["info", "--verify"]) == 0
    assert "3 of 3 folders match" in capsys.readouterr().out
    weights = models / "drafters" / "hass-math" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[0] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert cli.main(["info", "--verify"]) == 1
    out = capsys.readouterr().out
    assert "2 of 3 folders match" in out and "hass-math: FAILED" in out and "model.safetensors" in out, out
