"""End-to-end speed: taps against Hugging Face ``generate`` on the same model, side by side in one process.

    PYTHONPATH=python python bench/bench_e2e.py --threads 1                 # shipped models, T=0 and T=1
    PYTHONPATH=python python bench/bench_e2e.py --threads 1 --overhead-only # negligible-compute models

Table 1 (shipped models: the target and the hass drafters of models/, 3 GSM8K + 3 MT-Bench prompts with the
chat template, batch 1; "lookup" rows add taps' own prompt-lookup drafter, taps.PromptLookupDrafter; "store"
rows the same drafter with the shipped token store of the target's own answers to training prompts,
models/stores/greedy, ``PromptLookupDrafter(store=taps.models.load_store())``; the "table" row
``taps.NgramTableDrafter`` over the shipped n-gram table of the target's T = 1 answers, models/tables/sampled
(``taps.models.load_table()``, or ``--table PATH``), drafting chains of ``--table-depth`` tokens (drawn: the table's
modes at T = 0), unless ``--depth/--top-k/--budget`` are given):
tokens/s of Hugging Face ``generate`` on its own copy of the target (untouched by taps: its own attention,
its own cache), of HF's prompt-lookup decoding (``prompt_lookup_num_tokens``), and of every taps strategy
with ``SpeculativeDecoder``'s defaults (or ``--depth/--top-k/--budget``), and of every strategy again with
a ``taps.Tuner`` (the "auto" rows, as ``budget="auto"``; the tuner times with its default clock,
``perf_counter``, or ``--tuner-clock``: it chooses each step's draft, down to none, within those settings), each as a ratio to HF ``generate`` and to taps autoregressive; tau; verified nodes per step;
at T=0 whether the output equals HF's greedy output token for token; for the auto rows the draft shapes
chosen most often. Rows are timed in rounds (every row once per round, ``--repeats`` rounds) and each
row keeps its fastest round, so slow drifts of a shared machine hit all rows alike; a row that follows the
other model's (HF generate's copy of the target, or taps' after it) first decodes 4 untimed tokens, so that
no row pays for the caches the other model took. A second taps autoregressive decoder (the control row)
does the same work as the first: its ratio to it is the run's noise. "(per round)": the lowest and highest
of a row's ratios to taps autoregressive over the rounds (each round's tokens over its seconds, every
prompt): a difference inside the control row's range is noise.

Table 1b (``--batch N``): the prompts (the GSM8K ones first, then the MT-Bench ones) decoded as one ragged
batch of N (``--prompts`` per benchmark defaults to N / 2 here), every row's tokens/s against taps
autoregressive decoding of the same batch (HF ``generate`` is not run; a second autoregressive decoder, the
control row, shows the measurement's noise); rows in interleaved rounds, each row's median round, all its rounds
together (its tokens over its time) and its fastest round; whether each row's output equals autoregressive
decoding token for token
(at T=0); for the auto rows how many rounds their generation judge ran plain (``taps.judge``: a batch size where
drafting lost runs its next generations as the decoder's autoregressive decoding, so the median round of a row
that loses is a plain one; the warm-up generation counts towards the judge's schedule) and the draft shapes
chosen most often in the last round. Tree forwards of ragged trees run packed (each
request's real nodes only, ``SpeculativeDecoder.pack_trees``); ``--no-pack`` runs them over the padded grid.

``--tuner-dir DIR`` (either table): each auto row starts from the tuner and judge state a previous run with the same
DIR saved for it (``SpeculativeDecoder.save_tuner`` / ``load_tuner``: what a process that keeps them, a restarted
``taps serve --tuner-dir``, starts from, instead of learning again) and saves its own there at the end; without it
every auto row starts fresh (the first run's rows pay for what their tuners and judges learn).

Table 2 (``--profile``, one per temperature): where a taps step's time goes (``generate(profile=True)``), ms per
step and phase, and the tokens a step emitted.

Table 3 (``--overhead``): pure host overhead with models whose compute is negligible (hidden 64, vocab 512,
4 target layers, 1-layer drafters): ms per decoding step of HF ``generate`` (per token) and of a taps step
per strategy (depth 5, top_k 8, budget 32 unless given), as a ratio to one HF step and to one taps
autoregressive step, and of tuned decoders whose costs make every draft lose (so that every step is a plain
step: what remains beyond autoregressive decoding is the controller's own overhead); the fastest of
``--overhead-rounds`` rounds, each running HF and every strategy once (interleaved against load bursts).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
from typing import Dict

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402

ROWS = ("autoregressive", "math", "chat", "average", "route-confidence", "route-entropy", "merged",
        "merged-budget", "adaptive", "lookup", "merged-budget+lookup", "merged+lookup", "store",
        "merged-budget+store", "table")
#: row -> (strategy, drafter data names)
ROW_SPECS = {"autoregressive": ("autoregressive", ()), "math": ("single", ("math",)),
             "chat": ("single", ("chat",)), "average": ("average", ("math", "chat")),
             "route-confidence": ("route-confidence", ("math", "chat")),
             "route-entropy": ("route-entropy", ("math", "chat")), "merged": ("merged", ("math", "chat")),
             "merged-budget": ("merged-budget", ("math", "chat")), "adaptive": ("adaptive", ("math", "chat")),
             "lookup": ("single", ("lookup",)), "merged-budget+lookup": ("merged-budget", ("math", "chat", "lookup")),
             "merged+lookup": ("merged", ("math", "chat", "lookup")), "store": ("single", ("store",)),
             "merged-budget+store": ("merged-budget", ("math", "chat", "store")), "table": ("single", ("table",))}
PHASES = ("draft_forward", "draft", "tree", "target_forward", "target_head", "verify", "compact", "draft_update", "step")


def make_drafters(names, drafters, args, models):
    """The drafters of a row: the trained heads by data name, prompt lookup ("lookup"), prompt lookup with
    the shipped token store ("store", loaded once) and an n-gram table drafter ("table": the shipped table, or
    ``--table PATH``, a file ``taps train table`` wrote)."""
    from taps import NgramTable, NgramTableDrafter, PromptLookupDrafter

    kw = {} if args.lookup_depth is None else dict(depth=args.lookup_depth)
    if "store" in names and "store" not in drafters:
        drafters["store"] = models.load_store()
    if "table" in names and "table" not in drafters:
        drafters["table"] = NgramTable.load(args.table) if args.table else models.load_table()
    out = []
    for n in names:
        if n == "lookup":
            out.append(PromptLookupDrafter(**kw))
        elif n == "store":
            out.append(PromptLookupDrafter(store=drafters["store"], **kw))
        elif n == "table":
            out.append(NgramTableDrafter(drafters["table"]))
        else:
            out.append(drafters[n])
    return out


def row_settings(row: str, settings: dict, args) -> dict:
    """A row's decoder settings: those given (``--depth/--top-k/--budget``, ``--sampled-drafts``); with none
    given, the table row's chains of ``--table-depth`` tokens (a table's drafts are drawn unless
    ``--sampled-drafts off``: the chain of its modes at T = 0), the defaults for the others."""
    own = dict(settings, sampled_drafts=args.sampled_drafts)
    if row == "table" and not settings:
        own.update(depth=args.table_depth, top_k=1, budget=args.table_depth + 1)
    return own


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class HFRunner:
    """Hugging Face ``generate`` on a private copy of the target, one prompt at a time."""

    def __init__(self, model, eos_id, lookup: int = 0):
        self.model, self.eos_id, self.lookup = model, eos_id, lookup

    def __call__(self, prompts, new_tokens: int, temperature: float, seed: int):
        outs = []
        device = next(self.model.parameters()).device
        for i, p in enumerate(prompts):
            ids = torch.tensor([p], device=device)
            kw = dict(max_new_tokens=new_tokens, eos_token_id=self.eos_id, pad_token_id=self.eos_id,
                      attention_mask=torch.ones_like(ids))
            if temperature > 0:
                torch.manual_seed(seed + i)
                kw.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
            else:
                kw.update(do_sample=False)
            if self.lookup:
                kw["prompt_lookup_num_tokens"] = self.lookup
            out = self.model.generate(ids, **kw)
            outs.append(out[0, ids.shape[1]:].tolist())
        return outs, None


class TapsRunner:
    def __init__(self, decoder, eos_id):
        self.decoder, self.eos_id = decoder, eos_id

    def __call__(self, prompts, new_tokens: int, temperature: float, seed: int, profile: bool = False):
        outs, stats = [], []
        for i, p in enumerate(prompts):
            o = self.decoder.generate([p], max_new_tokens=new_tokens, temperature=temperature,
                                      eos_token_id=self.eos_id, seed=seed + i, profile=profile)
            outs.append(o.tokens[0])
            stats.append(o)
        return outs, stats


def tuner_clock(args, clock):
    """The clock the auto rows' tuners time with (--tuner-clock)."""
    return {"bench": clock, "wall": time.perf_counter, "process": time.process_time,
            "thread": time.thread_time}[args.tuner_clock]


def _tuner_path(args, table: str, name: str):
    """--tuner-dir: the file where the auto row `name` of `table` keeps its tuner's (and judge's) state."""
    import re
    from pathlib import Path

    return Path(args.tuner_dir) / f"{table}-{re.sub(r'[^A-Za-z0-9+.-]+', '_', name)}.json"


def load_tuner_state(args, table: str, name: str, dec) -> None:
    """--tuner-dir: an auto row's decoder starts from the state an earlier run of the same row left
    (``SpeculativeDecoder.load_tuner``: its tuner's costs and acceptance and its generation judge's verdicts, what a
    process that loads them, a restarted ``taps serve --tuner-dir``, starts from); a state measured on another
    setup is skipped, and said so."""
    if not args.tuner_dir or dec.tuner is None:
        return
    path = _tuner_path(args, table, name)
    if not path.is_file():
        print(f"{name}: no saved state at {path} (a fresh tuner; saved there at the end)")
        return
    try:
        dec.load_tuner(path)
        print(f"{name}: tuner and judge state from {path}")
    except ValueError as e:
        print(f"{name}: not using {path}: {e}")


def save_tuner_states(args, table: str, decoders) -> None:
    """--tuner-dir: every auto row's state, for the next run (:func:`load_tuner_state`)."""
    if not args.tuner_dir:
        return
    import os

    os.makedirs(args.tuner_dir, exist_ok=True)
    for name, dec in decoders.items():
        if dec.tuner is not None:
            dec.save_tuner(_tuner_path(args, table, name))


def shipped_tables(args, device, dtype) -> None:
    from taps import SpeculativeDecoder, Tuner, models
    from taps.data import load_eval_prompts

    target, tok = models.load_target(dtype=dtype)
    target.to(device)
    hf_target = copy.deepcopy(target)  # HF generate's own copy: taps never touches it
    drafters = {d: models.load_drafter(args.family, d, target, draft_vocab=args.draft_vocab) for d in ("math", "chat")}
    prompts = []
    for bench in ("gsm8k", "mt_bench"):
        for ex in load_eval_prompts(bench)[:args.prompts or 3]:
            prompts.append(tok.encode_chat(ex.messages, add_generation_prompt=True))
    settings = {k: v for k, v in dict(depth=args.depth, top_k=args.top_k, budget=args.budget).items()
                if v is not None}
    runners: Dict[str, object] = {"HF generate": HFRunner(hf_target, tok.eos_id)}
    if args.lookup:
        runners[f"HF prompt lookup ({args.lookup})"] = HFRunner(hf_target, tok.eos_id, lookup=args.lookup)
    decoders = {}
    clock = time.process_time if args.clock == "process" else time.perf_counter
    for row in args.rows:
        strategy, names = ROW_SPECS[row]
        for auto in (False, True) if args.auto and names else (False,):
            # the tuner measures with its own default clock (wall) unless --tuner-clock says otherwise
            own = row_settings(row, settings, args)
            kw = dict(own, tuner=Tuner(timer=tuner_clock(args, clock))) if auto else own
            dec = SpeculativeDecoder(target, make_drafters(names, drafters, args, models), strategy=strategy, **kw)
            name = f"{row} auto" if auto else row
            decoders[name] = dec
            load_tuner_state(args, "batch1", name, dec)
            runners[f"taps {name}"] = TapsRunner(dec, tok.eos_id)
            if row == "autoregressive":  # a second one: its ratio to the first is the run's noise
                runners["taps autoregressive (control)"] = TapsRunner(
                    SpeculativeDecoder(target, [], strategy="autoregressive", **settings), tok.eos_id)
    first = next(iter(decoders.values()), None)
    print(f"device {device}, {torch.get_num_threads()} thread(s), {str(dtype).replace('torch.', '')}; "
          f"shipped target + {args.family} drafters; {len(prompts)} prompts (GSM8K, MT-Bench), "
          f"{args.new_tokens} new tokens, batch 1; draft vocabulary {args.draft_vocab or 'full'}; taps settings: "
          + (f"depth {first.depth}, top_k {first.top_k}, budget {first.budget}" if first else "-")
          + (f" (the table row: chains of {args.table_depth}, drawn at T > 0)" if "table" in args.rows and not settings
             else ""))

    for temperature in args.temperatures:
        for name, runner in runners.items():  # warm-up
            runner(prompts[:1], 8, temperature, 0)
        names = [n for n in runners if not (temperature > 0 and "lookup" in n and args.no_lookup_sampling)]
        # rows interleaved prompt by prompt; each (row, prompt) keeps its fastest repeat
        best = {(n, i): float("inf") for n in names for i in range(len(prompts))}
        result: Dict[tuple, tuple] = {}
        # each round's tokens and seconds per row: the spread of a row's ratio to taps autoregressive from one
        # round to the next (the control row's is this run's noise)
        per_round: Dict[tuple, list] = {(n, r): [0, 0.0] for n in names for r in range(args.repeats)}
        previous = None
        for rnd in range(args.repeats):
            # the rows in reverse order every other round: no row always follows the same one (a row's place
            # in a round moved its ratio by a few percent, the control row's included)
            order = names if rnd % 2 == 0 else names[::-1]
            for i, p in enumerate(prompts):
                for name in order:
                    if previous is not None and name.startswith("HF") != previous.startswith("HF"):
                        # the other model's run just took the caches (HF generate runs its own copy of the
                        # target): 4 untimed tokens first, so that no row pays for following it (the row after
                        # HF generate read 3-11% slower than the same decoder later in the round)
                        runners[name]([p], 4, temperature, args.seed + i)
                    previous = name
                    _sync()
                    t0 = clock()
                    outs, stats = runners[name]([p], args.new_tokens, temperature, args.seed + i)
                    _sync()
                    sec = clock() - t0
                    per_round[name, rnd][0] += len(outs[0])
                    per_round[name, rnd][1] += sec
                    if sec < best[name, i]:
                        best[name, i] = sec
                        result[name, i] = (outs[0], stats[0] if stats else None)
        seconds = {n: sum(best[n, i] for i in range(len(prompts))) for n in names}
        outputs = {n: [result[n, i][0] for i in range(len(prompts))] for n in names}
        ref_outs = outputs["HF generate"]
        base = sum(len(o) for o in ref_outs) / seconds["HF generate"]
        plain = "taps autoregressive"
        base_ar = sum(len(o) for o in outputs[plain]) / seconds[plain] if plain in names else None
        rows = []
        for name in names:
            outs = outputs[name]
            stats = [result[name, i][1] for i in range(len(prompts))]
            tps = sum(len(o) for o in outs) / seconds[name]
            tau = nodes = shapes = "-"
            if stats[0] is not None:
                taus = [s.stats[0].tau for s in stats if s.stats[0].target_forwards]
                tau = f"{sum(taus) / max(len(taus), 1):.2f}"
                steps = sum(s.steps for s in stats)
                nodes_total = sum(sum(s.stats[0].tree_nodes) for s in stats)
                nodes = f"{nodes_total / steps:.1f}" if steps else "-"
                hist: Dict[str, int] = {}
                for s in stats:
                    for k, v in s.summary.get("shape_histogram", {}).items():
                        hist[k] = hist.get(k, 0) + v
                total = sum(hist.values())
                if total:
                    shapes = ", ".join(f"{k} {v / total:.0%}" for k, v in
                                       sorted(hist.items(), key=lambda kv: -kv[1])[:3])
            same = "-"
            if temperature == 0:
                same = "yes" if outs == ref_outs else f"NO ({sum(a != b for a, b in zip(outs, ref_outs))} differ)"
            vs_ar = f"{tps / base_ar:.2f}x" if base_ar else "-"
            spread = "-"
            if base_ar:
                ratios = [per_round[name, r][0] / per_round[name, r][1]
                          / (per_round[plain, r][0] / per_round[plain, r][1]) for r in range(args.repeats)]
                spread = f"{min(ratios):.2f}-{max(ratios):.2f}x"
            rows.append([name, f"{tps:.0f}", f"{tps / base:.2f}x", vs_ar, spread, tau, nodes, same, shapes])
        print_table(["row", "tokens/s", "vs HF generate", "vs taps autoregressive", "(per round)", "tau",
                     "nodes/step", "= HF greedy", "auto: top shapes"], rows,
                    title=f"Shipped models, T={temperature:g} ({args.repeats} rounds, rows interleaved per prompt, "
                          f"in reverse every other round, fastest per row and prompt; {args.clock} time)")

    save_tuner_states(args, "batch1", decoders)

    for temperature in (args.temperatures if args.profile else ()):  # a table per temperature
        rows = []
        for row, dec in decoders.items():
            runner = TapsRunner(dec, tok.eos_id)
            runner(prompts[:1], 8, temperature, 0, profile=True)
            outs, stats = runner(prompts, args.new_tokens, temperature, args.seed, profile=True)
            steps = sum(s.steps for s in stats)
            tokens = sum(len(o) - 1 for o in outs)  # (the first token of each comes from the prefill)
            tot = {}
            for s in stats:
                for k, v in s.profile.items():
                    tot[k] = tot.get(k, 0.0) + v * s.steps
            per = {k: v / steps * 1e3 for k, v in tot.items()}
            total = sum(per.get(k, 0.0) for k in PHASES)  # sections are exclusive ("step" = the rest)
            rows.append([row, f"{total:.2f}", f"{tokens / steps:.2f}"] + [f"{per.get(k, 0.0):.2f}" for k in PHASES])
        print_table(["row", "ms/step", "tokens/step", "draft fwd", "expand", "tree", "target fwd", "target head",
                     "verify", "compact", "draft update", "glue"], rows,
                    title=f"Where a taps step's time goes, T={temperature:g} (ms per step; draft fwd / draft update = "
                          "drafter forwards, expand = the expansion around them, glue = the rest of the loop)")


def batch_table(args, device, dtype) -> None:
    """Table 1b: one ragged batch of every prompt, every row against taps autoregressive (see the module
    docstring)."""
    import statistics

    from taps import SpeculativeDecoder, Tuner, models
    from taps.data import load_eval_prompts

    target, tok = models.load_target(dtype=dtype)
    target.to(device)
    drafters = {d: models.load_drafter(args.family, d, target, draft_vocab=args.draft_vocab) for d in ("math", "chat")}
    per = args.prompts or (args.batch + 1) // 2
    prompts = []
    for bench in ("gsm8k", "mt_bench"):
        for ex in load_eval_prompts(bench)[:per]:
            prompts.append(tok.encode_chat(ex.messages, add_generation_prompt=True))
    prompts = prompts[:args.batch]
    settings = {k: v for k, v in dict(depth=args.depth, top_k=args.top_k, budget=args.budget).items()
                if v is not None}
    clock = time.process_time if args.clock == "process" else time.perf_counter
    # a second autoregressive decoder: its ratio to the first is the noise of the measurement
    decoders = {"autoregressive": SpeculativeDecoder(target, [], strategy="autoregressive"),
                "autoregressive (control)": SpeculativeDecoder(target, [], strategy="autoregressive")}
    for row in args.rows:
        strategy, names = ROW_SPECS[row]
        if not names:
            continue
        for auto in (False, True) if args.auto else (False,):
            if not auto and args.batch_auto_only:
                continue
            own = row_settings(row, settings, args)
            # with --judge both, each auto row twice: with its generation judge and without (taps.judge)
            for judged in ((True, False) if auto and args.judge == "both" else (args.judge != "off",)):
                kw = dict(own, tuner=Tuner(timer=tuner_clock(args, clock))) if auto else own
                dec = SpeculativeDecoder(target, make_drafters(names, drafters, args, models), strategy=strategy, **kw)
                dec.pack_trees = not args.no_pack
                if not judged:
                    dec.judge = None
                name = (f"{row} auto" if auto else row) + ("" if judged or not auto else ", no judge")
                decoders[name] = dec
                load_tuner_state(args, f"batch{args.batch}", name, dec)
    print(f"device {device}, {torch.get_num_threads()} thread(s), {str(dtype).replace('torch.', '')}; "
          f"shipped target + {args.family} drafters; one ragged batch of {len(prompts)} prompts (prompt lengths "
          f"{[len(p) for p in prompts]}), {args.new_tokens} new tokens; draft vocabulary {args.draft_vocab or 'full'}")
    for temperature in args.temperatures:
        def run(dec, profile=False):
            return dec.generate(prompts, max_new_tokens=args.new_tokens, temperature=temperature,
                                eos_token_id=tok.eos_id, seed=args.seed, profile=profile)
        for dec in decoders.values():  # warm-up (a tuner calibrates here)
            run(dec)
        times = {n: [] for n in decoders}
        plain = {n: 0 for n in decoders}  # rounds the generation judge ran plain (taps.judge)
        outputs = {}
        items = list(decoders.items())
        for rnd in range(args.repeats):
            # (in reverse order every other round, as in the batch-1 table)
            for name, dec in (items if rnd % 2 == 0 else items[::-1]):
                _sync()
                t0 = clock()
                out = run(dec)
                _sync()
                times[name].append(clock() - t0)
                plain[name] += bool(out.summary.get("judged_plain"))
                outputs[name] = out
        ref = outputs["autoregressive"].tokens
        tokens = {n: sum(len(t) for t in o.tokens) for n, o in outputs.items()}
        base_med = tokens["autoregressive"] / statistics.median(times["autoregressive"])
        base_best = tokens["autoregressive"] / min(times["autoregressive"])
        base_all = tokens["autoregressive"] * args.repeats / sum(times["autoregressive"])
        rows = []
        for name, out in outputs.items():
            med = tokens[name] / statistics.median(times[name])
            best = tokens[name] / min(times[name])
            # the ratio of each round to the autoregressive run of the same round, median over rounds
            paired = statistics.median(times["autoregressive"][r] / times[name][r] * tokens[name] / tokens["autoregressive"]
                                       for r in range(args.repeats))
            hist: Dict[str, int] = dict(out.summary.get("shape_histogram", {}))
            total = sum(hist.values())
            shapes = "-" if not total else ", ".join(f"{k} {v / total:.0%}" for k, v in
                                                      sorted(hist.items(), key=lambda kv: -kv[1])[:3])
            same = "-"
            if temperature == 0:
                same = "yes" if out.tokens == ref else f"NO ({sum(a != b for a, b in zip(out.tokens, ref))} differ)"
            # every round's tokens over every round's time (what a user running the row this long gets)
            whole = tokens[name] * args.repeats / sum(times[name]) / base_all
            rows.append([name, f"{med:.0f}", f"{med / base_med:.3f}x", f"{whole:.3f}x", f"{best / base_best:.3f}x",
                         f"{paired:.3f}x",
                         f"{out.summary.get('tau', 0):.2f}", out.steps, same,
                         f"{plain[name]}/{args.repeats}" if decoders[name].judge is not None else "-", shapes])
        print_table(["row", "tokens/s (median)", "vs AR (medians)", "vs AR (all rounds)", "vs AR (fastest)",
                     "vs AR (paired rounds)",
                     "tau", "steps", "= AR", "judged plain", "auto: top shapes (last round)"], rows,
                    title=f"Ragged batch of {len(prompts)}, T={temperature:g} ({args.repeats} interleaved rounds; "
                          f"{args.clock} time)")
    save_tuner_states(args, f"batch{args.batch}", decoders)


def overhead_table(args, device) -> None:
    import transformers

    from taps import EagleDrafter, ModelDrafter, PromptLookupDrafter, SpeculativeDecoder, Tuner
    from taps.tuner import FixedCosts

    cfg = transformers.LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                                   tie_word_embeddings=False)
    torch.manual_seed(0)
    target = transformers.LlamaForCausalLM(cfg).eval().to(device)
    hf_target = copy.deepcopy(target)
    small = copy.deepcopy(cfg)
    small.num_hidden_layers = 1
    eagles = [EagleDrafter(small) for _ in range(2)]
    lms = [transformers.LlamaForCausalLM(small).eval().to(device) for _ in range(2)]
    prompt = torch.randint(3, 512, (1, 64)).tolist()
    new = args.overhead_tokens
    depth, top_k, budget = args.depth or 5, args.top_k or 8, args.budget or 32

    clock = time.process_time if args.clock == "process" else time.perf_counter
    ids = torch.tensor(prompt, device=device)
    hf_kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0,
                 attention_mask=torch.ones_like(ids))

    def hf_step() -> float:
        _sync()
        t0 = clock()
        hf_target.generate(ids, **hf_kw)
        _sync()
        return (clock() - t0) / new

    cases = [("autoregressive", []), ("single", eagles[:1]), ("single", [ModelDrafter(lms[0])]),
             ("merged", eagles), ("merged-budget", eagles), ("adaptive", eagles),
             ("route-confidence", eagles), ("merged", [ModelDrafter(m) for m in lms])]
    decoders = [SpeculativeDecoder(target, ds, strategy=name, depth=depth, top_k=top_k, budget=budget)
                for name, ds in cases]
    # the tuned decoder's plain steps: a tuner whose costs make every draft lose (a drafter level costs a
    # second), so it runs no draft at all; what such a step costs beyond an autoregressive one is the
    # controller's own overhead, which a run where no draft pays pays on every step (the drafters are kept in
    # every generation, leave_out_after None: left out, the row would time autoregressive steps; a server's
    # continuous batch, which leaves out nothing, pays it until it retires its groups)
    timer = tuner_clock(args, clock)
    never = lambda: Tuner(FixedCosts(lambda n, b: 1e-3 * n, lambda g, d, b: 1.0), timer=timer)  # noqa: E731
    for name, ds in (("single", [PromptLookupDrafter()]), ("single", eagles[:1]),
                     ("merged-budget", eagles + [PromptLookupDrafter()])):
        cases.append((name + " auto, no draft pays", ds))
        decoders.append(SpeculativeDecoder(target, ds, strategy=name, depth=depth, top_k=top_k, budget=budget,
                                           tuner=never()))
        decoders[-1].leave_out_after = None
    hf_target.generate(ids, **hf_kw)  # warm-up
    for dec in decoders:
        dec.generate(prompt, max_new_tokens=8)
    # Rounds: in each, one HF run, then one run of every case; each keeps its fastest, so that a burst of
    # load on this shared machine costs a round, not a row.
    hf, best = float("inf"), [float("inf")] * len(cases)
    for _ in range(args.overhead_rounds):
        hf = min(hf, hf_step())
        for i, dec in enumerate(decoders):
            _sync()
            t0 = clock()
            out = dec.generate(prompt, max_new_tokens=new)
            _sync()
            best[i] = min(best[i], (clock() - t0) / out.steps)
    rows = [["HF generate (per token)", "-", f"{hf * 1e3:.2f}", "1.00", "-"]]
    for (name, ds), t in zip(cases, best):
        kinds = [{EagleDrafter: "eagle", PromptLookupDrafter: "lookup"}.get(type(d), "LM") for d in ds]
        drafters = "-" if not ds else " + ".join(f"{kinds.count(k)} x {k}" for k in dict.fromkeys(kinds))
        rows.append([f"taps {name}", drafters, f"{t * 1e3:.2f}", f"{t / hf:.2f}", f"{t / best[0]:.2f}"])
    print_table(["row", "drafters", "ms/step", "HF steps", "taps AR steps"], rows,
                title=f"Pure host overhead per decoding step (hidden 64, vocab 512, 4 target layers, 1-layer "
                      f"drafters; depth {depth}, top_k {top_k}, budget {budget}; taps ms/step includes prefill "
                      f"amortised over {new} tokens; fastest of {args.overhead_rounds} interleaved rounds)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else fp32")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--family", default="hass")
    ap.add_argument("--rows", nargs="+", default=list(ROWS), choices=ROWS)
    ap.add_argument("--prompts", type=int, default=None,
                    help="prompts per benchmark (GSM8K, MT-Bench); default 3, with --batch N: N / 2")
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--tuner-clock", default="wall", choices=("wall", "bench", "process", "thread"),
                    help="the auto rows' tuners' clock: perf_counter (default: the Tuner's own, what a user "
                         "runs), the benchmark's --clock, process_time or thread_time (a CPU-time clock read "
                         "cost 70-170 us in the decoding loop of a KVM guest)")
    ap.add_argument("--clock", default="wall", choices=("wall", "process"),
                    help="process: CPU time of this process (steadier on a shared machine; excludes waits)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lookup", type=int, default=10, help="HF prompt_lookup_num_tokens (0: no such row)")
    ap.add_argument("--no-lookup-sampling", action="store_true", help="skip HF prompt lookup at T > 0")
    ap.add_argument("--draft-vocab", type=int, default=1024,
                    help="drafters propose only the N most frequent target tokens (0: the whole vocabulary)")
    ap.add_argument("--depth", type=int, default=None)
    ap.add_argument("--table", default=None,
                    help="the n-gram table file of the 'table' row (taps train table's table.npz; default: the "
                         "shipped one, models/tables/sampled)")
    ap.add_argument("--table-depth", type=int, default=3,
                    help="the table row's chains (top_k 1, budget depth + 1) where --depth/--top-k/--budget are not "
                         "given")
    ap.add_argument("--lookup-depth", type=int, default=None,
                    help="tokens per prompt-lookup continuation (default: the drafter's own default)")
    ap.add_argument("--top-k", type=int, default=None)
    ap.add_argument("--budget", type=int, default=None)
    ap.add_argument("--sampled-drafts", default="auto", choices=("auto", "on", "off"),
                    help="SpeculativeDecoder(sampled_drafts=): at T > 0 one drafter's tree drawn from its "
                         "distribution (on), top-k (off), or the tuner's choice (auto; fixed rows: top-k)")
    ap.add_argument("--no-auto", dest="auto", action="store_false",
                    help="no auto rows (budget='auto': a tuner choosing each step's draft)")
    ap.add_argument("--batch", type=int, default=0,
                    help="N > 0: the ragged-batch table instead (GSM8K then MT-Bench prompts as one batch of N, "
                         "every row against taps autoregressive)")
    ap.add_argument("--batch-auto-only", action="store_true", help="batch table: the auto rows only")
    ap.add_argument("--tuner-dir", metavar="DIR", default=None,
                    help="each auto row starts from the tuner and judge state an earlier run with this DIR saved "
                         "(SpeculativeDecoder.load_tuner; what a restarted `taps serve --tuner-dir` starts from), "
                         "and saves its own there at the end (default: fresh tuners, nothing saved)")
    ap.add_argument("--judge", choices=("on", "off", "both"), default="on",
                    help="batch table: the auto rows' generation judge (taps.judge; on: the default decoder), off, "
                         "or both side by side (each auto row twice)")
    ap.add_argument("--no-pack", action="store_true",
                    help="batch table: tree forwards over the padded [B, N] grid (SpeculativeDecoder.pack_trees "
                         "off), to compare with the packed default")
    ap.add_argument("--profile", action="store_true", help="also the per-phase table")
    ap.add_argument("--overhead", action="store_true", help="also the pure-overhead table")
    ap.add_argument("--overhead-only", action="store_true")
    ap.add_argument("--overhead-tokens", type=int, default=64)
    ap.add_argument("--overhead-rounds", type=int, default=5, help="rounds of the overhead table (fastest kept)")
    args = ap.parse_args()
    args.sampled_drafts = {"auto": "auto", "on": True, "off": False}[args.sampled_drafts]
    if args.table_depth < 1:
        ap.error(f"--table-depth must be >= 1, got {args.table_depth}")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    from taps.models import resolve_dtype

    dtype = resolve_dtype(args.dtype, device)
    if args.batch > 0:
        batch_table(args, device, dtype)
    elif not args.overhead_only:
        shipped_tables(args, device, dtype)
    if args.overhead or args.overhead_only:
        overhead_table(args, device)


if __name__ == "__main__":
    main()
