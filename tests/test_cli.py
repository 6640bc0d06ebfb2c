"""The `taps` command line on user errors: one clear line on stderr, a non-zero exit, no traceback."""

import shutil

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
    weights = models / "target" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    monkeypatch.setenv("TAPS_MODELS_DIR", str(models))
    _one_line_error(capsys, cli.main(["demo", "--quick"]), "model.safetensors", "does not match")


def test_unknown_names_and_bad_values(capsys, monkeypatch):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--families", "eagle9", "--limit", "1"])
    assert e.value.code not in (0, None) and "eagle9" in str(e.value.code)
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--benchmarks", "gsm9k"])
    assert e.value.code not in (0, None) and "gsm9k" in str(e.value.code)
    _one_line_error(capsys, cli.main(["train", "drafter", "--family", "eagle2", "--tokens", "-5"]),
                    "taps train drafter: error", "tokens")
    with pytest.raises(SystemExit) as e:  # argparse: an unknown choice is a usage error
        cli.main(["demo", "--family", "nonesuch"])
    assert e.value.code == 2


def test_traceback_on_request(monkeypatch, tmp_path):
    monkeypatch.setenv("TAPS_MODELS_DIR", str(tmp_path / "nowhere"))
    monkeypatch.setenv("TAPS_TRACEBACK", "1")
    with pytest.raises(FileNotFoundError):
        cli.main(["demo", "--quick"])
