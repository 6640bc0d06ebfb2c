"""Data-parallel training under ``torchrun``: the rank, world size, backend, sharding and all-reduce
helpers that every training loop of :mod:`taps.train` calls.

Launch: ``torchrun --nproc_per_node N -m taps.train drafter ...``. torchrun sets ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and the rendezvous address; without them (or with one process) the same
command runs as a single process: no process group, every collective a no-op.

The contract a training loop relies on:

- backend: NCCL when the device is CUDA (each rank on ``cuda:LOCAL_RANK``), gloo on the CPU; chosen by
  :func:`distributed` from the ``--device`` option.
- the global batch: ``batch_size`` samples per optimizer step whatever the world size. Rank r takes the
  contiguous shard ``[r * B // W, (r + 1) * B // W)`` of every global batch and splits it into the same
  number of micro-batches on every rank (gradient accumulation when ``micro`` samples are fewer than its
  share). Each micro-batch's mean loss is weighted by its share of the global batch and the gradients
  are averaged over ranks (DDP, or FSDP2 ``fully_shard`` with ``fsdp=True``), so the step's gradient is
  the global batch's mean gradient for any W and micro-batch size: a W-process run reaches the weights
  of a 1-process run up to float reduction order. Anything random that depends on a sample (feature
  noise) must come from :func:`sample_uniform`, seeded by the sample's index, not from the global RNG.
- only rank 0 (``ctx.is_main``) writes files, logs and progress bars; every rank takes part in
  collectives, so a decision that leads to one (checkpoint now?) goes through :meth:`DistContext.agree`.
- checkpoints hold the full (unsharded) state of the model and optimizer in the single-process format
  (:meth:`DataParallelModel.state_dict`, :meth:`DataParallelModel.optimizer_state_dict`), so a run
  resumes with any number of processes.
- collectives time out after ``timeout_s`` seconds: a rank that dies or stalls takes the job down with
  an error instead of a hang (torchrun then stops the other ranks).
- files that every rank reads (feature caches, checkpoints) must be on a filesystem all ranks see.
"""

from __future__ import annotations

import contextlib
import datetime
import gc
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
from torch import Tensor, nn

DEFAULT_TIMEOUT_S = 1800.0


class CollectiveError(RuntimeError):
    """A collective of a torchrun job failed: another rank died, stalled past the timeout, or left."""


@dataclass
class DistContext:
    """Where this process stands in the job. ``backend`` is None for a single process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: Optional[str] = None
    device: torch.device = torch.device("cpu")
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def describe(self) -> dict:
        """What a manifest records about the run's parallelism."""
        return {"world_size": self.world_size, "backend": self.backend}

    # -- sharding ------------------------------------------------------------------------------
    def shard(self, start: int, stop: int) -> Tuple[int, int]:
        """This rank's contiguous share [lo, hi) of the items [start, stop)."""
        n = stop - start
        return start + self.rank * n // self.world_size, start + (self.rank + 1) * n // self.world_size

    def micro_batches(self, start: int, stop: int, micro: int) -> List[Optional[Tuple[int, int]]]:
        """This rank's share of [start, stop) in micro-batches of at most ``micro`` items (0: one), as
        many on every rank; ``None`` marks a padding pass of a rank whose share needs fewer."""
        n = stop - start
        widest = -(-n // self.world_size)
        parts = max(1, -(-widest // micro)) if micro > 0 else 1
        lo, hi = self.shard(start, stop)
        cuts = [lo + (hi - lo) * i // parts for i in range(parts + 1)]
        return [(a, b) if b > a else None for a, b in zip(cuts, cuts[1:])]

    # -- collectives (no-ops in a single process) ---------------------------------------------
    def _comm_device(self) -> torch.device:
        return self.device if self.backend == "nccl" else torch.device("cpu")

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def agree(self, flag: bool) -> bool:
        """Rank 0's ``flag`` on every rank (for decisions that start a collective)."""
        if not self.distributed:
            return flag
        import torch.distributed as dist

        t = torch.tensor([int(flag)], device=self._comm_device())
        dist.broadcast(t, src=0)
        return bool(t.item())

    def all_reduce_sum(self, values: Dict[str, float]) -> Dict[str, float]:
        """Sum of ``values`` over ranks (every rank must pass the same keys)."""
        if not self.distributed or not values:
            return dict(values)
        import torch.distributed as dist

        keys = sorted(values)
        t = torch.tensor([values[k] for k in keys], dtype=torch.float64, device=self._comm_device())
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the block first (to build a cache), then the other ranks (to read it)."""
        if not self.is_main:
            self.barrier()
        yield
        if self.is_main:
            self.barrier()


def resolve_device(name: str, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """``auto`` | ``cpu`` | ``cuda`` | ``cuda:N``; under torchrun a CUDA device is ``cuda:LOCAL_RANK``."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(name)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {name}: CUDA is not available")
        if world_size > 1:
            if dev.index is not None:
                raise ValueError(f"--device {name}: under torchrun each rank uses cuda:LOCAL_RANK; pass --device cuda")
            dev = torch.device("cuda", local_rank)
    return dev


def _env_int(name: str, default: int) -> int:
    v = os.environ.get(name)
    return int(v) if v not in (None, "") else default


@contextlib.contextmanager
def distributed(device: str = "auto", timeout_s: float = DEFAULT_TIMEOUT_S) -> Iterator[DistContext]:
    """The process group of a torchrun job (NCCL on CUDA, gloo on the CPU), or a single-process context.

    Joins an already initialised default group instead of creating one (and then leaves it alone). A
    failed collective inside the block is raised as :class:`CollectiveError` naming this rank; other
    errors are reported with the rank's number before they propagate."""
    import torch.distributed as dist

    world = _env_int("WORLD_SIZE", 1)
    rank, local_rank = _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    if timeout_s <= 0:
        raise ValueError(f"the collective timeout must be > 0 seconds, got {timeout_s}")
    created = False
    if dist.is_available() and dist.is_initialized():
        world, rank = dist.get_world_size(), dist.get_rank()
    dev = resolve_device(device, local_rank, world)
    backend = None
    if world > 1:
        if not dist.is_available():
            raise RuntimeError("torch.distributed is not available in this torch build")
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        if not dist.is_initialized():
            backend = "nccl" if dev.type == "cuda" else "gloo"
            kw = {"device_id": dev} if dev.type == "cuda" else {}
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s), **kw)
            created = True
        backend = dist.get_backend()
    ctx = DistContext(rank, world, local_rank, backend, dev, timeout_s)
    if not ctx.is_main:
        _quiet_progress_bars()
    try:
        yield ctx
    except BaseException as e:
        created = False  # a group whose peers may be gone is not torn down (that could block)
        if not ctx.distributed or not isinstance(e, Exception):
            raise
        if isinstance(e, getattr(dist, "DistError", ())) or "gloo" in str(e).lower() or "timed out" in str(e):
            raise CollectiveError(f"rank {ctx.rank} of {ctx.world_size}: a collective failed, another rank died or "
                                  f"stalled (collectives time out after {ctx.timeout_s:g} s, --dist-timeout): "
                                  f"{e}") from e
        print(f"[taps train] rank {ctx.rank} of {ctx.world_size}: {type(e).__name__}: {e}", file=sys.stderr,
              flush=True)
        raise
    finally:
        if created:
            # A CI run once saw a rank abort at interpreter exit (after its work, while rank 0 exported).
            # So: free what the job left in reference cycles (FSDP / DDP modules hold the group through
            # their hooks) while the interpreter is whole, not during its finalisation; then a barrier
            # (gloo's waits for this rank's in-flight work, and no rank tears the group down while a peer
            # still uses it); then the teardown.
            gc.collect()
            dist.barrier()
            dist.destroy_process_group()


def _quiet_progress_bars() -> None:
    """No Hugging Face progress bars (weight loading) on ranks other than 0."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_progress_bar()


def sample_uniform(start: int, stop: int, shape: Tuple[int, ...], seed: int, device) -> Tensor:
    """[stop - start, *shape] uniform in [0, 1): row i drawn from a generator seeded by (seed, start + i),
    so a sample's draw does not depend on which rank or micro-batch computes it."""
    rows = []
    for i in range(start, stop):
        g = torch.Generator(device=device).manual_seed(((seed & 0xFFFFFFFF) << 32) | (i & 0xFFFFFFFF))
        rows.append(torch.rand(shape, generator=g, device=device))
    return torch.stack(rows) if rows else torch.zeros((0, *shape), device=device)


# ------------------------------------------------------------------------------------------ the model

LossFn = Callable[..., Tuple[Tensor, Dict[str, float]]]


class _LossModule(nn.Module):
    """forward(*args) = loss_fn(module, *args): what DDP / FSDP wrap, so a training loop may compute
    its loss with any code over the module's submodules."""

    def __init__(self, module: nn.Module, loss_fn: LossFn):
        super().__init__()
        self.module = module
        self.loss_fn = loss_fn

    def forward(self, *args, **kwargs):
        return self.loss_fn(self.module, *args, **kwargs)


class DataParallelModel:
    """``module`` under data-parallel training: DDP, or FSDP2 ``fully_shard`` (``fsdp=True``), or the
    module itself in a single process. Calling it runs ``loss_fn(module, *args)`` through the wrapper,
    returning (mean loss tensor, {name: float}).

    Under FSDP each of ``units`` (submodules that the loss calls through their ``forward``, e.g. the
    decoder layers of a language model) is sharded on its own and gathered only while it runs; the
    parameters outside them form one unit gathered for the whole forward and backward. With no units
    (a one-layer drafter head) the parameters are whole only during the step: gradients and optimizer
    state stay sharded."""

    def __init__(self, module: nn.Module, loss_fn: LossFn, ctx: DistContext, *, fsdp: bool = False,
                 units: Optional[List[nn.Module]] = None):
        self.module, self.ctx = module, ctx
        self.root = _LossModule(module, loss_fn)
        self.parallel = "none"
        # steps trained by earlier processes of a resumed run: [{"steps": [from, to], "world_size", ...}]
        self.history: List[dict] = []
        self.first_step = 0
        if not ctx.distributed:
            self.wrapped = self.root
        elif fsdp:
            from torch.distributed.fsdp import fully_shard

            for unit in units or ():
                fully_shard(unit)
            self.wrapped = fully_shard(self.root)
            self.parallel = "fsdp"
        else:
            from torch.nn.parallel import DistributedDataParallel

            ids = [ctx.device.index] if ctx.device.type == "cuda" else None
            self.wrapped = DistributedDataParallel(self.root, device_ids=ids)
            self.parallel = "ddp"

    def __call__(self, *args, **kwargs):
        return self.wrapped(*args, **kwargs)

    def describe(self, step: Optional[int] = None) -> dict:
        """World size, backend and parallelism of this process group; with ``step`` (the last step
        trained) also ``segments``: which process group trained which steps, earlier runs included."""
        now = {**self.ctx.describe(), "parallel": self.parallel}
        if step is None:
            return now
        here = [{"steps": [self.first_step, step], **now}] if step > self.first_step else []
        return {**now, "segments": self.history + here}

    @contextlib.contextmanager
    def _gradient_sync(self, sync: bool) -> Iterator[None]:
        if self.parallel == "ddp" and not sync:
            with self.wrapped.no_sync():
                yield
        elif self.parallel == "fsdp":
            self.wrapped.set_requires_gradient_sync(sync)
            try:
                yield
            finally:
                self.wrapped.set_requires_gradient_sync(True)
        else:
            yield

    def accumulate_gradients(self, start: int, batch_size: int, micro: int,
                             run: Callable[[int, int], Tuple[Tensor, Dict[str, float]]]) -> Dict[str, float]:
        """Backward of the global batch [start, start + batch_size) on this rank's share: ``run(a, b)``
        returns the mean loss (and float metrics) of samples [a, b), computed by calling this object.
        Gradients end up as the global batch's mean gradient on every rank. Returns ``loss`` and the
        metrics averaged over the global batch (samples weighted equally), identical on every rank."""
        parts = self.ctx.micro_batches(start, start + batch_size, micro)
        sums: Dict[str, float] = {}
        for i, part in enumerate(parts):
            a, b = part if part is not None else (start, start + 1)  # padding: same passes on every rank
            w = (b - a) / batch_size if part is not None else 0.0
            with self._gradient_sync(i == len(parts) - 1):
                loss, metrics = run(a, b)
                (loss * (w * self.ctx.world_size)).backward()
            for k, v in {"loss": float(loss.detach()), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + w * v
        return self.ctx.all_reduce_sum(sums)

    @torch.no_grad()
    def mean_over(self, n: int, micro: int, run: Callable[[int, int], Dict[str, float]]) -> Dict[str, float]:
        """Metrics averaged over samples [0, n) (each weighted equally), sharded over ranks: ``run(a, b)``
        returns the means over samples [a, b)."""
        sums: Dict[str, float] = {}
        for part in self.ctx.micro_batches(0, n, micro):
            a, b = part if part is not None else (0, min(1, n))
            w = (b - a) if part is not None else 0.0
            for k, v in run(a, b).items():
                sums[k] = sums.get(k, 0.0) + w * v
        return {k: v / max(1, n) for k, v in self.ctx.all_reduce_sum(sums).items()}

    def clip_grad_norm_(self, max_norm: float) -> float:
        norm = torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)
        return float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm)

    # -- checkpoints: the full state in the single-process format -----------------------------
    def state_dict(self) -> dict:
        """The module's full state dict (a collective under FSDP; there only rank 0 gets the tensors)."""
        if self.parallel != "fsdp":
            return self.module.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))

    def load_state_dict(self, state: dict) -> None:
        if self.parallel != "fsdp":
            self.module.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=True))

    def _param_names(self, opt) -> List[str]:
        name = {id(p): n for n, p in self.module.named_parameters()}
        return [name[id(p)] for g in opt.param_groups for p in g["params"]]

    def optimizer_state_dict(self, opt) -> dict:
        """``opt.state_dict()`` of the full parameters (integer keys, as a single process saves it)."""
        if self.parallel != "fsdp":
            return opt.state_dict()
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        full = get_optimizer_state_dict(self.module, opt,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not full:
            return {}
        ids = {n: i for i, n in enumerate(self._param_names(opt))}
        return {"state": {ids[n]: s for n, s in full["state"].items()},
                "param_groups": [{**g, "params": [ids[n] for n in g["params"]]} for g in full["param_groups"]]}

    def load_optimizer_state_dict(self, opt, state: dict) -> None:
        if self.parallel != "fsdp":
            opt.load_state_dict(state)
            return
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        names = self._param_names(opt)
        full = {"state": {names[i]: s for i, s in state["state"].items()},
                "param_groups": [{**g, "params": [names[i] for i in g["params"]]} for g in state["param_groups"]]}
        set_optimizer_state_dict(self.module, opt, full, options=StateDictOptions(full_state_dict=True))


def add_distributed_arguments(p, defaults) -> None:
    """``--fsdp`` and ``--dist-timeout`` on a training command's parser (``defaults``: its config)."""
    p.add_argument("--fsdp", action="store_true", help="under torchrun, shard the trained model, its gradients "
                   "and optimizer state over the ranks (FSDP2) instead of replicating them (DDP)")
    p.add_argument("--dist-timeout", type=float, default=defaults.dist_timeout,
                   help="seconds a collective waits for the other ranks before the job fails (torchrun runs)")
