"""The `taps` command line.

    taps demo [--quick]     the shipped models: streamed math and chat answers with the accepted draft
                            tokens marked, then a small acceptance-length table (taps.demo)
    taps eval ...           the paper's tables over MT-Bench, GSM8K, MATH-500 and SVAMP (taps.eval)
    taps tour [--quick]     a tour of the kernels: two drafters' trees merged, verified losslessly,
                            the output distribution checked, and the speed against plain PyTorch
    taps train tokenizer|target|drafter|average|vocab ...   reproduce the shipped models (docs/TRAINING.md)
    taps serve [--config FILE] ...   an OpenAI-compatible HTTP server over the shipped or any Hugging Face
                            models, with continuous batching (taps.serve)
    taps info [--json] [--verify]   what this installation runs on (versions, the library, CPU, GPUs,
                            models, optional packages; taps.info)

Every value is checked as it is parsed (:mod:`taps.arguments`), before a model or a data file is read. A
user error (a bad value or name, a missing or corrupted model file, missing training data) prints one
line, ``taps <command>: error: ...``, and exits with status 2; ``TAPS_TRACEBACK=1`` shows the traceback
of the errors found after parsing instead.
"""

from __future__ import annotations

import argparse
import os
import sys


def build_parser() -> argparse.ArgumentParser:
    """The ``taps`` parser: every subcommand's options, each value checked as it is parsed (one-line
    errors, exit status 2: :class:`taps.arguments.ArgumentParser`)."""
    from taps.arguments import ArgumentParser
    from taps.demo import add_demo_arguments
    from taps.eval import add_eval_arguments
    from taps.info import add_info_arguments
    from taps.serve.config import SERVE_DESCRIPTION, SERVE_EPILOG, add_serve_arguments
    from taps.train.cli import add_train_subcommands

    ap = ArgumentParser(prog="taps", description="TAPS speculative decoding")
    sub = ap.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="the shipped models: streamed answers and a small acceptance-length table")
    add_demo_arguments(d)
    e = sub.add_parser("eval", help="acceptance length of every drafter and strategy on the benchmarks")
    add_eval_arguments(e)
    t = sub.add_parser("tour", help="a tour of the kernels on synthetic trees and a random Llama")
    t.add_argument("--quick", action="store_true", help="smaller sizes")
    add_train_subcommands(sub)
    s = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and text completions, streaming, "
                                     "continuous batching)", description=SERVE_DESCRIPTION, epilog=SERVE_EPILOG,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    add_serve_arguments(s)
    i = sub.add_parser("info", help="what this installation runs on: versions, the library, CPU and GPUs, models")
    add_info_arguments(i)
    return ap


def _subparser(parser: argparse.ArgumentParser, prog: str) -> argparse.ArgumentParser:
    """The (sub-)parser of `parser` whose prog is `prog` (e.g. "taps train drafter"), else `parser`."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found = _subparser(sub, prog)
                if found.prog == prog:
                    return found
    return parser


def main(argv=None) -> int:
    from taps.arguments import user_error

    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    name = "taps " + args.command + (f" {args.train_command}" if args.command == "train" else "")
    if extra:  # argparse reports them from the top parser; name the subcommand instead
        _subparser(parser, name).error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _run(args)
    except (ValueError, OSError) as e:  # user errors: bad files, values, names; one line, no traceback
        if os.environ.get("TAPS_TRACEBACK"):
            raise
        return user_error(name, f"{e} (TAPS_TRACEBACK=1 shows where)")
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return 130


def _run(args) -> int:
    if args.command == "demo":
        from taps.demo import demo

        return demo(args)
    if args.command == "eval":
        from taps.eval import run_eval

        return 1 if run_eval(args).get("greedy_mismatches") else 0
    if args.command == "tour":
        from taps.tour import tour

        return tour(args)
    if args.command == "train":
        return args.func(args)
    if args.command == "info":
        from taps.info import info

        return info(args)
    if args.command == "serve":
        from taps.serve.config import config_from_args
        from taps.serve.server import check_dependencies, serve

        check_dependencies()
        return serve(config_from_args(args))
    return 2


if __name__ == "__main__":
    sys.exit(main())
