"""`taps serve`'s settings: a JSON or TOML config file and flags over it, every value checked before a model
loads (one line naming the flag or the file's key)."""

import json

import pytest

from taps import cli, models
from taps.serve.config import DrafterSpec, ServeConfig, config_from_args


def settings(tmp_path, argv, text=None, name="serve.toml"):
    """config_from_args of `taps serve argv` (with --config pointing at `text` written to `name`)."""
    if text is not None:
        (tmp_path / name).write_text(text)
        argv = ["--config", str(tmp_path / name)] + argv
    return config_from_args(cli.build_parser().parse_args(["serve", *argv]))


def model_folder(path):
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    return path


def test_defaults_serve_the_shipped_models():
    cfg = config_from_args(cli.build_parser().parse_args(["serve"]))
    assert cfg.target is None and cfg.strategy == "merged-budget" and cfg.budget == "auto"
    table = str(models.models_dir() / "tables" / "sampled" / "table.npz")
    assert cfg.drafters == {"math": DrafterSpec("shipped", "hass-math"), "chat": DrafterSpec("shipped", "hass-chat"),
                            "lookup": DrafterSpec("lookup"), "table": DrafterSpec("table", table)}
    # a request that names none drafts with the shipped n-gram table alone (the others stay for requests that name them)
    assert cfg.default_drafters is None and cfg.request_drafters() == ["table"]
    assert (cfg.host, cfg.port, cfg.max_batch, cfg.max_queue, cfg.timeout) == ("127.0.0.1", 8000, 16, 64, 600.0)
    assert ServeConfig().drafters == cfg.drafters


def test_request_drafters_of_the_shipped_defaults(tmp_path):
    """The table alone only where the server has the shipped defaults and no default drafters of its own: named
    default drafters win, and a server given its own drafters drafts with all of them."""
    assert settings(tmp_path, ["--default-drafters", "math,chat,lookup"]).request_drafters() == ["math", "chat", "lookup"]
    assert settings(tmp_path, ["--default-drafters", "none", "--strategy", "autoregressive"]).request_drafters() == []
    assert settings(tmp_path, ["--drafter", "lookup=lookup", "--drafter", "chat=shipped:hass-chat"]).request_drafters() == \
        ["lookup", "chat"]
    assert settings(tmp_path, ["--strategy", "route-confidence", "--default-drafters", "math,chat"]).request_drafters() == \
        ["math", "chat"]


def test_shipped_defaults_without_the_table(monkeypatch, tmp_path):
    """Where the shipped table is missing (a models folder without tables/sampled/table.npz), the shipped target's
    server has its other drafters and a request that names none drafts with all of them, as before the table."""
    monkeypatch.setattr(models, "models_dir", lambda: tmp_path)
    cfg = ServeConfig()
    assert list(cfg.drafters) == ["math", "chat", "lookup"] and cfg.request_drafters() == ["math", "chat", "lookup"]


TOML = """
target = "llama"              # relative to the file's folder
dtype = "bf16"
model_name = "my-llama"
strategy = "merged"
default_drafters = ["eagle", "lookup"]
budget = 24
depth = 5
top_k = 8

[drafters]
eagle = "eagle:heads/eagle3"
small = {kind = "model", path = "small-lm"}
lookup = {kind = "lookup", max_ngram = 4}

[limits]
max_batch = 4
max_queue = 8
timeout = 30
default_max_tokens = 128
max_tokens = 512
"""


def test_a_toml_file_and_the_same_settings_in_json(tmp_path):
    for sub in ("llama", "heads/eagle3", "small-lm"):
        model_folder(tmp_path / sub)
    cfg = settings(tmp_path, [], TOML)
    assert cfg.target == str(tmp_path / "llama") and cfg.dtype == "bf16" and cfg.model_name == "my-llama"
    assert cfg.drafters == {"eagle": DrafterSpec("eagle", str(tmp_path / "heads/eagle3")),
                            "small": DrafterSpec("model", str(tmp_path / "small-lm")),
                            "lookup": DrafterSpec("lookup", None, {"max_ngram": 4})}
    assert (cfg.strategy, cfg.default_drafters, cfg.budget, cfg.depth, cfg.top_k) == \
        ("merged", ["eagle", "lookup"], 24, 5, 8)
    assert (cfg.max_batch, cfg.max_queue, cfg.timeout, cfg.default_max_tokens, cfg.max_tokens) == (4, 8, 30.0, 128, 512)
    as_json = json.dumps({"target": "llama", "drafters": {"lookup": "lookup", "eagle": {"kind": "eagle",
                                                                                        "path": "heads/eagle3"}},
                          "limits": {"max_batch": 2}, "budget": "auto"})
    cfg = settings(tmp_path, [], as_json, "serve.json")
    assert cfg.drafters["eagle"].path == str(tmp_path / "heads/eagle3") and cfg.max_batch == 2
    assert cfg.budget == "auto"


def test_flags_win_over_the_file(tmp_path):
    for sub in ("llama", "heads/eagle3", "small-lm"):
        model_folder(tmp_path / sub)
    cfg = settings(tmp_path, ["--max-batch", "9", "--strategy", "merged-budget", "--drafter", "lookup=lookup",
                              "--default-drafters", "lookup", "--budget", "auto", "--port", "0"], TOML)
    assert cfg.max_batch == 9 and cfg.strategy == "merged-budget" and cfg.budget == "auto" and cfg.port == 0
    assert cfg.drafters == {"lookup": DrafterSpec("lookup")} and cfg.max_queue == 8


@pytest.mark.parametrize("text, words", [
    ('colour = "blue"', "unknown settings colour"),
    ("[limits]\nmax_batch = 0", "limits.max_batch"),
    ("[limits]\nspeed = 1", "unknown limits speed"),
    ('limits = "fast"', "limits must be a table"),
    ('budget = "lots"', "budget"),
    ("port = 1e9", "port"),
    ("max_batch = 3", "unknown settings max_batch"),
    ('strategy = "bogus"', "bogus"),
    ('dtype = "fp8"', "dtype"),
    ('[drafters]\nx = "medusa"', "medusa"),
    ('[drafters]\nx = "eagle"', "needs a path"),
    ('[drafters]\nx = "eagle:nowhere"', "not a model folder"),
    ('[drafters]\nx = {kind = "lookup", max_ngram = 0}', "max_ngram"),
    ('[drafters]\nx = {kind = "lookup", width = 3}', "width"),
    ('[drafters]\n"bad name" = "lookup"', "bad name"),
    ('[drafters]\nx = {kind = "lookup", store = "nonesuch"}', "no token store named 'nonesuch'"),
    ('[drafters]\nx = {kind = "lookup", store = "stores/none"}', "no token store at"),
    ('[drafters]\nx = {kind = "lookup", store = "s.npz"}', "no token store at"),
    ('[drafters]\nx = {kind = "lookup", store = 3}', "store must be"),
    ('[drafters]\nx = {kind = "lookup", store = "greedy", store_ngram = 0}', "store_ngram"),
    ('[drafters]\nx = "table"', "needs a path"),
    ('[drafters]\nx = "table:none.npz"', "no n-gram table at"),
    ('[drafters]\nx = {kind = "table", path = "t.npz", width = 2}', "no n-gram table at"),
    ('default_drafters = ["nope"]', "nope"),
    ('target = "nowhere"', "not a model folder"),
    ("this is = not toml", "not valid TOML"),
])
def test_bad_config_files_are_one_line_errors(tmp_path, text, words):
    with pytest.raises(ValueError) as e:
        settings(tmp_path, [], text)
    assert words in str(e.value) and "\n" not in str(e.value)


def test_lookup_with_a_token_store(tmp_path):
    """A lookup drafter's store: the name of a shipped one, or a path relative to the config file (a store
    folder or a .npz file); the engine loads it into the drafter."""
    from taps import models
    from taps.drafters import TokenStore
    from taps.serve.engine import _load_store

    cfg = settings(tmp_path, [], '[drafters]\nlookup = {kind = "lookup", store = "greedy", store_ngram = 3}')
    assert cfg.drafters["lookup"] == DrafterSpec("lookup", None, {"store": "greedy", "store_ngram": 3})
    assert _load_store("greedy", None).num_sequences == models.load_store().num_sequences
    TokenStore([[1, 2, 3]], 8).save(tmp_path / "mine.npz")
    cfg = settings(tmp_path, [], '[drafters]\nlookup = {kind = "lookup", store = "mine.npz"}')
    path = cfg.drafters["lookup"].options["store"]
    assert path == str(tmp_path / "mine.npz") and _load_store(path, None).continuation([1, 2], 3) == ([3], 2)


def test_table_drafter(tmp_path):
    """A table drafter: a .npz file or a folder holding table.npz (relative to the config file), min_count
    checked; the engine loads it into an NgramTableDrafter bound to the target."""
    import numpy as np

    from taps import NgramTable, NgramTableDrafter
    from taps.serve.engine import load_models

    table = NgramTable(np.array([0], np.uint64), [1], [0, 1], [5], [0.0], 8192, 0)
    (tmp_path / "t").mkdir()
    table.save(tmp_path / "t" / "table.npz")
    cfg = settings(tmp_path, [], '[drafters]\nt = {kind = "table", path = "t", min_count = 2}')
    assert cfg.drafters["t"] == DrafterSpec("table", str(tmp_path / "t" / "table.npz"), {"min_count": 2})
    with pytest.raises(ValueError, match="min_count"):
        settings(tmp_path, [], '[drafters]\nt = {kind = "table", path = "t/table.npz", min_count = 0}')
    with pytest.raises(ValueError, match="unknown option"):
        settings(tmp_path, [], '[drafters]\nt = {kind = "table", path = "t", store = "greedy"}')
    drafter = load_models(cfg).drafters["t"]
    assert isinstance(drafter, NgramTableDrafter) and drafter.min_count == 2 and drafter.vocab_size == 8192


def test_shipped_drafters_need_the_shipped_target(tmp_path):
    model_folder(tmp_path / "llama")
    with pytest.raises(ValueError, match="shipped drafters are trained for the shipped target"):
        settings(tmp_path, ["--target", str(tmp_path / "llama"), "--drafter", "m=shipped:hass-math"])
    assert settings(tmp_path, ["--target", str(tmp_path / "llama")]).drafters == {"lookup": DrafterSpec("lookup")}


def test_a_bad_config_file_fails_before_anything_loads(tmp_path, monkeypatch, capsys):
    from taps.serve import engine

    monkeypatch.setattr(engine, "load_models", lambda *a: pytest.fail("models loaded before the check"))
    (tmp_path / "serve.json").write_text('{"limits": {"timeout": -1}}')
    rc = cli.main(["serve", "--config", str(tmp_path / "serve.json")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and len(err.splitlines()) == 1 and err.startswith("taps serve: error: ") and "timeout" in err


def test_tuner_dir(tmp_path):
    assert settings(tmp_path, []).tuner_dir is None
    assert settings(tmp_path, ["--tuner-dir", str(tmp_path / "t")]).tuner_dir == str(tmp_path / "t")
    assert settings(tmp_path, [], 'tuner_dir = "kept"').tuner_dir == str(tmp_path / "kept")  # the file's folder
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="--tuner-dir: .* is not a folder"):
        settings(tmp_path, ["--tuner-dir", str(tmp_path / "file")])
    with pytest.raises(ValueError, match="tuner_dir must be a path"):
        settings(tmp_path, [], "tuner_dir = 3")


def test_retire_after(tmp_path):
    from taps.decoder import RETIRE_AFTER

    assert settings(tmp_path, []).retire_after == RETIRE_AFTER == 32
    assert settings(tmp_path, ["--retire-after", "64"]).retire_after == 64
    assert settings(tmp_path, ["--retire-after", "never"]).retire_after == "never"
    assert settings(tmp_path, [], 'retire_after = "never"').retire_after == "never"
    assert settings(tmp_path, [], "retire_after = 300").retire_after == 300
    with pytest.raises(ValueError, match="retire_after .or 'never'. must be"):
        settings(tmp_path, [], "retire_after = 0")
    with pytest.raises(ValueError, match="retire_after"):
        settings(tmp_path, [], 'retire_after = "soon"')
    with pytest.raises(SystemExit):
        settings(tmp_path, ["--retire-after", "0"])


def test_judge_window(tmp_path):
    from taps.judge import WindowJudge

    cfg = settings(tmp_path, [])
    assert cfg.judge_window == 32 and isinstance(cfg.judge, WindowJudge) and cfg.judge.window == 32
    assert cfg.judge is not cfg.judge  # (a judge per batch)
    assert settings(tmp_path, ["--judge-window", "8"]).judge.window == 8
    assert settings(tmp_path, ["--judge-window", "never"]).judge is None
    assert settings(tmp_path, [], 'judge_window = "never"').judge_window == "never"
    assert settings(tmp_path, [], "judge_window = 64").judge_window == 64
    with pytest.raises(ValueError, match="judge_window .or 'never'. must be"):
        settings(tmp_path, [], "judge_window = 0")
    with pytest.raises(ValueError, match="judge_window"):
        settings(tmp_path, [], 'judge_window = "later"')
    with pytest.raises(SystemExit):
        settings(tmp_path, ["--judge-window", "-1"])


def test_engine(tmp_path):
    assert settings(tmp_path, []).engine == "auto"
    assert settings(tmp_path, ["--engine", "thread"]).engine == "thread"
    assert settings(tmp_path, ["--engine", "process"]).engine == "process"
    assert settings(tmp_path, [], 'engine = "thread"').engine == "thread"
    assert settings(tmp_path, ["--engine", "process"], 'engine = "thread"').engine == "process"  # the flag wins
    with pytest.raises(ValueError, match="engine must be one of process, thread"):
        settings(tmp_path, [], 'engine = "gpu"')
    with pytest.raises(SystemExit):
        settings(tmp_path, ["--engine", "gpu"])
