"""Training of EAGLE-3 heads (:class:`taps.drafters.eagle3.Eagle3Drafter`) on the target's multi-layer features.

``taps train drafter --family eagle3`` runs :func:`train_eagle3` (:mod:`taps.train.cli`) with the same
data, blocks, block order, optimiser, schedule, training loop, checkpointing and export as the EAGLE-2 /
HASS families (:mod:`taps.train.drafter`); what differs:

- features: the inputs of the target layers :func:`taps.drafters.eagle3.feature_layers` picks (1, 2, 3 for the
  shipped 4-layer target), concatenated, cached per domain beside the final-hidden-state cache
  (``<feature_dir>/<domain>-layers-<i>-<j>-<k>.pt``, bf16, k * H * 2 bytes per token). The final
  hidden states still give the target's next-token distribution.
- draft vocabulary: the ``draft_vocab`` most frequent target tokens of the drafters' training data, from
  the target folder's ``token_counts.json`` (``taps train vocab``: both domains, so every head of a target
  shares one vocabulary and can be averaged or batched) or, without that file, counted over this run's
  training blocks. d2t / t2d as the reference builds them (:func:`taps.drafters.eagle3.vocab_mapping`). The head's
  ``lm_head`` starts as the target's lm_head rows of those tokens and its ``norm`` as the target's final
  norm.
- objective (the reference's "training-time test"): the head is unrolled over ``ttt_steps`` steps. Step
  0 reads (token t + 1, fused target features at t) at position t, as a committed entry does at
  inference; step i reads (token t + 1 + i, the head's own step i - 1 output at column t) at position
  t + i and attends to the step-0 keys at positions <= t and to the step-1 .. i keys of its own column:
  exactly the context of a depth-i node in a draft tree whose root is entry t (tested against the
  inference forward). Step i's loss is the cross-entropy between the head's draft-vocabulary
  distribution and the target's next-token distribution at position t + 1 + i restricted to the draft
  vocabulary, over positions whose target top-1 token is in the draft vocabulary; steps are weighted
  0.8^i (normalised to sum 1). No feature regression and no input noise.

Metrics: ``acc@j`` (j = 1 .. ttt_steps during training; 1 .. 5 held out) is the share of positions where
the head's top-1 token (mapped to target ids) equals the target's top-1 token after j - 1 steps of
feeding back its own features, comparable to the EAGLE-2 / HASS ``acc@j``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from . import dist as D
from .drafter import (DOMAINS, TARGET_DTYPES, DrafterTrainConfig, drafter_config, export_drafter, load_domain_features,
                      training_loop)
from .loop import check_batches

__all__ = ["train_eagle3", "new_eagle3_drafter", "unrolled_logits", "eagle3_losses", "UnrolledAttention",
           "draft_vocabulary", "HELDOUT_STEPS", "STEP_WEIGHT"]

HELDOUT_STEPS = 5  # held-out acc@1 .. acc@5 (the depth of the evaluation trees)
STEP_WEIGHT = 0.8  # loss weight of unrolled step i: STEP_WEIGHT ** i (the reference's)


# ------------------------------------------------------------------------------------------ the model

def new_eagle3_drafter(target, draft_ids: Optional[Tensor], layers: Sequence[int]):
    """An Eagle3Drafter shaped like the target's decoder layers, reading target layers `layers`, over the
    draft vocabulary `draft_ids` (target ids; None = the whole vocabulary), bound to `target`; its
    lm_head starts as the target's rows of those tokens, its norm as the target's final norm."""
    from taps.drafters.eagle3 import Eagle3Drafter, vocab_mapping

    vocab = int(target.get_output_embeddings().weight.shape[0])
    cfg = drafter_config(target.config, 1)
    cfg.draft_vocab_size = vocab if draft_ids is None else int(draft_ids.numel())
    cfg.eagle_aux_hidden_state_layer_ids = [int(i) for i in layers]
    drafter = Eagle3Drafter(cfg).to(torch.float32)
    if draft_ids is not None:
        drafter.set_vocab_mapping(vocab_mapping(draft_ids, vocab)[0])
    with torch.no_grad():
        drafter.lm_head.weight.copy_(target.get_output_embeddings().weight[drafter.draft_token_ids()])
        final_norm = getattr(target.get_decoder() if hasattr(target, "get_decoder") else target.model, "norm", None)
        if final_norm is not None and final_norm.weight.shape == drafter.norm.weight.shape:
            drafter.norm.weight.copy_(final_norm.weight)
    drafter.bind(target)
    return drafter.to(torch.float32)


class UnrolledAttention:
    """The attention of the unrolled steps (an ``attend`` callback of :mod:`taps.lean`): step 0's
    queries see step 0's keys causally; step i's query at column t sees step 0's keys at columns <= t
    and the keys of steps 1 .. i at column t (its draft ancestors and itself). One instance serves one
    unrolled pass: each call is the next step, and its keys are kept for the later ones."""

    def __init__(self, scale: float):
        self.scale = scale
        self.causal: Optional[Tensor] = None  # additive causal mask [T, T]
        self.keys: List[Tensor] = []
        self.values: List[Tensor] = []

    def __call__(self, index: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)          # [B, H, T, D]
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        self.keys.append(k)
        self.values.append(v)
        n = q.shape[2]
        if self.causal is None or self.causal.shape[0] != n:
            self.causal = torch.full((n, n), float("-inf"), dtype=q.dtype, device=q.device).triu(1)
        first = torch.baddbmm(self.causal, q.flatten(0, 1), self.keys[0].flatten(0, 1).transpose(-1, -2),
                              alpha=self.scale).view(*q.shape[:3], n)               # [B, H, T, T]
        if len(self.keys) == 1:
            return torch.softmax(first, -1) @ self.values[0]
        # softmax over [first, own scores] without concatenating: one log-normaliser for both parts
        own = torch.stack([(q * key).sum(-1) for key in self.keys[1:]], -1) * self.scale  # [B, H, T, i]
        lse = torch.logaddexp(first.logsumexp(-1), own.logsumexp(-1)).unsqueeze(-1)
        out = torch.exp(first - lse) @ self.values[0]
        return out + (torch.exp(own - lse).unsqueeze(-1) * torch.stack(self.values[1:], -2)).sum(-2)


def unrolled_logits(drafter, weights, tokens: Tensor, fused: Tensor, steps: int, rope=None) -> List[Tensor]:
    """Draft-vocabulary logits [B, n, Vd] of unrolled steps 0 .. steps - 1 (see the module docstring).

    tokens: [B, n] the block's tokens x_0 .. x_{n-1}; fused: [B, n, k * H] the fused target features at
    positions 0 .. n-1; weights: :class:`taps.drafters.eagle3.Eagle3Weights` of the drafter (autograd flows to its
    parameters). Step i's column t reads token x_{t+1+i} (0 past the block's end; its outputs there are
    not used)."""
    from taps.lean import RopeTable

    b, n = tokens.shape
    rope = rope or RopeTable(drafter.rotary, fused.dtype)
    rope.ensure(n + steps, fused.device)
    attend = UnrolledAttention(weights.layer.scale)
    embed = drafter.embedding_weight()
    pos = torch.arange(n, device=fused.device).unsqueeze(0).expand(b, n)
    h, out = fused.reshape(1, b * n, -1), []
    for i in range(steps):
        ids = torch.zeros_like(tokens)
        ids[:, :n - 1 - i] = tokens[:, 1 + i:]
        emb = F.embedding(ids, embed).to(fused.dtype).view(1, b * n, -1)
        cos, sin = rope(pos + i)
        h = weights.hidden(emb, h, i == 0, cos, sin, attend, b, n)
        out.append(weights.logits(h).view(b, n, -1))
    return out


@torch.no_grad()
def target_top1(head_w: Tensor, final: Tensor, micro: int = 8) -> Tensor:
    """The target's top-1 next tokens [B, n] of final features [B, n, H] (``final @ head_w.T``), in
    micro-batches of blocks, on head_w's device."""
    return torch.cat([(final[i:i + micro].to(head_w.device, torch.float32) @ head_w.t()).argmax(-1)
                      for i in range(0, len(final), micro)])


def masked_counts(drafter, top1: Tensor, steps: int) -> List[float]:
    """The number of positions each unrolled step's loss averages over in blocks whose target top-1
    tokens are `top1` [B, n]: those whose top-1 token is in the draft vocabulary."""
    in_vocab = drafter.t2d[top1]
    return [float(in_vocab[:, 1 + i:].sum()) for i in range(min(steps, top1.shape[1] - 1))]


def eagle3_losses(drafter, head_w: Tensor, tokens: Tensor, fused: Tensor, final: Tensor, steps: int,
                  rope=None, counts: Optional[Sequence[float]] = None,
                  top1: Optional[Tensor] = None) -> Tuple[Tensor, Dict[str, float]]:
    """(weighted loss, metrics) of one batch: tokens [B, n] long, fused [B, n, k * H] and final [B, n, H]
    (the target's final normalised hidden states) fp32; head_w: the target's lm_head weight [V, H];
    top1: the target's top-1 tokens [B, n] (:func:`target_top1`; computed when not given).

    Step i's loss is the sum of its positions' cross-entropies divided by ``counts[i]`` (default: the
    number of those positions in this batch, :func:`masked_counts`). A micro-batch of b rows of a global
    batch of B rows passes the global batch's counts times b / B, so that its rows' share of the mean
    loss, and of the gradient, is what it is in the whole batch, however the batch is split."""
    from taps.drafters.eagle3 import Eagle3Weights

    n = tokens.shape[1]
    ids = drafter.draft_token_ids()
    with torch.no_grad():
        if top1 is None:
            top1 = target_top1(head_w, final, micro=len(final))
        in_vocab = drafter.t2d[top1]
        target_p = torch.softmax(final @ head_w[ids].t(), -1)              # [B, n, Vd]
    logits = unrolled_logits(drafter, Eagle3Weights([drafter]), tokens, fused, steps, rope)
    total, weight_sum, metrics = 0.0, 0.0, {}
    for i, lg in enumerate(logits):
        cols = n - 1 - i
        if cols < 1:
            break
        logq = torch.log_softmax(lg[:, :cols].float(), -1)
        mask = in_vocab[:, 1 + i:].float()
        ce = -(target_p[:, 1 + i:] * logq).sum(-1)
        denom = mask.sum().clamp_min(1.0) if counts is None else max(float(counts[i]), 1e-9)
        loss = (ce * mask).sum() / denom
        w = STEP_WEIGHT ** i
        total = total + w * loss
        weight_sum += w
        metrics[f"ce@{i + 1}"] = float(loss.detach())
        metrics[f"acc@{i + 1}"] = float((ids[logq.detach().argmax(-1)] == top1[:, 1 + i:]).float().mean())
    return total / weight_sum, metrics


# ------------------------------------------------------------------------------------------------ data

def draft_vocabulary(cfg: DrafterTrainConfig, vocab: int,
                     train_blocks: Sequence[Tensor]) -> Tuple[Optional[Tensor], dict]:
    """(draft token ids or None for the whole vocabulary, info): the cfg.draft_vocab most frequent target
    tokens by the target folder's token_counts.json, else counted over `train_blocks`."""
    from taps.vocab import count_tokens, coverage, load_token_counts, top_tokens

    size = int(cfg.draft_vocab)
    if size <= 0 or size >= vocab:
        return None, {"size": vocab, "source": "the whole vocabulary"}
    try:
        counts, src = load_token_counts(cfg.target)
        if counts.numel() != vocab:
            raise ValueError("vocabulary size differs")
        source = {"file": "token_counts.json of the target", "counted": src.get("command")}
    except ValueError:
        counts = count_tokens(train_blocks, vocab)
        source = {"file": None, "counted": "this run's training blocks"}
    ids = top_tokens(counts, size)
    return ids, {"size": size, "source": source, "coverage_of_counted_tokens": round(coverage(counts, ids), 4)}


@torch.no_grad()
def target_layer_features(target, blocks: Tensor, layers: Sequence[int], device, micro: int = 8, desc: str = "",
                          quiet: bool = False) -> Tensor:
    """The inputs of target layers `layers` concatenated, [n, L, len(layers) * H] bf16 on the CPU, of
    token blocks [n, L]."""
    from tqdm import tqdm

    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    out = []
    for i in tqdm(range(0, len(blocks), micro), desc=desc, disable=quiet, unit="batch", file=sys.stderr,
                  mininterval=1.0 if sys.stderr.isatty() else 30.0):
        x = blocks[i:i + micro].to(device=device, dtype=torch.long)
        hs = base(input_ids=x, output_hidden_states=True).hidden_states
        out.append(torch.cat([hs[j] for j in layers], -1).to("cpu", torch.bfloat16))
    width = len(layers) * target.config.hidden_size
    return torch.cat(out) if out else torch.zeros((0, blocks.shape[1], width), dtype=torch.bfloat16)


def load_layer_features(domain: str, cfg: DrafterTrainConfig, feats, layers: Sequence[int], target, device,
                        ctx: Optional[D.DistContext] = None):
    """(train [n, L, kH], heldout [m, L, kH]) layer features of the blocks of :class:`DomainFeatures`
    `feats`, from ``<feature_dir>/<domain>-layers-<...>.pt`` when it holds them, else computed and cached.
    Under torchrun every rank computes its share of the blocks; rank 0 joins the shares into the cache."""
    ctx = ctx or D.DistContext(device=torch.device(device))
    cache = Path(cfg.feature_dir) / f"{domain}-layers-{'-'.join(str(i) for i in layers)}.pt"
    n = len(feats.train)
    key = json.dumps(feats.info.get("key"), sort_keys=True)  # the target's and tokenizer's digests, seq len, seed

    def cached():
        if not cache.exists():
            return None
        st = torch.load(cache, weights_only=True, mmap=True)
        if (st.get("key") == key and st["layers"] == list(layers) and len(st["train"]) >= n
                and torch.equal(st["train"][:n], feats.train) and torch.equal(st["heldout"], feats.heldout)):
            return st["train_layers"][:n], st["heldout_layers"]
        return None

    hit = cached()
    if ctx.agree(hit is not None):
        ctx.barrier()
        return hit if hit is not None else cached()
    t0 = time.time()
    parts = {}
    micro = 8  # every rank computes whole micro-batches, so the features do not depend on the number of ranks
    for name, blocks in (("train", feats.train), ("heldout", feats.heldout)):
        lo, hi = ctx.shard(0, -(-len(blocks) // micro))
        parts[name] = target_layer_features(target, blocks[lo * micro:hi * micro], layers, device, micro=micro,
                                            quiet=cfg.quiet or not ctx.is_main or name != "train",
                                            desc=f"{domain} layer features")
    shard = cache.with_name(f"{cache.stem}.rank{ctx.rank}.tmp")
    cache.parent.mkdir(parents=True, exist_ok=True)
    if ctx.distributed:
        torch.save(parts, shard)
    ctx.barrier()
    if ctx.is_main:
        if ctx.distributed:
            shards = [cache.with_name(f"{cache.stem}.rank{r}.tmp") for r in range(ctx.world_size)]
            loaded = [torch.load(f, weights_only=True) for f in shards]
            parts = {k: torch.cat([p[k] for p in loaded]) for k in parts}
        st = {"key": key, "layers": list(layers), "train": feats.train, "heldout": feats.heldout, "train_layers": parts["train"],
              "heldout_layers": parts["heldout"]}
        tmp = cache.with_suffix(".tmp")
        torch.save(st, tmp)
        os.replace(tmp, cache)
        if ctx.distributed:
            for f in shards:
                f.unlink()
        print(f"[train drafter] {domain}: target layers {list(layers)} of {n} blocks in {time.time() - t0:.0f}s "
              f"({ctx.world_size} process(es)) -> {cache}", flush=True)
    ctx.barrier()
    return cached()


class _Blocks:
    """The run's training blocks in the EAGLE-2 / HASS runs' order, read lazily per batch from the
    per-domain (memory-mapped) caches: tokens, fused layer features, final features, domain id."""

    def __init__(self, parts: Dict[str, tuple], used: Sequence[str], seed: int):
        self.parts = parts
        self.index = [(d, i) for d in used for i in range(len(parts[d][0]))]
        perm = torch.randperm(len(self.index), generator=torch.Generator().manual_seed(seed))
        self.index = [self.index[int(j)] for j in perm]

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, sl: slice, device):
        picked = self.index[sl]
        rows = {k: [] for k in range(3)}
        for d, i in picked:
            for k in range(3):
                rows[k].append(self.parts[d][k][i])
        tokens = torch.stack(rows[0]).to(device=device, dtype=torch.long)
        fused, final = (torch.stack(rows[k]).to(device=device, dtype=torch.float32) for k in (1, 2))
        return tokens, fused, final, self.domains(sl)

    def finals(self, sl: slice, device) -> Tensor:
        """The final features [b, n, H] fp32 of the rows in `sl`."""
        return torch.stack([self.parts[d][2][i] for d, i in self.index[sl]]).to(device=device, dtype=torch.float32)

    def domains(self, sl: slice) -> List[int]:
        """Domain ids (indices into DOMAINS) of the rows in `sl`."""
        return [DOMAINS.index(d) for d, _ in self.index[sl]]


def eagle3_data(cfg: DrafterTrainConfig, target, tok, device, layers: Sequence[int],
                ctx: Optional[D.DistContext] = None):
    """(training blocks, {domain: (heldout tokens, fused, final)}, data info, the training token blocks)."""
    if cfg.data == "mixed":
        want = {"math": cfg.tokens // 2, "chat": cfg.tokens - cfg.tokens // 2}
    else:
        want = {cfg.data: cfg.tokens}
    base = {d: load_domain_features(d, cfg, want.get(d, 1), target, tok, device, ctx) for d in DOMAINS}
    layer_feats = {d: load_layer_features(d, cfg, base[d], layers, target, device, ctx) for d in DOMAINS}
    used = [d for d in DOMAINS if d in want]
    parts = {d: (base[d].train, layer_feats[d][0], base[d].train_feat) for d in used}
    held = {d: (base[d].heldout, layer_feats[d][1], base[d].heldout_feat) for d in DOMAINS}
    info = {d: {"train_tokens": int(base[d].train.numel()) if d in want else 0,
                "heldout_tokens": int(base[d].heldout.numel()),
                **{k: v for k, v in base[d].info.items() if k not in ("key", "train_tokens", "heldout_tokens")}}
            for d in DOMAINS}
    return _Blocks(parts, used, cfg.seed), held, info, [base[d].train for d in used]


def heldout_metrics(model: D.DataParallelModel, held: tuple, device, micro: int = 8) -> dict:
    """Held-out ce@j / acc@j, j = 1 .. HELDOUT_STEPS (token-weighted means) of the head in ``model`` (its
    loss :func:`eagle3_losses`); the blocks are shared out over the ranks. ``held``: (tokens, fused,
    final, the target's top-1 tokens, the held-out set's :func:`masked_counts`)."""
    tokens, fused, final, top1, counts = held
    model.module.eval()

    def run(a, b):
        x = tokens[a:b].to(device=device, dtype=torch.long)
        f, g = (t[a:b].to(device=device, dtype=torch.float32) for t in (fused, final))
        return model(x, f, g, HELDOUT_STEPS, [c * (b - a) / len(tokens) for c in counts], top1[a:b])[1]

    res = model.mean_over(len(tokens), micro, run)
    model.module.train()
    return {k: round(v, 5) for k, v in res.items()}


# ------------------------------------------------------------------------------------------------ main

def train_eagle3(cfg: DrafterTrainConfig) -> dict:
    """Train (or resume) one EAGLE-3 head (``cfg.family`` eagle3); export it when finished. Returns a summary
    dict. Under torchrun every rank calls this (data parallel, :mod:`taps.train.dist`); only rank 0 writes
    files."""
    if cfg.family != "eagle3":
        raise ValueError(f"train_eagle3 trains the eagle3 family, not {cfg.family}")
    with cfg.distributed() as ctx:
        return _train_eagle3(cfg, ctx)


def _train_eagle3(cfg: DrafterTrainConfig, ctx: D.DistContext) -> dict:
    from taps.drafters.eagle3 import feature_layers
    from taps.lean import RopeTable
    from taps.models import load_target

    device = ctx.device
    target, tok = load_target(cfg.target, dtype=TARGET_DTYPES[cfg.target_dtype], verify=False)
    target.to(device).requires_grad_(False)
    layers = (tuple(int(i) for i in cfg.feature_layers.split(",")) if cfg.feature_layers
              else feature_layers(target.config.num_hidden_layers))
    blocks, held, data_info, train_blocks = eagle3_data(cfg, target, tok, device, layers, ctx)
    total_steps = len(blocks) // cfg.batch_size
    check_batches(cfg, ctx, len(blocks))
    vocab = int(target.get_output_embeddings().weight.shape[0])
    draft_ids, vocab_info = draft_vocabulary(cfg, vocab, train_blocks)
    torch.manual_seed(cfg.seed)
    drafter = new_eagle3_drafter(target, draft_ids, layers).to(device)
    drafter.train()
    head_w = target.get_output_embeddings().weight.detach().float()
    rope = RopeTable(drafter.rotary, torch.float32)
    model = D.DataParallelModel(
        drafter, lambda d, x, fused, final, steps, counts, top1: eagle3_losses(d, head_w, x, fused, final, steps,
                                                                               rope, counts, top1), ctx, fsdp=cfg.fsdp)
    for d in DOMAINS:  # the held-out set's target top-1 tokens and counts, once
        top1 = target_top1(head_w, held[d][2])
        held[d] = (*held[d], top1, masked_counts(drafter, top1, HELDOUT_STEPS))
    batch: Dict[int, Tuple[Tensor, List[float]]] = {}  # the current global batch's (top-1, counts), by its first row

    def run(a, b, start):  # rows [a, b)'s share of the batch's mean loss, and their metrics
        if start not in batch:  # the whole batch's, on every rank
            top1 = target_top1(head_w, blocks.finals(slice(start, start + cfg.batch_size), device))
            batch.clear()
            batch[start] = (top1, masked_counts(drafter, top1, cfg.ttt_steps))
        top1, counts = batch[start]
        x, fused, final, _ = blocks.batch(slice(a, b), device)
        return model(x, fused, final, cfg.ttt_steps, [c * (b - a) / cfg.batch_size for c in counts],
                     top1[a - start:b - start])

    def export(state, summary):
        final = new_eagle3_drafter(target, draft_ids, layers)
        final.load_state_dict(state)
        extra = {"draft_vocab": vocab_info, "feature_layers": list(layers), "ttt_steps": cfg.ttt_steps,
                 "step_weight": STEP_WEIGHT}
        export_drafter(final, cfg, data_info, summary, device, extra=extra)

    def domains(sl):
        ids = blocks.domains(sl)
        return [ids.count(i) for i in range(len(DOMAINS))]

    return training_loop(
        cfg, model, total_steps, cfg.seq_len, run,
        evaluate=lambda: {d: heldout_metrics(model, held[d], device, cfg.micro_batch or 8) for d in DOMAINS},
        domains=domains, export=export,
        header=f"target layers {list(layers)}, draft vocabulary {vocab_info['size']}, {cfg.ttt_steps} unrolled steps")
