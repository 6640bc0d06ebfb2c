"""`taps train target|drafter` argument parsing (taps.train.cli).

1. Every option of the two subcommands reaches the field of the training config it names: each option
   is given a value different from its default on the command line and the config handed to the
   training function holds exactly those values.
2. An option that names no config field is an error, both when the command line is built and when a
   parsed command is run (it used to be dropped without a word).
"""

import argparse
from pathlib import Path

import pytest

from taps import cli
from taps.train import cli as train_cli
from taps.train.drafter import DrafterTrainConfig
from taps.train.target import TargetTrainConfig

COMMANDS = {"target": (TargetTrainConfig, "train_target"), "drafter": (DrafterTrainConfig, "train_drafter")}


def _subparser(name):
    ap = argparse.ArgumentParser(prog="taps")
    train = train_cli.add_train_subcommands(ap.add_subparsers(dest="command"))
    sub = next(a for a in train._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _other_value(action, tmp_path):
    """(argv, value): a command-line value of `action` that differs from its default."""
    flag = action.option_strings[-1]
    if isinstance(action, argparse._StoreTrueAction):
        return [flag], True
    if action.choices:
        value = next(c for c in action.choices if c != action.default)
        return [flag, value], value
    if action.type is Path:
        return [flag, str(tmp_path / action.dest)], tmp_path / action.dest
    if action.type is int:
        value = 3 if action.default is None else action.default + 7
        return [flag, str(value)], value
    if action.type is float:
        value = 0.375 if action.default is None else action.default + 0.25
        return [flag, str(value)], value
    return [flag, f"x-{action.dest}"], f"x-{action.dest}"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_every_option_reaches_the_config(name, tmp_path, monkeypatch):
    config_cls, function = COMMANDS[name]
    module = __import__(config_cls.__module__, fromlist=[function])
    seen = []
    monkeypatch.setattr(module, function, seen.append)
    options = [a for a in _subparser(name)._actions if a.option_strings and a.dest != "help"]
    assert len(options) >= 20
    argv, expected = ["train", name], {}
    for action in options:
        if action.dest == "device":
            argv += ["--device", "cpu"]
            expected["device"] = "cpu"
            continue
        words, value = _other_value(action, tmp_path)
        argv += words
        expected[action.dest] = value
    assert cli.main(argv) == 0
    (cfg,) = seen
    assert isinstance(cfg, config_cls)
    for field, value in expected.items():
        assert getattr(cfg, field) == value, f"--{field.replace('_', '-')} did not reach {config_cls.__name__}.{field}"
    defaults = config_cls()
    assert all(getattr(defaults, f) != v for f, v in expected.items() if f not in ("name", "out", "run_dir")), \
        "an option whose test value equals the default proves nothing"


@pytest.mark.parametrize("name", list(COMMANDS))
def test_option_without_a_config_field_is_an_error(name, monkeypatch):
    config_cls, function = COMMANDS[name]
    # a parsed command carrying an option the config does not have
    parser = _subparser(name)
    parser.add_argument("--learning-rate", type=float, default=0.1)
    args = parser.parse_args(["--learning-rate", "0.5"])
    args.command, args.train_command = "train", name
    with pytest.raises(ValueError, match="--learning-rate"):
        args.func(args)
    # and a subcommand built with such an option refuses to be built
    module = __import__(config_cls.__module__, fromlist=["x"])
    adder = getattr(module, f"add_{name}_arguments")

    def add_with_extra(p):
        adder(p)
        p.add_argument("--warmup", type=int, default=3)

    monkeypatch.setattr(module, f"add_{name}_arguments", add_with_extra)
    with pytest.raises(ValueError, match="warmup"):
        cli.main(["train", name, "--help"])
