"""``taps train ...`` subcommands.

    taps train tokenizer [--out models/tokenizer] [--vocab-size 8192] [--seed 0]
    taps train target    [--tokenizer models/tokenizer] [--out models/target] [--run-dir runs/target]
                         [--preset 5m] [--tokens 10000000] [--device auto] ...
    taps train drafter   --family eagle2|hass|eagle3 --data math|chat|mixed [--tokens 1000000] [--name NAME] ...
    taps train average   models/drafters/A models/drafters/B --out models/drafters/A-B-avg
    taps train vocab     [--target models/target] [--tokens 1000000]
    taps train store     [--target models/target] [--out models/stores/greedy] [--math 4000] [--chat 3000]
    taps train table     [--target models/target] [--out models/tables/t1] [--math 3000] [--chat 2000]

``add_train_subcommands(subparsers)`` registers them under a ``train`` command of an argparse
sub-parser set; ``python -m taps.train ...`` runs the same commands without the main CLI. ``drafter``
runs the trainer of its ``--family`` (:data:`DRAFTER_TRAINERS`, :func:`train_drafter_family`).

Under torchrun (``torchrun --nproc_per_node N -m taps.train target|drafter ...``) the target and
drafter trainings run data parallel (:mod:`taps.train.dist`); ``tokenizer`` and ``average``, which have
nothing to share out, run on rank 0 alone.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys

from .data import REPO_ROOT


def _rank0_only(fn):
    """The command on rank 0 of a torchrun job (or in a plain run); the other ranks return at once."""
    def run(args) -> int:
        return fn(args) if int(os.environ.get("RANK", "0")) == 0 else 0
    return run


@_rank0_only
def _tokenizer(args) -> int:
    from .tokenizer import mixed_corpus, train_tokenizer

    texts, info, held = mixed_corpus(seed=args.seed, chat_fraction=args.chat_fraction, shared=args.shared_data)
    print(f"[train tokenizer] corpus: {len(texts)} texts, {sum(map(len, texts)):,} chars "
          f"(math {info['math']['chars']:,}, chat {info['chat']['chars']:,})", flush=True)
    tok = train_tokenizer(
        texts, args.out, vocab_size=args.vocab_size, min_frequency=args.min_frequency, eval_texts=held,
        manifest_extra={"data": info, "command": (f"taps train tokenizer --vocab-size {args.vocab_size} "
                                                  f"--min-frequency {args.min_frequency} "
                                                  f"--chat-fraction {args.chat_fraction} --seed {args.seed}")})
    manifest = json.loads((args.out / "manifest.json").read_text())
    print(f"[train tokenizer] saved {args.out}: vocab {tok.vocab_size}; chars/token "
          + ", ".join(f"{k} {v['chars_per_token']}" for k, v in manifest.get("compression", {}).items()))
    return 0


# argparse destinations that are not training options
_NOT_OPTIONS = ("command", "train_command", "func")


def _options_without_field(names, config_cls) -> list:
    """The options among `names` (argparse destinations) that name no field of `config_cls`."""
    return sorted(set(names) - set(config_cls.field_names()) - set(_NOT_OPTIONS))


def config_from_args(config_cls, args):
    """``config_cls(**options)`` from a parsed subcommand; an option that names no field of the config
    raises ValueError (it would otherwise be dropped without a word)."""
    options = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    unknown = _options_without_field(options, config_cls)
    if unknown:
        raise ValueError(f"taps train: option(s) {', '.join('--' + k.replace('_', '-') for k in unknown)} "
                         f"name no field of {config_cls.__name__}")
    return config_cls(**options)


def check_options(parser: argparse.ArgumentParser, config_cls) -> None:
    """Raise ValueError when an option of `parser` names no field of `config_cls` (checked when the
    command line is built, so that a mismatch fails every ``taps`` command, not only the training run)."""
    unknown = _options_without_field([a.dest for a in parser._actions if a.dest != "help"], config_cls)
    if unknown:
        raise ValueError(f"taps train: {parser.prog}: option(s) {', '.join(unknown)} name no field of "
                         f"{config_cls.__name__}")


def _target(args) -> int:
    from .target import TargetTrainConfig, train_target

    train_target(config_from_args(TargetTrainConfig, args))
    return 0


#: the trainer of each drafter family (``--family``): (module of taps.train, function), imported when it runs
DRAFTER_TRAINERS = {"eagle2": ("drafter", "train_drafter"), "hass": ("drafter", "train_drafter"),
                    "eagle3": ("eagle3", "train_eagle3")}


def train_drafter_family(cfg) -> dict:
    """Train (or resume) a drafter with the trainer of its family (:data:`DRAFTER_TRAINERS`; ``cfg``: a
    :class:`taps.train.drafter.DrafterTrainConfig`). Returns the trainer's summary."""
    module, name = DRAFTER_TRAINERS[cfg.family]
    return getattr(importlib.import_module(f".{module}", __package__), name)(cfg)


def _drafter(args) -> int:
    from .drafter import DrafterTrainConfig

    train_drafter_family(config_from_args(DrafterTrainConfig, args))
    return 0


@_rank0_only
def _vocab(args) -> int:
    from .vocab import write_token_counts

    write_token_counts(args.target, args.tokens, seed=args.seed, shared=args.shared_data)
    return 0


@_rank0_only
def _store(args) -> int:
    from .store import write_store

    write_store(args)
    return 0


@_rank0_only
def _table(args) -> int:
    from .table import write_table

    write_table(args)
    return 0


@_rank0_only
def _average(args) -> int:
    from .drafter import average_checkpoints

    average_checkpoints(args.inputs, args.out, args.target)
    return 0


def add_train_subcommands(subparsers) -> argparse.ArgumentParser:
    """Register ``train tokenizer|target|drafter|average|vocab|store|table`` on ``subparsers`` (from add_subparsers())."""
    from pathlib import Path

    from ..arguments import float_at_least, int_at_least

    train = subparsers.add_parser("train", help="train the tokenizer and the target model from the offline data")
    sub = train.add_subparsers(dest="train_command", required=True)

    t = sub.add_parser("tokenizer", help="train the byte-level BPE tokenizer on the chat + math training text")
    t.add_argument("--out", type=Path, default=REPO_ROOT / "models" / "tokenizer")
    t.add_argument("--vocab-size", type=int_at_least(1), default=8192)
    t.add_argument("--min-frequency", type=int_at_least(1), default=2)
    t.add_argument("--chat-fraction", type=float_at_least(0, 1), default=0.5,
                   help="share of chat in the corpus characters")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--shared-data", type=Path, default=None,
                   help="folder of the shared training data (default ../shared/data or $TAPS_SHARED_DATA)")
    t.set_defaults(func=_tokenizer)

    from .target import TargetTrainConfig, add_target_arguments

    g = sub.add_parser("target", help="train the target causal LM (resumable; rerun the same command to continue)")
    add_target_arguments(g)
    check_options(g, TargetTrainConfig)
    g.set_defaults(func=_target)

    from .drafter import DrafterTrainConfig, add_drafter_arguments

    dr = sub.add_parser("drafter", help="train an EAGLE-style drafter on the target's features (eagle2 or hass "
                                        "objective; resumable)")
    add_drafter_arguments(dr)
    check_options(dr, DrafterTrainConfig)
    dr.set_defaults(func=_drafter)

    av = sub.add_parser("average", help="weight-space mean of drafter checkpoints")
    av.add_argument("inputs", type=Path, nargs="+", help="drafter folders (same shapes)")
    av.add_argument("--out", type=Path, required=True)
    av.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "target")
    av.set_defaults(func=_average)

    vo = sub.add_parser("vocab", help="count the drafters' training tokens (token_counts.json in the target folder, "
                                      "for reduced draft vocabularies)")
    vo.add_argument("--target", type=Path, default=REPO_ROOT / "models" / "target")
    vo.add_argument("--tokens", type=int_at_least(1), default=1_000_000,
                    help="training tokens counted per domain (math, chat)")
    vo.add_argument("--seed", type=int, default=0, help="the drafters' data seed")
    vo.add_argument("--shared-data", type=Path, default=None,
                    help="folder of the shared training data (default ../shared/data or $TAPS_SHARED_DATA)")
    vo.set_defaults(func=_vocab)

    from .store import add_store_arguments

    st = sub.add_parser("store", help="a token store of the target's own answers to training prompts, for prompt "
                                      "lookup (PromptLookupDrafter(store=...))")
    add_store_arguments(st)
    st.set_defaults(func=_store)

    from .table import add_table_arguments

    ta = sub.add_parser("table", help="an n-gram table of the target's own next-token distributions, for "
                                      "NgramTableDrafter (sampled drafts without a drafter model)")
    add_table_arguments(ta)
    ta.set_defaults(func=_table)
    return train


def main(argv=None) -> int:
    from ..arguments import ArgumentParser, user_error

    ap = ArgumentParser(prog="taps")  # the same commands as `taps train ...`, named so in their errors
    sub = ap.add_subparsers(dest="command", required=True)
    add_train_subcommands(sub)
    args = ap.parse_args(["train"] + list(sys.argv[1:] if argv is None else argv))
    if "TORCHELASTIC_RUN_ID" in os.environ:  # under torchrun: its failure summary names this rank's error
        from torch.distributed.elastic.multiprocessing.errors import record

        return record(args.func)(args)
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # user errors: one line, as the `taps` command prints them
        if os.environ.get("TAPS_TRACEBACK"):
            raise
        return user_error(f"taps train {args.train_command}", f"{e} (TAPS_TRACEBACK=1 shows where)")
