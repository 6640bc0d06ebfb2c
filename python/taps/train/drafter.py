"""Training of EAGLE-style feature drafters on the target's features (EAGLE-2 and HASS objectives).

One code path for the small CPU models shipped with the project and for real targets on a GPU:

- drafter: :class:`taps.drafters.EagleDrafter` (``fc`` over [token embedding, target feature], one Llama
  decoder layer shaped like the target's layers, the target's own lm_head and embeddings, frozen);
- data: one domain (``math``: GSM8K + MATH train worked solutions; ``chat``: ShareGPT) or ``mixed``
  (half the tokens from each), in the chat template, packed into blocks of ``seq_len`` tokens. The
  target's final normalised hidden states of every block (its *features*) are computed once per
  domain and cached in ``feature_dir`` (bf16), so every drafter of a domain reads the same blocks
  and features; a drafter trained on fewer tokens reads a prefix of them;
- objectives (``family``):

  - ``eagle2`` (EAGLE-1/2 training): the drafter reads (token t+1, target feature f_t) and predicts
    f_{t+1}; loss = ``reg_weight`` * SmoothL1(f^_{t+1}, f_{t+1}) + ``cls_weight`` * CE(p, q) where
    p = softmax(lm_head(f_{t+1})) is the target's next-token distribution and q the drafter's. The
    input features get uniform noise of amplitude ``noise`` (EAGLE's data augmentation);
  - ``hass`` (HASS): the same two terms plus top-k distillation (``topk_weight`` *
    -sum over the target's top ``topk`` tokens of p log q), and harmonized context alignment over
    ``align_steps`` steps: at step j the drafter's input features are its own predictions of step
    j - 1, and the query at position t sees the keys of positions t - j + 1 .. t computed at the later
    steps (its own features), earlier keys from the target's features - the context it has at depth j
    of the draft tree. The loss is the mean over the steps.
- data parallel under ``torchrun`` (:mod:`taps.train.dist`): ``batch_size`` is the global batch, each
  rank trains on its share of it (in micro-batches of ``micro_batch`` sequences when set) and the
  gradients are averaged (DDP, or FSDP with ``fsdp``); feature extraction is sharded over the ranks,
  which write into the same memory-mapped cache; the feature noise of a sequence is drawn from its
  index, so N processes reach the weights of one up to float reduction order;
- bookkeeping in ``run_dir`` (rank 0): ``checkpoint.pt`` (the full state: resumable with any number of
  processes), ``log.jsonl`` (losses, held-out metrics);
- export: ``out`` gets the drafter in the public EAGLE layout (config.json + model.safetensors, bf16)
  and manifest.json (data, tokens seen, steps, final losses and held-out accuracy per alignment step
  and domain, seed, world size and backend, sha256 of every file).

The held-out metric ``acc@j`` is the share of positions where the drafter's top-1 token equals the
target's, with the drafter's own features fed back j - 1 times (j = 1 is EAGLE's "acc").
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor

from ..arguments import check_ranges
from ..models import FAMILIES  # the shipped families are the training objectives
from . import dist as D
from .data import REPO_ROOT
from .loop import (RunConfig, add_run_arguments, check_batches, checkpoint_if_due, finish_run, lr_at, make_optimizer,
                   pack, recent_train_loss, resume)

DATA_MIXES = ("math", "chat", "mixed")
DOMAINS = ("math", "chat")
EVAL_STEPS = 3  # alignment steps of the held-out accuracy (acc@1 .. acc@3)
TARGET_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


@dataclass
class DrafterTrainConfig(RunConfig):
    target: Path = REPO_ROOT / "models" / "target"
    name: Optional[str] = None  # default "<family>-<data>" (e.g. hass-math, eagle2-mixed2 for 2x tokens)
    out: Optional[Path] = None  # default models/drafters/<name>
    run_dir: Optional[Path] = None  # default runs/drafters/<name>
    feature_dir: Path = REPO_ROOT / "runs" / "drafters" / "features"
    family: str = "eagle2"
    data: str = "math"
    tokens: int = 1_000_000  # mixed: half from each domain
    heldout_tokens: int = 16_384
    seq_len: int = 512
    batch_size: int = 8
    micro_batch: int = 0  # at most this many sequences per forward on a rank (0: the rank's whole share)
    lr: float = 3e-3
    min_lr: float = 3e-4
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 0.5
    reg_weight: float = 1.0
    cls_weight: float = 0.1
    topk_weight: float = 1.0  # hass only
    topk: int = 10  # hass only
    align_steps: int = 3  # hass only (eagle2 trains one step)
    noise: float = 0.1
    target_dtype: str = "float32"  # the target's weights while it computes features (bfloat16 halves them)
    draft_vocab: int = 2048  # eagle3 only: the head's draft vocabulary (0 = the whole vocabulary)
    ttt_steps: int = 7  # eagle3 only: unrolled steps of the training-time test
    # eagle3 only: target layers read, e.g. "1,2,3" (default taps.drafters.eagle3.feature_layers)
    feature_layers: str = ""
    eval_every: int = 50

    def __post_init__(self):
        if self.family not in FAMILIES:
            raise ValueError(f"family must be one of {FAMILIES}, got {self.family!r}")
        if self.data not in DATA_MIXES:
            raise ValueError(f"data must be one of {DATA_MIXES}, got {self.data!r}")
        if self.target_dtype not in TARGET_DTYPES:
            raise ValueError(f"target_dtype must be one of {tuple(TARGET_DTYPES)}, got {self.target_dtype!r}")
        check_ranges(self, dict(seq_len=(1, None), topk=(1, None), align_steps=(1, None), ttt_steps=(1, None),
                                micro_batch=(0, None), reg_weight=(0, None), cls_weight=(0, None),
                                topk_weight=(0, None), noise=(0, None), draft_vocab=(0, None)))
        super().__post_init__()
        self.name = self.name or f"{self.family}-{self.data}"
        self.out = Path(self.out) if self.out else REPO_ROOT / "models" / "drafters" / self.name
        self.run_dir = Path(self.run_dir) if self.run_dir else REPO_ROOT / "runs" / "drafters" / self.name

    @property
    def steps_per_batch(self) -> int:
        return {"hass": self.align_steps, "eagle3": self.ttt_steps}.get(self.family, 1)

    def run_key(self) -> dict:
        keys = ("family", "data", "tokens", "heldout_tokens", "seq_len", "batch_size", "lr", "min_lr",
                "warmup_steps", "weight_decay", "grad_clip", "reg_weight", "cls_weight", "topk_weight", "topk",
                "align_steps", "noise", "seed", "target_dtype")
        if self.family == "eagle3":
            keys += ("draft_vocab", "ttt_steps", "feature_layers")
        return {k: getattr(self, k) for k in keys}


def add_drafter_arguments(p) -> None:
    d = DrafterTrainConfig()
    p.add_argument("--family", choices=FAMILIES, default=d.family,
                   help="training objective: eagle2, hass or eagle3 (an EAGLE-3 head, taps.train.eagle3)")
    p.add_argument("--data", choices=DATA_MIXES, default=d.data, help="math, chat or mixed (half each)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="training tokens (one pass)")
    p.add_argument("--name", default=None, help="checkpoint name (default <family>-<data>)")
    p.add_argument("--target", type=Path, default=d.target, help="target model folder (taps train target)")
    p.add_argument("--target-dtype", choices=tuple(TARGET_DTYPES), default=d.target_dtype,
                   help="the target's weights while it computes the features (bfloat16: half the memory)")
    p.add_argument("--out", type=Path, default=None, help="export folder (default models/drafters/<name>)")
    p.add_argument("--run-dir", type=Path, default=None, help="checkpoint and log (default runs/drafters/<name>)")
    p.add_argument("--feature-dir", type=Path, default=d.feature_dir, help="cache of target features per domain")
    p.add_argument("--micro-batch", type=int, default=d.micro_batch, help="at most this many sequences per forward "
                   "on a rank; the rest by gradient accumulation (0: the rank's whole share at once)")
    for k in ("reg_weight", "cls_weight", "topk_weight", "noise"):
        p.add_argument("--" + k.replace("_", "-"), type=float, default=getattr(d, k))
    for k in ("topk", "align_steps", "draft_vocab", "ttt_steps"):
        p.add_argument("--" + k.replace("_", "-"), type=int, default=getattr(d, k))
    p.add_argument("--feature-layers", default=d.feature_layers,
                   help="eagle3: comma list of target layers whose inputs the head reads (N = the final hidden "
                        "state; default: taps.drafters.eagle3.feature_layers of the target's depth)")
    add_run_arguments(p, d)


# ------------------------------------------------------------------------------------------------ data

@dataclass
class DomainFeatures:
    """Blocks of one domain: ``train``/``heldout`` tokens [n, L] int32 with the target's features
    [n, L, H] bf16 (``train_feat``/``heldout_feat``)."""

    train: Tensor
    train_feat: Tensor
    heldout: Tensor
    heldout_feat: Tensor
    info: dict


def domain_blocks(domain: str, tok, *, tokens: int, heldout_tokens: int, seq_len: int, seed: int,
                  shared=None, sharegpt=None) -> Tuple[Tensor, Tensor, dict]:
    """(train [n, L], heldout [k, L], info) token blocks of one domain: conversations decontaminated,
    shuffled (seeded), the first ones held out, then enough for ``tokens`` training tokens."""
    from . import data as D

    stats: Dict[str, D.LoadStats] = {}
    if domain == "math":
        examples = D.math_training_examples(shared, stats)
    elif domain == "chat":
        examples = D.chat_training_examples(sharegpt, stats=stats)
    else:
        raise ValueError(f"unknown domain {domain!r}")
    examples, dropped = D.decontaminate(examples, D.eval_prompt_keys())
    random.Random(seed).shuffle(examples)
    held, train, n_held, n_train, i = [], [], 0, 0, 0
    while i < len(examples) and (n_held < heldout_tokens or n_train < tokens):
        for ids in tok.encode_chats([e.messages for e in examples[i:i + 256]]):
            if n_held < heldout_tokens:
                held.append(ids)
                n_held += len(ids)
            elif n_train < tokens:
                train.append(ids)
                n_train += len(ids)
        i += 256
    flat = [t for d in train for t in d][:tokens]
    tr, he = pack([flat], seq_len), pack(held, seq_len)[:max(1, heldout_tokens // seq_len)]
    info = {"conversations_available": len(examples), "conversations_used": len(train),
            "conversations_heldout": len(held), "train_tokens": int(tr.numel()), "heldout_tokens": int(he.numel()),
            "dropped_as_eval_prompts": dropped, "load_stats": {k: v.as_dict() for k, v in stats.items()}}
    if tr.numel() < tokens - seq_len:
        print(f"[train drafter] {domain}: only {tr.numel():,} training tokens available ({tokens:,} asked)",
              flush=True)
    return tr, he, info


@torch.no_grad()
def target_features(target, blocks: Tensor, device, micro: int = 8, desc: str = "", quiet: bool = False,
                    out: Optional[Tensor] = None, ctx: Optional[D.DistContext] = None) -> Tensor:
    """The target's final normalised hidden states [n, L, H] (bf16, on the CPU) of token blocks [n, L].

    With ``out`` (a [n, L, H] bf16 tensor, e.g. a map of a shared file) this rank of ``ctx`` writes
    its share of whole micro-batches into ``out`` and returns it: every block is computed in the same
    micro-batch as in a single process, so the features do not depend on the number of ranks."""
    from tqdm import tqdm

    ctx = ctx or D.DistContext(device=torch.device(device))
    base = target.get_decoder() if hasattr(target, "get_decoder") else target.model
    first, last = ctx.shard(0, -(-len(blocks) // micro))
    parts = []
    for m in tqdm(range(first, last), desc=desc, disable=quiet, unit="batch", file=sys.stderr,
                  mininterval=1.0 if sys.stderr.isatty() else 30.0):
        x = blocks[m * micro:(m + 1) * micro].to(device=device, dtype=torch.long)
        h = base(input_ids=x).last_hidden_state.to("cpu", torch.bfloat16)
        if out is None:
            parts.append(h)
        else:
            out[m * micro:m * micro + len(h)] = h
    if out is not None:
        return out
    hidden = target.config.hidden_size
    return torch.cat(parts) if parts else torch.zeros((0, blocks.shape[1], hidden), dtype=torch.bfloat16)


# A domain's feature cache, ``feature_dir/<domain>/``: ``blocks.pt`` (token blocks ``train`` [n, L] and
# ``heldout`` [k, L] int32, ``info``), the features as raw bf16 arrays ``train.bf16`` [n, L, H] and
# ``heldout.bf16`` [k, L, H] (memory-mapped: every rank writes its share of them in place, a run
# reads only the rows it slices), and ``index.json`` (key and shapes), written last: the cache is
# complete iff index.json exists.
_FEATURE_PARTS = ("train", "heldout")


def _map_features(path: Path, rows: int, seq_len: int, hidden: int, write: bool = False) -> Tensor:
    """[rows, seq_len, hidden] bf16 mapped from ``path`` (written through when ``write``)."""
    if rows == 0:
        return torch.zeros((0, seq_len, hidden), dtype=torch.bfloat16)
    return torch.from_file(str(path), shared=write, size=rows * seq_len * hidden,
                           dtype=torch.bfloat16).view(rows, seq_len, hidden)


def _cached_features(folder: Path, key: dict, need: int) -> Optional[DomainFeatures]:
    """The complete cache in ``folder`` when it was built with ``key`` and holds ``need`` training
    blocks (or all the domain has), its first ``need`` blocks; else None."""
    index = folder / "index.json"
    if not index.is_file():
        return None
    meta = json.loads(index.read_text())
    if meta.get("key") != key or (meta["blocks"]["train"] < need and not meta.get("exhausted")):
        return None
    st = torch.load(folder / "blocks.pt", weights_only=True, mmap=True)
    feats = {part: _map_features(folder / f"{part}.bf16", meta["blocks"][part], meta["seq_len"], meta["hidden"])
             for part in _FEATURE_PARTS}
    n = min(need, meta["blocks"]["train"])
    return DomainFeatures(st["train"][:n], feats["train"][:n], st["heldout"], feats["heldout"], st["info"])


def load_domain_features(domain: str, cfg: DrafterTrainConfig, tokens: int, target, tok, device,
                         ctx: Optional[D.DistContext] = None) -> DomainFeatures:
    """Blocks and target features of `domain` for `tokens` training tokens, from the cache in
    cfg.feature_dir/<domain> when it holds at least that many (a prefix is used), else built and
    cached: rank 0 tokenizes, every rank computes the features of its share of the blocks."""
    from ..files import sha256_file, weights_sha256

    ctx = ctx or D.DistContext(device=torch.device(device))
    key = {"domain": domain, "seq_len": cfg.seq_len, "seed": cfg.seed, "heldout_tokens": cfg.heldout_tokens,
           "target_sha256": weights_sha256(cfg.target), "target_dtype": cfg.target_dtype,
           "tokenizer_sha256": sha256_file(Path(cfg.target) / "tokenizer.json")}
    folder = Path(cfg.feature_dir) / domain
    need = -(-tokens // cfg.seq_len)
    cached = _cached_features(folder, key, need)
    if cached is not None:
        return cached
    t0 = time.time()
    hidden = target.config.hidden_size
    with ctx.main_first():
        if ctx.is_main:
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "index.json").unlink(missing_ok=True)
            train, held, info = domain_blocks(domain, tok, tokens=need * cfg.seq_len,
                                              heldout_tokens=cfg.heldout_tokens, seq_len=cfg.seq_len,
                                              seed=cfg.seed, shared=cfg.shared_data, sharegpt=cfg.sharegpt)
            info.update(key=key, exhausted=len(train) < need)
            tmp = folder / "blocks.tmp"
            torch.save({"train": train, "heldout": held, "info": info}, tmp)
            os.replace(tmp, folder / "blocks.pt")
            for part, b in (("train", train), ("heldout", held)):
                with open(folder / f"{part}.bf16", "wb") as f:
                    f.truncate(b.numel() * hidden * 2)
        else:
            st = torch.load(folder / "blocks.pt", weights_only=True)
            train, held, info = st["train"], st["heldout"], st["info"]
    for part, b in (("train", train), ("heldout", held)):
        out = _map_features(folder / f"{part}.bf16", len(b), cfg.seq_len, hidden, write=True)
        target_features(target, b, device, out=out, ctx=ctx, desc=f"{domain} features" if part == "train" else "",
                        quiet=cfg.quiet or part != "train" or not ctx.is_main)
        del out  # unmapped: the writes are in the file
    ctx.barrier()
    if ctx.is_main:
        for part in _FEATURE_PARTS:
            with open(folder / f"{part}.bf16", "rb+") as f:
                os.fsync(f.fileno())
        meta = {"key": key, "blocks": {"train": len(train), "heldout": len(held)}, "seq_len": cfg.seq_len,
                "hidden": hidden, "exhausted": info["exhausted"], "world_size": ctx.world_size}
        tmp = folder / "index.tmp"
        tmp.write_text(json.dumps(meta, indent=1) + "\n")
        os.replace(tmp, folder / "index.json")
        print(f"[train drafter] {domain}: {train.numel():,} train + {held.numel():,} held-out tokens, target "
              f"features in {time.time() - t0:.0f}s on {ctx.world_size} rank(s) -> {folder}", flush=True)
    ctx.barrier()
    return _cached_features(folder, key, need)


# ------------------------------------------------------------------------------------------ the model

# Fields of the target's config that shape an EAGLE drafter layer (a Llama decoder layer) for it.
_LAYER_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                 "head_dim", "hidden_act", "max_position_embeddings", "rms_norm_eps", "rope_parameters")


def drafter_config(target_config, num_layers: int = 1):
    """The LlamaConfig of an EAGLE drafter for a target of any Llama-like family (Llama, Qwen2/3,
    Mistral, ...): the target's widths, heads, head dim, activation, norm epsilon and rotary settings,
    ``num_layers`` layers, no attention or MLP bias. The drafter is always Llama-shaped (EAGLE's
    layout); copying the target's own config class would drag in family fields the layer code does not
    know (Qwen2 has no ``mlp_bias``, Qwen3 a ``q_norm``)."""
    from transformers import LlamaConfig

    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    fields = {k: getattr(text, k) for k in _LAYER_FIELDS if getattr(text, k, None) is not None}
    if "rope_parameters" not in fields and getattr(text, "rope_theta", None) is not None:
        fields["rope_parameters"] = {"rope_type": "default", "rope_theta": text.rope_theta}
    return LlamaConfig(num_hidden_layers=num_layers, **fields)


def new_drafter(target, num_layers: int = 1):
    """An EagleDrafter shaped like the target's decoder layers (``num_layers`` of them), bound to it."""
    from taps.drafters import EagleDrafter

    drafter = EagleDrafter(drafter_config(target.config, num_layers))
    drafter.to(torch.float32)
    drafter.bind(target, move=False)  # training keeps the head in fp32 on its own device
    return drafter


def alignment_mask(n: int, step: int, device) -> Tensor:
    """[n, step * n] bool: query t sees key s of alignment step i (1-based blocks of n columns) iff
    s <= t and i == max(1, step - (t - s)): its last ``step - 1`` keys come from the later steps."""
    t = torch.arange(n, device=device).view(n, 1, 1)
    i = torch.arange(1, step + 1, device=device).view(1, step, 1)
    s = torch.arange(n, device=device).view(1, 1, n)
    ok = (s <= t) & (i == torch.clamp(step - (t - s), min=1))
    return ok.reshape(n, step * n)


def _history_attend(histories: List[List[Tuple[Tensor, Tensor]]], weights, mask: Tensor):
    """The ``attend`` of :func:`taps.lean.decoder_layer` for training over a whole block: each layer's K/V of
    this alignment step join its history (the earlier steps'), and the block attends to all of them under
    the alignment mask."""
    def attend(i: int, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        histories[i].append((k.transpose(1, 2), v.transpose(1, 2)))
        keys = torch.cat([kk for kk, _ in histories[i]], 2)
        values = torch.cat([vv for _, vv in histories[i]], 2)
        w = weights[i]
        return F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask, scale=w.scale,
                                              enable_gqa=w.heads != w.kv_heads)
    return attend


def unrolled_predictions(drafter, emb: Tensor, feat: Tensor, steps: int, noise=0.0):
    """Predicted features of alignment steps 1..steps ([B, n, H] each) for inputs emb = embeddings of
    tokens t+1 and feat = target features f_t ([B, n, H]); step j > 1 reads step j - 1's predictions.
    ``noise``: the amplitude of uniform noise on the step-1 input features, or that noise itself
    ([B, n, H], drawn per sequence by the caller in data-parallel runs). The layers run the inference
    code (:func:`taps.lean.decoder_layer`), with autograd."""
    from taps.lean import LayerWeights, RopeTable, decoder_layer

    b, n, _ = feat.shape
    weights = [LayerWeights([layer]) for layer in drafter.layers]
    rope = RopeTable(drafter.rotary, feat.dtype)
    rope.ensure(n, feat.device)
    cos, sin = rope(torch.arange(n, device=feat.device).unsqueeze(0).expand(b, -1))
    histories: List[List[Tuple[Tensor, Tensor]]] = [[] for _ in drafter.layers]
    preds = []
    if isinstance(noise, Tensor):
        g = feat + noise
    else:
        g = feat + (torch.rand_like(feat) * 2 - 1) * noise if noise else feat
    for j in range(1, steps + 1):
        if j > 1:
            g = torch.cat([feat[:, :1], preds[-1][:, :-1]], 1)
        x = drafter.fc(torch.cat([emb, g], -1)).reshape(1, b * n, -1)
        attend = _history_attend(histories, weights, alignment_mask(n, j, feat.device))
        for i, w in enumerate(weights):
            x = decoder_layer(w, i, x, cos, sin, attend, b, n)
        preds.append(x.view(b, n, -1))
    return preds


def drafter_losses(drafter, head_w: Tensor, embed_w: Tensor, tokens: Tensor, feats: Tensor, cfg: DrafterTrainConfig,
                   steps: int, noise):
    """Total loss and metrics of one batch (tokens [B, L] long, feats [B, L, H] fp32)."""
    emb = F.embedding(tokens[:, 1:], embed_w)
    inp, nxt = feats[:, :-1], feats[:, 1:]
    with torch.no_grad():
        p_logits = nxt @ head_w.t()
        p = torch.softmax(p_logits, -1)
        top1 = p_logits.argmax(-1)
        if cfg.family == "hass":
            topv, topi = p.topk(min(cfg.topk, p.shape[-1]), -1)
    preds = unrolled_predictions(drafter, emb, inp, steps, noise)
    total, metrics = 0.0, {}
    for j, pred in enumerate(preds, 1):
        logq = torch.log_softmax(pred @ head_w.t(), -1)
        reg = F.smooth_l1_loss(pred, nxt)
        cls = -(p * logq).sum(-1).mean()
        loss = cfg.reg_weight * reg + cfg.cls_weight * cls
        if cfg.family == "hass":
            loss = loss + cfg.topk_weight * -(topv * logq.gather(-1, topi)).sum(-1).mean()
        total = total + loss / len(preds)
        metrics[f"reg@{j}"] = float(reg.detach())
        metrics[f"cls@{j}"] = float(cls.detach())
        metrics[f"acc@{j}"] = float((logq.detach().argmax(-1) == top1).float().mean())
    return total, metrics


def heldout_metrics(model: D.DataParallelModel, blocks: Tensor, feats: Tensor, cfg: DrafterTrainConfig, device,
                    micro: int = 8) -> dict:
    """Held-out reg/cls/acc at alignment steps 1..EVAL_STEPS (token-weighted means) of the drafter in
    ``model`` (its loss being :func:`drafter_losses`); the blocks are shared out over the ranks."""
    model.module.eval()
    plain = dataclasses.replace(cfg, family="eagle2")  # reg + cls only, at every alignment step

    def run(a, b):
        x = blocks[a:b].to(device=device, dtype=torch.long)
        f = feats[a:b].to(device=device, dtype=torch.float32)
        return model(x, f, plain, EVAL_STEPS, 0.0)[1]

    res = model.mean_over(len(blocks), micro, run)
    model.module.train()
    return {k: round(v, 5) for k, v in res.items()}


# ------------------------------------------------------------------------------------------------ main

class PermutedRows:
    """``rows[i] = parts[j][r]`` for the i-th (j, r) of a permutation of the parts' rows, without
    copying the parts: slicing reads only the rows asked for (the parts are memory-mapped features)."""

    def __init__(self, parts: List[Tensor], perm: Tensor):
        sizes = torch.tensor([len(p) for p in parts])
        starts = torch.cumsum(sizes, 0) - sizes
        self.parts = parts
        self.part = torch.bucketize(perm, torch.cumsum(sizes, 0), right=True)
        self.row = perm - starts[self.part]

    def __len__(self) -> int:
        return len(self.part)

    def __getitem__(self, sl: slice) -> Tensor:
        part, row = self.part[sl], self.row[sl]
        out = torch.empty((len(part), *self.parts[0].shape[1:]), dtype=self.parts[0].dtype)
        for j, p in enumerate(self.parts):
            at = (part == j).nonzero().flatten()
            if len(at):
                out[at] = p[row[at]]
        return out


def training_blocks(cfg: DrafterTrainConfig, target, tok, device, ctx: Optional[D.DistContext] = None):
    """(train tokens, train features, domain ids, {domain: (heldout tokens, features)}, info); the
    training rows in the seeded order, the features read lazily (:class:`PermutedRows`)."""
    if cfg.data == "mixed":
        want = {"math": cfg.tokens // 2, "chat": cfg.tokens - cfg.tokens // 2}
    else:
        want = {cfg.data: cfg.tokens}
    parts = {d: load_domain_features(d, cfg, n, target, tok, device, ctx) for d, n in want.items()}
    for d in DOMAINS:  # held-out metrics on both domains
        if d not in parts:
            parts[d] = load_domain_features(d, cfg, 1, target, tok, device, ctx)
    used = [d for d in DOMAINS if d in want]
    train = torch.cat([parts[d].train for d in used])
    dom = torch.cat([torch.full((len(parts[d].train),), DOMAINS.index(d), dtype=torch.uint8) for d in used])
    perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(cfg.seed))
    feats = PermutedRows([parts[d].train_feat for d in used], perm)
    info = {d: {"train_tokens": int(parts[d].train.numel()) if d in want else 0,
                "heldout_tokens": int(parts[d].heldout.numel()),
                **{k: v for k, v in parts[d].info.items() if k not in ("key", "train_tokens", "heldout_tokens")}}
            for d in DOMAINS}
    held = {d: (parts[d].heldout, parts[d].heldout_feat) for d in DOMAINS}
    return train[perm], feats, dom[perm], held, info


def train_drafter(cfg: DrafterTrainConfig) -> dict:
    """Train (or resume) one EAGLE-2 or HASS drafter (``cfg.family``); export it when finished. Returns a
    summary dict. Under torchrun every rank calls this (data parallel, :mod:`taps.train.dist`); only rank 0
    writes files. EAGLE-3 heads train in :func:`taps.train.eagle3.train_eagle3`
    (:func:`taps.train.cli.train_drafter_family` picks the trainer of a family)."""
    if cfg.family not in ("eagle2", "hass"):
        raise ValueError(f"train_drafter trains the eagle2 and hass families, not {cfg.family} "
                         "(taps.train.cli.train_drafter_family picks a family's trainer)")
    with cfg.distributed() as ctx:
        return _train_drafter(cfg, ctx)


def _train_drafter(cfg: DrafterTrainConfig, ctx: D.DistContext) -> dict:
    from taps.models import load_target

    device = ctx.device
    target, tok = load_target(cfg.target, dtype=TARGET_DTYPES[cfg.target_dtype], verify=False)
    target.to(device).requires_grad_(False)
    train, feats, dom, held, data_info = training_blocks(cfg, target, tok, device, ctx)
    # training needs only the target's embeddings and lm_head (fp32); the rest leaves the device
    head_w = target.get_output_embeddings().weight.detach().float()
    embed_w = target.get_input_embeddings().weight.detach().float()
    target.to("cpu")
    total_steps = len(train) // cfg.batch_size
    check_batches(cfg, ctx, len(train))
    torch.manual_seed(cfg.seed)
    drafter = new_drafter(target).to(device)
    drafter.train()
    model = D.DataParallelModel(drafter, lambda d, *a: drafter_losses(d, head_w, embed_w, *a), ctx, fsdp=cfg.fsdp)
    seq, hidden = train.shape[1], target.config.hidden_size

    def run(a, b, start):  # mean loss and metrics of training rows [a, b)
        x = train[a:b].to(device=device, dtype=torch.long)
        f = feats[a:b].to(device=device, dtype=torch.float32)
        noise = cfg.noise
        if noise:
            noise = (D.sample_uniform(a, b, (seq - 1, hidden), cfg.seed, device) * 2 - 1) * cfg.noise
        return model(x, f, cfg, cfg.steps_per_batch, noise)

    def export(state, summary):
        final = new_drafter(target)
        final.load_state_dict(state)
        export_drafter(final, cfg, data_info, summary, device)

    return training_loop(
        cfg, model, total_steps, seq, run,
        evaluate=lambda: {d: heldout_metrics(model, held[d][0], held[d][1], cfg, device, cfg.micro_batch or 8)
                          for d in DOMAINS},
        domains=lambda sl: torch.bincount(dom[sl].long(), minlength=len(DOMAINS)).tolist(), export=export,
        header=f"{cfg.steps_per_batch} alignment step(s)")


def training_loop(cfg: DrafterTrainConfig, model: D.DataParallelModel, total_steps: int, seq_len: int,
                  run: Callable[[int, int, int], Tuple[Tensor, Dict[str, float]]], *,
                  evaluate: Callable[[], Dict[str, dict]], domains: Callable[[slice], List[int]],
                  export: Callable[[dict, dict], None], header: str) -> dict:
    """The drafter families' shared training loop: resume from ``cfg.run_dir``, train steps of
    ``cfg.batch_size`` blocks to ``cfg.max_steps`` or the end (``run(a, b, start)``: the loss and metrics
    of rows [a, b) of the global batch starting at row ``start``, computed through ``model``), log, evaluate
    (``evaluate()``: held-out metrics per domain, every ``cfg.eval_every`` steps), checkpoint, and when
    finished call ``export(full state dict, summary)`` on rank 0. ``domains(rows)``: blocks per domain
    of those rows, for the log. Returns the summary."""
    from tqdm import tqdm

    ctx, device = model.ctx, model.ctx.device
    opt = make_optimizer(model.module, cfg)
    n_params = sum(p.numel() for p in model.module.parameters())
    run_dir = Path(cfg.run_dir)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    ckpt, log = run_dir / "checkpoint.pt", run_dir / "log.jsonl"
    step, tokens_seen, elapsed0 = resume(ckpt, log, model, opt, cfg, device, f"[train drafter {cfg.name}]",
                                         total_steps)
    stop_at = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    if step == 0 and not cfg.quiet and ctx.is_main:
        print(f"[train drafter {cfg.name}] {cfg.family}, {n_params:,} parameters on {device} x {ctx.world_size} "
              f"rank(s) ({model.parallel}); {total_steps} steps of {cfg.batch_size} x {seq_len} tokens, {header}",
              flush=True)
    bar = tqdm(total=total_steps, initial=step, unit="step", disable=cfg.quiet or not ctx.is_main, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, file=sys.stderr, desc=cfg.name)
    logf = open(log, "a") if ctx.is_main else None
    t_start, last_ckpt = time.time(), time.time()

    def held_out(at_step):
        res = evaluate()
        if logf:
            logf.write(json.dumps({"step": at_step, "tokens": tokens_seen, "heldout": res}) + "\n")
            logf.flush()
        return res

    last_eval = None
    while step < stop_at:
        start = step * cfg.batch_size
        lr = lr_at(cfg, step, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        metrics = model.accumulate_gradients(start, cfg.batch_size, cfg.micro_batch,
                                             lambda a, b: run(a, b, start))
        loss = metrics.pop("loss")
        gnorm = model.clip_grad_norm_(cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += cfg.batch_size * seq_len
        elapsed = elapsed0 + time.time() - t_start
        if logf:
            blocks = domains(slice(start, start + cfg.batch_size))
            logf.write(json.dumps({"step": step, "tokens": tokens_seen, "loss": round(loss, 6), "lr": lr,
                                   "grad_norm": round(gnorm, 4), "elapsed_s": round(elapsed, 1),
                                   **{k: round(v, 5) for k, v in metrics.items()},
                                   "blocks": dict(zip(DOMAINS, blocks))}) + "\n")
            logf.flush()
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == total_steps):
            last_eval = held_out(step)
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.3f}", acc=f"{metrics['acc@1']:.2f}",
                        tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}", refresh=False)
        last_ckpt = checkpoint_if_due(ckpt, model, opt, step, stop_at, tokens_seen, cfg, elapsed, last_ckpt)
    summary = finish_run(bar, logf, step, total_steps, tokens_seen, n_params, elapsed0, t_start)
    summary["training"] = {**model.describe(step), "micro_batch": cfg.micro_batch}
    if summary["finished"]:
        summary["final_heldout"] = last_eval if last_eval is not None else evaluate()
        state = model.state_dict()  # a collective under FSDP
        if ctx.is_main:
            summary["final_train_loss"] = recent_train_loss(log, 20)
            export(state, summary)
            acc = ", ".join(f"{d} acc@1 {summary['final_heldout'][d]['acc@1']:.3f} acc@3 "
                            f"{summary['final_heldout'][d]['acc@3']:.3f}" for d in DOMAINS)
            print(f"[train drafter {cfg.name}] finished in {summary['elapsed_s']:.0f}s; held-out {acc}; exported to "
                  f"{cfg.out}", flush=True)
    elif ctx.is_main:
        print(f"[train drafter {cfg.name}] stopped at step {step}/{total_steps}; rerun to continue", flush=True)
    return summary


def _relative(v):
    s = str(v)
    return os.path.relpath(s, REPO_ROOT) if s.startswith(str(REPO_ROOT)) else s


def write_manifest(out: Path, manifest: dict) -> None:
    from ..files import file_hashes

    manifest["files"] = file_hashes(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")


def _clear(out: Path) -> None:
    if out.exists():
        for p in out.iterdir():
            if p.is_file():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)


def export_drafter(drafter, cfg: DrafterTrainConfig, data_info: dict, summary: dict, device,
                   extra: Optional[dict] = None) -> None:
    """Save the drafter (its published layout, bf16 safetensors) and manifest.json (with `extra`) into cfg.out."""
    import transformers

    from ..files import weights_sha256

    out = Path(cfg.out)
    _clear(out)
    twin = drafter.clone().to("cpu", dtype=torch.bfloat16)
    twin.save_pretrained(str(out))
    manifest = {
        "kind": "drafter", "architecture": (
            "Eagle3Drafter (EAGLE-3 layout: fc over 3 target layers + midlayer + norm + own lm_head over a draft "
            "vocabulary, d2t / t2d; the target's embeddings)" if cfg.family == "eagle3" else
            "EagleDrafter (EAGLE layout: fc + 1 Llama decoder layer; the target's embeddings and lm_head)"),
        "family": cfg.family, "data": cfg.data, "name": cfg.name,
        "objective": ({"eagle2": "feature regression (SmoothL1) + token cross-entropy vs the target's distribution",
                       "hass": "EAGLE-2 terms + top-k distillation + harmonized context alignment",
                       "eagle3": "training-time test: cross-entropy vs the target's distribution on the draft "
                                 "vocabulary at every unrolled step"}[cfg.family]),
        "dtype": "bfloat16 (trained in fp32)",
        "data_info": data_info, **summary, "seed": cfg.seed,
        "train_config": {k: (_relative(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
                         if k != "quiet"},
        "command": f"taps train drafter --family {cfg.family} --data {cfg.data} --tokens {cfg.tokens}"
                   + (f" --name {cfg.name}" if cfg.name != f"{cfg.family}-{cfg.data}" else ""),
        "target_sha256": weights_sha256(cfg.target),
        "device": str(device), "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        **(extra or {}),
    }
    write_manifest(out, manifest)


def average_checkpoints(inputs: List[Path], out: Path, target_path: Path) -> dict:
    """Weight-space mean of drafter checkpoints (taps.drafters.average_drafters), exported like a
    trained one with a manifest naming its inputs and their sha256."""
    from taps.drafters import EagleDrafter, average_drafters

    from ..files import sha256_file, weights_sha256

    if len(inputs) < 2:
        raise ValueError("average: give at least two drafter folders")
    missing = [str(p) for p in inputs if not (Path(p) / "config.json").is_file()]
    if missing:
        raise FileNotFoundError(f"average: no drafter (config.json) in {', '.join(missing)}")
    ds = [EagleDrafter.from_pretrained(str(p), dtype=torch.float32) for p in inputs]
    avg = average_drafters(ds).to(torch.bfloat16)
    out = Path(out)
    _clear(out)
    avg.save_pretrained(str(out))
    manifest = {"kind": "drafter", "family": json.loads((Path(inputs[0]) / "manifest.json").read_text()).get("family")
                if (Path(inputs[0]) / "manifest.json").is_file() else None,
                "data": "avg", "name": out.name,
                "objective": "weight-space mean of the inputs (no training)",
                "inputs": {_relative(p): sha256_file(Path(p) / "model.safetensors") for p in inputs},
                "command": "taps train average " + " ".join(_relative(p) for p in inputs) + f" --out {_relative(out)}",
                "target_sha256": weights_sha256(target_path)}
    write_manifest(out, manifest)
    print(f"[train average] {len(inputs)} drafters -> {out}", flush=True)
    return manifest
