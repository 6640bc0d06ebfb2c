"""STAND-IN for ``taps.batching`` (the continuous batch the lead engineer is writing), with its interface:
``SamplingParams``, ``StepEvent``, ``ContinuousBatch``. The serving code and its tests run against it until
the real module is on main; then this file goes. It is not part of the package: :func:`install` puts it
in ``sys.modules`` as ``taps.batching`` when that module does not exist.

How it decodes: every running request is one ``SpeculativeDecoder.generate`` call on a decoder of its own
(a decoder's groups and strategy hold one generation's state), in a worker thread that runs in lock step
with :meth:`ContinuousBatch.step`: each ``step()`` lets each running request's generation run one
verification step (the prefill and its token on the first), then parks it in its stream callback. No
two threads run torch at once. It is one batch in name only: requests decode one after another.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from dataclasses import dataclass
from typing import Hashable, List, Optional, Sequence, Union

from taps.stats import RequestStats


@dataclass
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: Optional[int] = None
    eos_token_id: Union[int, Sequence[int], None] = None


@dataclass
class StepEvent:
    request_id: Hashable
    tokens: List[int]
    finish_reason: Optional[str]
    stats: RequestStats


class _Cancelled(Exception):
    pass


class _Request:
    def __init__(self, request_id, prompt, params, eos, decoder):
        self.id, self.prompt, self.params, self.eos, self.decoder = request_id, list(prompt), params, eos, decoder
        self.stats = RequestStats(prompt_tokens=len(prompt), drafter_accepted=[0] * len(decoder.drafters))
        self.count = 0
        self.cancelled = False
        self.go = threading.Semaphore(0)
        self.out: "deque" = deque()
        self.ready = threading.Semaphore(0)
        self.thread: Optional[threading.Thread] = None
        self.result = None

    def run(self):
        p = self.params
        try:
            out = self.decoder.generate([self.prompt], max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                                        top_k=p.top_k, top_p=p.top_p, eos_token_id=sorted(self.eos),
                                        seed=p.seed, stream=self.on_tokens)
            self.out.append(("done", out))
        except _Cancelled:
            self.out.append(("cancelled", None))
        except BaseException as e:  # handed to the engine thread
            self.out.append(("error", e))
        self.ready.release()

    def on_tokens(self, _b, tokens):
        self.out.append(("tokens", list(tokens)))
        self.ready.release()
        self.go.acquire()
        if self.cancelled:
            raise _Cancelled()

    def resume(self):
        """Run the generation to its next stream call or its end; returns the message."""
        if self.thread is None:
            self.thread = threading.Thread(target=self.run, daemon=True)
            self.thread.start()
        else:
            self.go.release()
        self.ready.acquire()
        return self.out.popleft()


def _fresh_decoder(dec):
    from taps.decoder import SpeculativeDecoder
    from taps.tuner import Tuner

    return SpeculativeDecoder(dec.target, dec.drafters, dec.strategy.name, depth=dec.depth, top_k=dec.top_k,
                              budget=dec.budget, tokenizer=dec.tokenizer,
                              tuner=Tuner() if dec.tuner is not None else None)


class ContinuousBatch:
    def __init__(self, decoder, max_batch: int = 16):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.decoder, self.max_batch = decoder, int(max_batch)
        self._waiting: "deque[_Request]" = deque()
        self._running: List[_Request] = []
        self._cancelled: List[_Request] = []

    def _eos(self, eos_token_id):
        if eos_token_id is None:
            tok = self.decoder.tokenizer
            eos_token_id = getattr(tok, "eos_token_id", None) if tok is not None else None
            if eos_token_id is None:
                eos_token_id = getattr(self.decoder.target.config, "eos_token_id", None)
        if eos_token_id is None:
            return set()
        return {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(e) for e in eos_token_id}

    def add(self, request_id, prompt_ids: Sequence[int], params: SamplingParams) -> None:
        from taps.drafters import target_vocab_size

        if any(r.id == request_id for r in list(self._waiting) + self._running):
            raise ValueError(f"request {request_id!r} is already in the batch")
        prompt = list(prompt_ids)
        vocab = target_vocab_size(self.decoder.target)
        if not prompt or any(isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab for t in prompt):
            raise ValueError(f"a prompt needs at least one token id in [0, {vocab})")
        if int(params.max_new_tokens) < 0 or params.temperature < 0 or params.top_k < 0 or not 0 < params.top_p <= 1:
            raise ValueError(f"bad sampling parameters {params}")
        self._waiting.append(_Request(request_id, prompt, params, self._eos(params.eos_token_id),
                                      _fresh_decoder(self.decoder)))

    def cancel(self, request_id) -> None:
        for r in list(self._waiting):
            if r.id == request_id:
                self._waiting.remove(r)
                self._cancelled.append(r)
                return
        for r in self._running:
            if r.id == request_id:
                r.cancelled = True

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def __bool__(self) -> bool:
        return bool(self._running or self._waiting or self._cancelled)

    def _finish(self, r: _Request) -> None:
        if r.thread is not None:
            r.go.release()
            r.ready.acquire()
            kind, value = r.out.popleft()
            r.thread.join()
            if kind == "done":
                r.stats = value.stats[0]
            elif kind == "error":
                raise value

    def step(self) -> List[StepEvent]:
        events = [StepEvent(r.id, [], "cancelled", r.stats) for r in self._cancelled]
        self._cancelled = []
        while self._waiting and len(self._running) < self.max_batch:
            self._running.append(self._waiting.popleft())
        for r in list(self._running):
            if r.cancelled:
                self._finish(r)
                self._running.remove(r)
                events.append(StepEvent(r.id, [], "cancelled", r.stats))
                continue
            kind, value = r.resume()
            if kind == "error":
                self._running.remove(r)
                raise value
            tokens = value if kind == "tokens" else []
            if r.count and tokens:
                r.stats.record(len(tokens) - 1, r.decoder.depth)
            r.count += len(tokens)
            reason = None
            if kind == "done" or r.count >= r.params.max_new_tokens:
                reason = "length"
            if tokens and tokens[-1] in r.eos:
                reason = "eos"
            if reason is not None:
                if kind == "tokens":
                    self._finish(r)
                else:
                    r.stats = value.stats[0]
                self._running.remove(r)
            events.append(StepEvent(r.id, tokens, reason, r.stats))
        return events


def install() -> None:
    """Make ``import taps.batching`` give this module when the package has none."""
    import importlib.util

    import taps

    if "taps.batching" in sys.modules or importlib.util.find_spec("taps.batching") is not None:
        return
    module = sys.modules[__name__]
    sys.modules["taps.batching"] = module
    taps.batching = module
