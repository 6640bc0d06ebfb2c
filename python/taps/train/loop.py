"""What the target and drafter trainers share: token packing, the learning-rate schedule and the optimizer,
checkpoints (atomic, resumable with any number of processes, the run's settings checked), the end of a
run, and the reading of a run's log. A run configuration here is any of the trainers' dataclasses (it
has ``lr``, ``min_lr``, ``warmup_steps``, ``weight_decay``, ``ckpt_minutes``, ``ckpt_every`` and
``run_key()``)."""

from __future__ import annotations

import json
import math
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from . import dist as D

__all__ = ["pack", "lr_at", "make_optimizer", "resume", "checkpoint_if_due", "finish_run", "log_lines",
           "last_heldout", "recent_train_loss"]


def pack(docs: Sequence[Sequence[int]], seq_len: int) -> torch.Tensor:
    """The documents' tokens end to end, cut into [n, seq_len] int32 blocks (the tail dropped)."""
    flat = [t for d in docs for t in d]
    n = len(flat) // seq_len
    return torch.tensor(flat[: n * seq_len], dtype=torch.int32).view(n, seq_len)


def lr_at(cfg, step: int, total: int) -> float:
    """Learning rate of optimizer step ``step`` (0-based): linear warm-up, cosine decay to min_lr."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    frac = (step - cfg.warmup_steps) / max(1, total - cfg.warmup_steps)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * min(1.0, frac)))


def make_optimizer(model, cfg):
    """AdamW, weight decay on the matrices only."""
    decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.requires_grad and p.dim() < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                              {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95), eps=1e-8)


def _save_checkpoint(path: Path, model: D.DataParallelModel, opt, step: int, tokens_seen: int, cfg, elapsed: float):
    """Every rank calls this (gathering the state is a collective under FSDP); rank 0 writes the file."""
    state = {"model": model.state_dict(), "optimizer": model.optimizer_state_dict(opt), "step": step,
             "tokens_seen": tokens_seen, "elapsed": elapsed, "run_key": json.dumps(cfg.run_key(), sort_keys=True),
             "rng_cpu": torch.get_rng_state(), "segments": model.describe(step)["segments"]}
    if not model.ctx.is_main:
        return
    if torch.cuda.is_available():
        state["rng_cuda"] = torch.cuda.get_rng_state_all()
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def resume(ckpt: Path, log: Path, model: D.DataParallelModel, opt, cfg, device, tag: str, total_steps: int):
    """Load ``ckpt`` (written by :func:`_save_checkpoint` with the same ``cfg.run_key()``, by any number
    of processes) into model and optimizer on every rank, restore the RNG state and cut the log back to
    its step; without a checkpoint, start a fresh log. Returns (step, tokens_seen, elapsed seconds)."""
    main = model.ctx.is_main
    if not ckpt.exists():
        if main and log.exists():
            log.unlink()
        return 0, 0, 0.0
    st = torch.load(ckpt, map_location="cpu", weights_only=True)
    if st["run_key"] != json.dumps(cfg.run_key(), sort_keys=True):
        raise RuntimeError(f"{ckpt} belongs to a run with other settings ({st['run_key']}); use another "
                           "--run-dir or delete it to start over")
    model.load_state_dict(st["model"])
    model.load_optimizer_state_dict(opt, st["optimizer"])
    model.history, model.first_step = st.get("segments", []), st["step"]
    torch.set_rng_state(st["rng_cpu"].cpu())
    if "rng_cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in st["rng_cuda"]])
    if main:
        _truncate_log(log, st["step"])
        print(f"{tag} resumed from {ckpt} at step {st['step']}/{total_steps} with {model.ctx.world_size} "
              "process(es)", flush=True)
    return st["step"], st["tokens_seen"], st["elapsed"]


def checkpoint_if_due(ckpt: Path, model: D.DataParallelModel, opt, step: int, stop_at: int, tokens_seen: int, cfg,
                      elapsed: float, last_ckpt: float) -> float:
    """Write the checkpoint every ``cfg.ckpt_minutes`` (by rank 0's clock) and every ``cfg.ckpt_every``
    steps when set, and at ``stop_at``; returns the time of the last checkpoint. Every rank calls it."""
    due = (time.time() - last_ckpt >= cfg.ckpt_minutes * 60 or (cfg.ckpt_every and step % cfg.ckpt_every == 0)
           or step == stop_at)
    if model.ctx.agree(bool(due)):
        _save_checkpoint(ckpt, model, opt, step, tokens_seen, cfg, elapsed)
        return time.time()
    return last_ckpt


def finish_run(bar, logf, step: int, total_steps: int, tokens_seen: int, n_params: int, elapsed0: float,
               t_start: float) -> dict:
    """Close the progress bar and the log (None on ranks other than 0); the run's summary dict."""
    bar.close()
    if logf is not None:
        logf.close()
    return {"steps": step, "total_steps": total_steps, "tokens_seen": tokens_seen, "parameters": n_params,
            "finished": step >= total_steps, "elapsed_s": round(elapsed0 + time.time() - t_start, 1)}


def _truncate_log(log: Path, step: int) -> None:
    """Drop log lines written after the checkpoint (a run killed between two checkpoints)."""
    if not log.exists():
        return
    keep = [ln for ln in log.read_text().splitlines() if ln.strip() and json.loads(ln)["step"] <= step]
    log.write_text("".join(ln + "\n" for ln in keep))


def log_lines(log: Path):
    """The run log's records (one JSON object per line)."""
    return [json.loads(ln) for ln in log.read_text().splitlines() if ln.strip()] if log.exists() else []


def last_heldout(log: Path):
    """The last held-out loss the log records, or None."""
    ev = [r["heldout"] for r in log_lines(log) if "heldout" in r]
    return ev[-1] if ev else None


def recent_train_loss(log: Path, n: int) -> float:
    """The mean training loss of the log's last n steps."""
    losses = [r["loss"] for r in log_lines(log) if "loss" in r][-n:]
    return round(sum(losses) / max(1, len(losses)), 5)
