"""Continuous batching: requests join a running batch between decoding steps and leave it when done.

    batch = ContinuousBatch(decoder, max_batch=16)
    batch.add("a", prompt_ids, SamplingParams(max_new_tokens=64, temperature=0.7, seed=1))
    while batch:
        for event in batch.step():
            event.request_id, event.tokens, event.finish_reason, event.stats

Each :meth:`ContinuousBatch.step`:

1. drops the requests cancelled since the last step (their rows leave the target cache, the drafter
   groups, the strategy's and the tuner's per-request state: :meth:`SpeculativeDecoder.drop`);
2. admits waiting requests, oldest first, up to ``max_batch`` running: their prompts are prefilled
   together as a batch of their own (the first token sampled, the drafter groups started), which then
   joins after the running rows (:meth:`SpeculativeDecoder.join`; caches of different capacity are joined
   at the larger one);
3. runs one verification step (:meth:`SpeculativeDecoder.step`) over every running request, and drops
   the ones that finished (EOS, ``max_new_tokens``). With a tuner that measures its costs, a
   :class:`taps.judge.WindowJudge` (``judge=``) runs windows of steps plain (:meth:`SpeculativeDecoder.plain_step`)
   where the tuner's windows gave fewer tokens a second than plain ones.

It returns an event per request that received tokens or finished in that call. Verification is per
request, so every request's output distribution is the target's own whatever its neighbours: at
temperature 0 its tokens are its greedy decoding, and at a temperature its coins come from its own
generator (``SamplingParams.seed``), a fixed number per step, so what it draws does not depend on the
other requests. What can depend on them: a tuner (``budget="auto"``) chooses one draft shape for the
whole batch, and different trees over the same coins give different (equally distributed) samples; with
fixed draft settings a seeded request's tokens are the same alone or in any batch, up to float rounding
of the batched forwards. Strategies that stop drafting with some drafters (routing per prompt) keep every
drafter running here, since a request that joins later needs them all.

Not thread-safe: one thread calls every method (a server's engine thread).
"""

from __future__ import annotations

import math
import random
from collections import deque
from dataclasses import dataclass
from typing import Deque, Dict, Hashable, List, Optional, Sequence, Union

import torch

from .decoder import DecodeState, RequestState, SpeculativeDecoder, check_max_new_tokens
from .judge import WindowJudge
from .stats import Profiler, RequestStats

__all__ = ["SamplingParams", "StepEvent", "ContinuousBatch"]


@dataclass
class SamplingParams:
    """How one request samples and ends.

    max_new_tokens: tokens it may emit (>= 0); temperature (>= 0; 0 = greedy), top_k (>= 0; 0 = off),
    top_p (in (0, 1]): the target's sampling, as ``taps_ops.verify_tree`` applies them; seed: its own
    generator of acceptance coins (None: a random seed); eos_token_id: ids that end it (kept in its
    output; None: the decoder's tokenizer's EOS, else the target config's; an empty list: none)."""

    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    eos_token_id: Union[int, Sequence[int], None] = None

    def check(self) -> None:
        """ValueError for a value out of range."""
        check_max_new_tokens(self.max_new_tokens)
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ValueError(f"seed must be an integer or None, got {self.seed!r}")


@dataclass
class StepEvent:
    """What a request received in one :meth:`ContinuousBatch.step`: the tokens committed for it (its first
    event holds the token sampled from the prefill), and, in its last event, why it ended (``"eos"``,
    ``"length"`` or ``"cancelled"``; None while it runs); stats: its :class:`taps.stats.RequestStats` so far."""

    request_id: Hashable
    tokens: List[int]
    finish_reason: Optional[str]
    stats: RequestStats


class ContinuousBatch:
    """Requests decoded together by one :class:`taps.decoder.SpeculativeDecoder`, joining and leaving
    between steps (see the module docstring). A decoder serves one running batch at a time.

    Args:
        decoder: the decoder (its strategy, drafters, settings and tuner).
        max_batch: requests running at once (the others wait).
        judge: a :class:`taps.judge.WindowJudge` over the steps of a tuned decoder (``"auto"``: a new one where the
            decoder's tuner measures its costs, none where they are injected or there is no tuner; None: none).
    """

    def __init__(self, decoder: SpeculativeDecoder, max_batch: int = 16,
                 judge: Union[WindowJudge, None, str] = "auto"):
        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        self.decoder = decoder
        self.max_batch = max_batch
        if isinstance(judge, str) and judge != "auto" or not (judge is None or isinstance(judge, (str, WindowJudge))):
            raise ValueError(f"judge must be 'auto', None or a taps.judge.WindowJudge, got {judge!r}")
        if judge == "auto":  # a decoder whose tuner measures its costs (not injected ones)
            tuner = decoder.tuner
            judge = WindowJudge() if tuner is not None and tuner._learns_fix() else None
        #: windows of steps judged against plain ones (taps.judge.WindowJudge; None: every step the tuner's)
        self.judge: Optional[WindowJudge] = judge
        self.state: Optional[DecodeState] = None
        self._waiting: Deque[tuple] = deque()
        self._known: Dict[Hashable, str] = {}  # request id -> "waiting" | "running"
        self._cancelled: List[Hashable] = []
        self._events: Dict[Hashable, StepEvent] = {}
        self._limit = getattr(decoder.target.config, "max_position_embeddings", None)
        self._default_eos = frozenset(_default_eos(decoder))

    # -- the caller's side ---------------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return 0 if self.state is None else self.state.batch

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self.num_running or self._waiting or self._cancelled)

    def add(self, request_id: Hashable, prompt, params: Optional[SamplingParams] = None) -> None:
        """Queue a request: `prompt` as token ids (or text, with the decoder's tokenizer); it is admitted
        at a coming :meth:`step`. ValueError for a known id, a bad prompt or bad params."""
        params = params or SamplingParams()
        if request_id in self._known:
            raise ValueError(f"request {request_id!r} is already in the batch")
        params.check()
        ids = self.decoder.prompt_ids([prompt] if not isinstance(prompt, str) else prompt)
        if len(ids) != 1:
            raise ValueError("a request has one prompt")
        ids = ids[0]
        if self._limit is not None and len(ids) + params.max_new_tokens > self._limit:
            raise ValueError(f"the prompt's {len(ids)} tokens plus max_new_tokens={params.max_new_tokens} pass "
                             f"the target's context of {self._limit} positions")
        eos = self._default_eos if params.eos_token_id is None else frozenset(
            [params.eos_token_id] if isinstance(params.eos_token_id, int) else [int(e) for e in params.eos_token_id])
        seed = params.seed if params.seed is not None else random.SystemRandom().getrandbits(62)
        coins = torch.Generator(device=self.decoder.device).manual_seed(seed)
        request = RequestState(request_id, int(params.max_new_tokens), eos,
                               RequestStats(prompt_tokens=len(ids), drafter_accepted=[0] * len(self.decoder.drafters)),
                               coins)
        self._waiting.append((request, ids, params))
        self._known[request_id] = "waiting"

    def cancel(self, request_id: Hashable) -> None:
        """End a request at the next :meth:`step` (its last event says ``"cancelled"``); unknown or
        finished ids are ignored."""
        if request_id in self._known and request_id not in self._cancelled:
            self._cancelled.append(request_id)

    @torch.no_grad()
    def step(self) -> List[StepEvent]:
        """Drop cancelled requests, admit waiting ones, run one verification step; the events of the
        requests that received tokens or ended."""
        self._events = {}
        self._drop_cancelled()
        self._admit()
        state = self.state
        if state is not None and not state.finished:
            judge = self.judge
            if judge is None or self.decoder.tuner is None:
                self.decoder.step(state)
            else:
                # (the clock read around the step alone: admissions' prefills are no step's cost)
                plain, clock = judge.plain(), self.decoder.tuner.timer
                rows, active = state.batch, len(state.active())
                before = sum(len(r.tokens) for r in state.requests)
                t0 = clock()
                if plain:
                    self.decoder.plain_step(state)
                else:
                    self.decoder.step(state)
                seconds = clock() - t0
                judge.record(rows, active, sum(len(r.tokens) for r in state.requests) - before, seconds)
        self._drop_finished()
        return list(self._events.values())

    # -- internals -------------------------------------------------------------------------------------
    def _event(self, request: RequestState) -> StepEvent:
        event = self._events.get(request.key)
        if event is None:
            event = self._events[request.key] = StepEvent(request.key, [], None, request.stats)
        return event

    def _on_tokens(self, request: RequestState, tokens: List[int]) -> None:
        self._event(request).tokens.extend(tokens)
        request.stats.new_tokens = len(request.tokens)

    def _finish(self, request: RequestState, reason: str) -> None:
        request.stats.finish_reason = reason
        request.stats.new_tokens = len(request.tokens)
        self._event(request).finish_reason = reason
        self._known.pop(request.key, None)

    def _drop_cancelled(self) -> None:
        if not self._cancelled:
            return
        cancelled = set(self._cancelled)
        self._cancelled = []
        waiting = deque()
        for entry in self._waiting:
            if entry[0].key in cancelled:
                self._finish(entry[0], "cancelled")
            else:
                waiting.append(entry)
        self._waiting = waiting
        state = self.state
        if state is None:
            return
        keep = []
        for b, request in enumerate(state.requests):
            if request.key in cancelled and not request.done:
                request.done = True
                self._finish(request, "cancelled")
            else:
                keep.append(b)
        self._keep(keep)

    def _drop_finished(self) -> None:
        state = self.state
        if state is None:
            return
        keep = []
        for b, request in enumerate(state.requests):
            if request.done:
                if request.key in self._known:
                    self._finish(request, request.stats.finish_reason)
            else:
                keep.append(b)
        self._keep(keep)

    def _keep(self, keep: List[int]) -> None:
        state = self.state
        if len(keep) == state.batch:
            return
        if not keep:  # the batch is empty: the next admission starts a new one
            for g in state.groups:
                g.release()
            self.state = None
            return
        self.decoder.drop(state, _fill_holes(keep))

    def _admit(self) -> None:
        room = self.max_batch - self.num_running
        admitted = []
        while self._waiting and len(admitted) < room:
            request, ids, params = self._waiting.popleft()
            if request.max_new == 0:
                request.done = True
                self._finish(request, "length")
                continue
            self._known[request.key] = "running"
            admitted.append((request, ids, params))
        if not admitted:
            return
        requests = [a[0] for a in admitted]
        sample = _sample_settings([a[2] for a in admitted], self.decoder.device)
        dec = self.decoder
        fresh = self.state is None
        groups = dec.new_groups() if fresh else [g.spawn() for g in self.state.groups]
        state = dec.start([a[1] for a in admitted], requests, sample, groups, Profiler(enabled=False),
                          on_tokens=self._on_tokens, fresh=fresh)
        if fresh:
            state.can_drop = False
            state.closed = False
            self.state = state
        else:
            dec.join(self.state, state)


def _fill_holes(keep: List[int]) -> List[int]:
    """The positions `keep` (increasing) in the order that moves fewest rows: a kept request stays where it
    is, and the last ones take the places of those that left (each per-request tensor then copies one row
    per request that left, not every row after it)."""
    size = len(keep)
    kept = set(keep)
    order = list(range(size))
    holes = [i for i in order if i not in kept]
    for hole, src in zip(holes, [b for b in keep if b >= size]):
        order[hole] = src
    return order


def _sample_settings(params: Sequence[SamplingParams], device: torch.device) -> dict:
    """temperature / top_k / top_p of requests: one scalar each when they agree, else [B] tensors."""
    out = {}
    for name, dtype in (("temperature", torch.float32), ("top_k", torch.int64), ("top_p", torch.float32)):
        values = [getattr(p, name) for p in params]
        out[name] = values[0] if len(set(values)) == 1 else torch.tensor(values, dtype=dtype, device=device)
    return out


def _default_eos(decoder: SpeculativeDecoder) -> List[int]:
    """The EOS ids of the decoder's tokenizer, else of the target's generation or model config."""
    for source in (decoder.tokenizer, getattr(decoder.target, "generation_config", None), decoder.target.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if value is not None:
            return [value] if isinstance(value, int) else [int(v) for v in value]
    return []
