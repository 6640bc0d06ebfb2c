"""End-to-end speed with a large target and controlled acceptance (random weights; meant for a GPU).

    PYTHONPATH=python python bench/bench_e2e_synthetic.py --shape llama3-8b --device cuda
    PYTHONPATH=python python bench/bench_e2e_synthetic.py --shape llama-0.5b --device cpu --new-tokens 32
    PYTHONPATH=python python bench/bench_e2e_synthetic.py --shape tiny --device cpu      # logic check

Target: a Llama with the shape of Llama-3-8B (``--shape tiny``: a small one), random weights, bf16 (fp32
on the CPU), peaked (:func:`peak_target`: each layer's output projections scaled down and the lm_head set
so that token t's successor perm[t] leads its logits by a wide margin, about 31 standard deviations at
llama-0.5b against 0.16 for the plain random model, where fp32 and bf16 forwards then disagree on 5.5% of
the argmaxes; same shapes, same work; ``--flat``: the plain random model). Drafter: an EAGLE head of the target's shape (one decoder layer reading the target's
features, the target's lm_head: the cost of an EAGLE-2 drafter), whose proposals are steered to the
target's own greedy continuation, computed once with taps' autoregressive decoding of the same model (the
forwards verification runs; in fp32 it equals Hugging Face ``generate``'s, in bf16 a near-tie can round
the other way in HF's forward, and a continuation taken from HF then derails the oracle for good at the
first such token: tau 1.0 at p = 0.2 on an AMX Xeon): at every draft node on that continuation, the
continuation's next token gets the highest logit, except with probability ``p`` (``--corrupt``), when the
head's own random logits decide. So ``p`` sets the acceptance length tau (p = 0: every draft is
accepted, tau = depth + 1). In bf16 the tree forward can still round a near-tie apart from the one-token
forward that made the continuation (the products' row counts differ, and on AMX CPUs tree_attention rounds
P to bf16 for trees of 16 or more query rows per KV head, not for one-token steps), and a random model's
logits are near-flat, so with ``--flat`` bf16 derails the oracle (llama-0.5b, AMX Xeon, p = 0.2: tau 1.07,
against about 3 in fp32; Llama-3-8B shape on an H200: tau 1.00 at p = 0): the peaked target's margin keeps
it on track.

Rows: Hugging Face ``generate`` (greedy), taps ``autoregressive``, and for each p taps ``single`` with the
fixed settings and with ``budget="auto"`` (taps.Tuner: each step's depth and nodes, down to no draft, by
measured costs; ``--no-auto`` leaves it out): tokens/s, the ratios to Hugging Face and to taps
autoregressive, tau, the first (warm-up) generation's time, which holds the tuner's calibration, the
draft shapes the tuner chose most, and whether the output equals Hugging Face's greedy output (in bf16 the tree forward
and the one-token forward may round differently, so a near-tie can flip; the speed stands). Every row runs
once per round, the rows interleaved (``--repeats`` rounds, the fastest kept), so that a load that comes
and goes on a shared machine reaches every row alike.

``--draft-vocab N``: the head proposes from N target ids only (:meth:`taps.Drafter.set_draft_vocab`, as
EAGLE-3 heads do), so each of its levels reads N rows of the lm_head instead of the whole vocabulary. The
ids are the continuation's own tokens and random others: a reduced vocabulary of a corpus's most frequent
tokens holds most of a real text's tokens, and ``--corrupt`` already models the misses.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import machine_line, print_table  # noqa: E402

import transformers  # noqa: E402

from taps import EagleDrafter, SpeculativeDecoder  # noqa: E402
from taps.drafters.eagle import EagleGroup  # noqa: E402

SHAPES = {
    "llama3-8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                      num_attention_heads=32, num_key_value_heads=8, rope_parameters={"rope_type": "default",
                                                                                      "rope_theta": 500000.0}),
    # about 0.5B parameters (2 GB in fp32): far beyond a CPU's caches, so a one-token forward is bound by
    # memory bandwidth as on a GPU
    "llama-0.5b": dict(vocab_size=32000, hidden_size=1280, intermediate_size=3584, num_hidden_layers=24,
                       num_attention_heads=20, num_key_value_heads=4),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                 num_key_value_heads=2),
}

BONUS = 1e4
#: factor on each layer's output projections (o_proj, down_proj) of the peaked target (see peak_target)
LAYER_OUTPUT_SCALE = 1e-4


def peak_target(target, seed: int = 5) -> None:
    """Give the random target a greedy next token that its logits hold by a wide margin (in place): each
    layer's output projections scaled by LAYER_OUTPUT_SCALE, so the residual stream is nearly the token's
    embedding, and the lm_head row of token perm[t] set to the embedding of t, so the logit of perm[t] stands
    about sqrt(hidden) standard deviations above the rest (perm: a random permutation). The forwards cost what
    they did (same shapes, same work); what changes is that bf16's rounding can no longer flip a near-tie
    between the tree forward and the one-token forward, which on a random target's near-flat logits derails
    the oracle at once (Llama-3-8B shape, bf16, H200: tau 1.00 at p = 0)."""
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_OUTPUT_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_OUTPUT_SCALE)
        emb = target.model.embed_tokens.weight
        perm = torch.randperm(emb.shape[0], generator=torch.Generator().manual_seed(seed)).to(emb.device)
        target.lm_head.weight[perm] = emb


class _OracleGroup(EagleGroup):
    """An EAGLE head's group whose logits favour the oracle continuation (see the module docstring)."""

    def start(self, input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host=None):
        oracle = self.drafters[0].oracle
        self.prompt = prompt_lens.to(self.fc.weight.device).repeat(self.groups)
        self.continuation = oracle["tokens"].to(self.fc.weight.device).repeat(self.groups, 1)
        # the same corruption draws in every generation (the rounds of a row do the same work, so the
        # fastest is the least disturbed, not the luckiest)
        self.corrupt = oracle["corrupt"]
        self.gen = torch.Generator(device=self.fc.weight.device).manual_seed(oracle["seed"])
        # logits come over the draft vocabulary (token_map: its target ids) when it is reduced
        self.to_draft = None
        if self.token_map is not None:
            self.to_draft = torch.full((self.drafters[0].vocab_size,), -1, dtype=torch.int64,
                                       device=self.token_map.device)
            self.to_draft[self.token_map] = torch.arange(self.token_map.numel(), device=self.token_map.device)
        super().start(input_ids, prompt_lens, root, hidden, max_len, prompt_lens_host)

    def _steer(self, logits, offset, on_path):
        """Raise the oracle token at continuation index `offset` [R] for rows/nodes on the path."""
        width = self.continuation.shape[1]
        idx = offset.clamp(0, width - 1)
        target = self.continuation.gather(1, idx.view(idx.shape[0], -1)).view(idx.shape)
        keep = on_path & (offset < width)
        if self.to_draft is not None:
            target = self.to_draft[target]
            keep &= target >= 0
            target = target.clamp(min=0)
        keep &= torch.rand(keep.shape, generator=self.gen, device=keep.device) >= self.corrupt
        bonus = torch.zeros_like(logits).scatter_(-1, target.unsqueeze(-1), BONUS)
        return logits + bonus * keep.unsqueeze(-1)

    def _append(self, tokens, hidden, num_new, num_new_host):
        super()._append(tokens, hidden, num_new, num_new_host)
        # entry prompt - 1 holds the first generated token (continuation[0]) and the last entry the root,
        # so the token after the root is continuation[lengths - prompt + 1]
        self.base = self.lengths - self.prompt + 1
        self.root_logits = self._steer(self.root_logits, self.base, torch.ones_like(self.base, dtype=torch.bool))

    def forward_nodes(self, tokens, parent_slot, write_start, rope_pos, mask, level):
        logits = super().forward_nodes(tokens, parent_slot, write_start, rope_pos, mask, level)
        offset = self.base.unsqueeze(1) + level  # continuation index of each node's child
        expected = self.continuation.gather(1, (offset - 1).clamp(0, self.continuation.shape[1] - 1))
        match = tokens == expected
        if level > 1:
            match &= self.on_path.gather(1, parent_slot)
        self.on_path = match
        return self._steer(logits, offset, match)


class OracleDrafter(EagleDrafter):
    """An EAGLE head steered to a known continuation (benchmark only)."""

    oracle: dict = {}

    def group_key(self):
        return None

    @classmethod
    def make_group(cls, drafters):
        return _OracleGroup(drafters)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="llama3-8b", choices=sorted(SHAPES))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="auto", choices=("auto", "fp32", "bf16"),
                    help="auto: bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16, AMX), else fp32")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--corrupt", type=float, nargs="+", default=[0.0, 0.1, 0.25, 0.5, 1.0])
    ap.add_argument("--depth", type=int, default=5)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--budget", type=int, default=32)
    ap.add_argument("--draft-vocab", type=int, default=0,
                    help="the head proposes from this many target ids (0: all): the continuation's tokens and "
                         "random others (see the module docstring)")
    ap.add_argument("--repeats", type=int, default=2, help="rounds; every row runs once per round, interleaved")
    ap.add_argument("--clock", default="wall", choices=("wall", "process"),
                    help="process: CPU time of this process (other jobs' load left out; the tuner uses it too)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--no-auto", action="store_true", help="skip the budget='auto' rows")
    ap.add_argument("--no-fixed", action="store_true", help="skip the fixed-settings rows")
    ap.add_argument("--flat", action="store_true",
                    help="the plain random target (near-flat logits: in bf16 the oracle derails; see peak_target)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if args.clock == "process" and device.type == "cuda":
        ap.error("--clock process measures CPU time: use wall on CUDA")
    from taps.models import resolve_dtype
    from taps.tuner import Tuner

    clock = time.process_time if args.clock == "process" else time.perf_counter
    dtype = resolve_dtype(args.dtype, device)
    cfg = transformers.LlamaConfig(**SHAPES[args.shape], max_position_embeddings=8192, tie_word_embeddings=False)
    if not 0 <= args.draft_vocab <= cfg.vocab_size:
        ap.error(f"--draft-vocab must be in [0, {cfg.vocab_size}]")
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with torch.device(device):
        target = transformers.LlamaForCausalLM(cfg)
    if not args.flat:
        peak_target(target)
    target = target.to(dtype).eval()
    print(machine_line())
    print(f"target {args.shape} ({sum(p.numel() for p in target.parameters()) / 1e9:.2f}B parameters, "
          f"{str(dtype).replace('torch.', '')}, {device}) built in {time.perf_counter() - t0:.0f}s; prompt "
          f"{args.prompt_len}, {args.new_tokens} new tokens, batch 1; depth {args.depth}, top_k {args.top_k}, "
          f"budget {args.budget}; draft vocabulary {args.draft_vocab or 'full'}; {args.clock} clock, "
          f"best of {args.repeats} interleaved rounds")
    prompt = torch.randint(0, cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(1))
    ids = prompt.to(device)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    def timed(fn):
        sync()
        t = clock()
        out = fn()
        sync()
        return clock() - t, out

    hf_kw = dict(max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False,
                 attention_mask=torch.ones_like(ids), pad_token_id=0)
    with torch.no_grad():
        target.generate(ids, **{**hf_kw, "max_new_tokens": 4, "min_new_tokens": 4})  # warm-up
        _, hf_out = timed(lambda: target.generate(ids, **hf_kw))
    reference = hf_out[0, ids.shape[1]:].tolist()
    autoregressive = SpeculativeDecoder(target, [], strategy="autoregressive")
    prompt_ids = prompt[0].tolist()
    # the oracle's continuation: what taps' own greedy decoding emits (HF's in fp32; see the docstring)
    continuation = torch.tensor([autoregressive.generate(prompt_ids, max_new_tokens=args.new_tokens).tokens[0]],
                                device=device)
    vocab = None
    if args.draft_vocab:
        # the continuation's tokens (a vocabulary of a corpus's most frequent tokens holds most of a real
        # text's), filled with random ids: what the reduced head saves is its cost, not its hits
        seen = torch.unique(continuation[0].cpu())
        rest = torch.randperm(cfg.vocab_size, generator=torch.Generator().manual_seed(4))
        rest = rest[~torch.isin(rest, seen)][:max(args.draft_vocab - seen.numel(), 0)]
        vocab = torch.cat([seen, rest])[:args.draft_vocab]

    head_cfg = copy.deepcopy(cfg)
    head_cfg.num_hidden_layers = 1
    rows = [("HF generate", "-", None)]
    rows.append(("taps autoregressive", "-", autoregressive))
    for p in args.corrupt:
        for auto in (() if args.no_fixed else (False,)) + (() if args.no_auto else (True,)):
            torch.manual_seed(3)  # the same head whatever the runs before drew from the global generator
            drafter = OracleDrafter(head_cfg)
            drafter.oracle = {"tokens": continuation, "corrupt": p, "seed": 2}
            if vocab is not None:
                drafter.set_draft_vocab(vocab)
            dec = SpeculativeDecoder(target, [drafter], strategy="single", depth=args.depth, top_k=args.top_k,
                                     budget=args.budget, tuner=Tuner(timer=clock) if auto else None)
            rows.append(("taps single auto, oracle drafter" if auto else "taps single, oracle drafter", f"{p:g}",
                         dec))
    warm = []
    for _, _, dec in rows[1:]:
        t = time.perf_counter()
        dec.generate(prompt_ids, max_new_tokens=4)  # warm-up (allocations, packing, the tuner's calibration)
        warm.append(time.perf_counter() - t)
    best = [float("inf")] * len(rows)
    last = [None] * len(rows)
    for _ in range(args.repeats):
        for i, (_, _, dec) in enumerate(rows):
            if dec is None:
                with torch.no_grad():
                    sec, _ = timed(lambda: target.generate(ids, **hf_kw))
            else:
                sec, last[i] = timed(lambda: dec.generate(prompt_ids, max_new_tokens=args.new_tokens))
            best[i] = min(best[i], sec)
    hf_tps = args.new_tokens / best[0]
    ar_tps = args.new_tokens / best[1]
    table = [["HF generate", "-", f"{hf_tps:.2f}", "1.00x", f"{hf_tps / ar_tps:.2f}x", "-", "-", "-", "yes"]]
    for i, (name, p, dec) in enumerate(rows[1:], 1):
        out = last[i]
        tps = len(out.tokens[0]) / best[i]
        same = "yes" if out.tokens[0] == reference[:len(out.tokens[0])] else "no (bf16 rounding?)"
        shapes = out.summary.get("shape_histogram") or {}
        top = ", ".join(f"{k} {v / max(sum(shapes.values()), 1):.0%}" for k, v in list(shapes.items())[:3])
        table.append([name, p, f"{tps:.2f}", f"{tps / hf_tps:.2f}x", f"{tps / ar_tps:.2f}x", f"{warm[i - 1]:.1f}s",
                      top or "-", f"{out.summary['tau']:.2f}", same])
    print_table(["row", "corrupt p", "tokens/s", "vs HF generate", "vs taps AR", "warm-up", "auto: shapes", "tau",
                 "= HF greedy"], table, title="End to end, synthetic target, controlled acceptance")
    # what the tuner measured (and corrected online) on this machine: why it chose what it chose
    print("\nThe tuners' measured costs (batch 1)")
    for name, p, dec in rows[1:]:
        if dec is not None and dec.tuner is not None:
            print(f"{name}, p = {p}: {cost_summary(dec.tuner.costs, batch=1, ar_seconds=best[1] / args.new_tokens)}")


def cost_summary(costs, batch: int, ar_seconds: float) -> str:
    """One line of a tuner's cost model at a batch size: the target's tree forward per node count, each
    drafter group's expansion per depth and its append of one token, in ms and as multiples of the
    measured autoregressive step (``ar_seconds``)."""
    ms = lambda s: f"{s * 1e3:.1f} ms ({s / ar_seconds:.2f})"  # noqa: E731
    points = costs.forward_points.get(batch, [])
    parts = ["forward " + ", ".join(f"{n} nodes {ms(costs.forward(n, batch))}" for n, _ in points)]
    for group, b in costs.draft_points:
        if b == batch:
            d0, _, d1, _ = costs.draft_points[(group, b)]
            parts.append(f"drafters {group}: " + ", ".join(f"depth {d} {ms(costs.draft(group, d, batch))}"
                                                          for d in sorted({d0, d1}))
                         + f", append of 1 token {ms(costs.update(group, 1, batch))}")
    return "; ".join(parts) + " (x the autoregressive step)"


if __name__ == "__main__":
    main()
