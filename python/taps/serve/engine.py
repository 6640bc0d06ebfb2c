"""The engine: every decoding step of the server runs in its loop, one thread, no locks around torch.

Requests reach it from the asyncio side through a queue (:meth:`Engine.submit`, :meth:`Engine.cancel`);
what it decodes goes back to each request's ``send`` (the asyncio side's mailbox). :class:`Engine` runs the
loop in a thread of the server's process; :class:`ProcessEngine` (what ``taps serve`` runs) in a process of
its own, behind the same interface.

A :class:`taps.decoder.SpeculativeDecoder` decodes one strategy with one drafter set, so requests are
grouped by :class:`BatchKey` (strategy, drafter names, whether a tuner chooses each step's draft); each
key gets a :class:`taps.batching.ContinuousBatch` over a decoder of its own, made on first use from the
loaded models. Every turn of the loop the engine takes new requests and cancellations, admits waiting
requests while fewer than ``max_batch`` are in the batches (the rest wait in the engine's queue, whose
length the asyncio side bounds), ends requests past their deadline, and runs one step of every non-empty
batch in turn. A request leaves its batch at EOS, at its max_tokens, at a stop string (the engine cancels
it: stop strings are found here, in the text of each step's tokens), on its client's disconnect or at its
deadline.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import traceback
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, Hashable, List, Optional, Sequence, Tuple

import torch

from ..arguments import resolve_device
from .config import ServeConfig, store_path
from .text import TextStream

__all__ = ["BatchKey", "ModelSet", "Output", "Submission", "Engine", "ProcessEngine", "load_models"]

log = logging.getLogger("taps.serve")


def _load_store(spec: str, target_folder: Optional[str]):
    """A lookup drafter's token store from its config value (checked by taps.serve.config): a path to a store
    folder (its manifest checked) or .npz file, or a name in models/stores (checked against the target)."""
    from .. import models
    from ..drafters import TokenStore

    path = store_path(spec)
    if path is None:
        return models.load_store(spec, target=target_folder)
    if path.suffix == ".npz":
        return TokenStore.load(path)
    return models.load_store(path.name, path=path.parent, target=target_folder)


@dataclass(frozen=True)
class BatchKey:
    """What one decoder decodes with: a strategy, the drafters by name, and whether a tuner chooses each
    step's draft among them (``budget="auto"``)."""

    strategy: str
    drafters: Tuple[str, ...]
    auto: bool


@dataclass
class ModelSet:
    """The loaded models: the target, its tokenizer and the drafters requests may name."""

    name: str
    target: torch.nn.Module
    tokenizer: Any
    drafters: Dict[str, Any]
    #: the target's context (max_position_embeddings); None when its config has none
    context_length: Optional[int]
    vocab_size: int
    eos_token_ids: List[int]
    #: the weights' dtype and device as the engine runs them ("bfloat16", "cpu"), also where this set holds
    #: none (:func:`load_models` with ``weights=False``: the target on the meta device, no drafters)
    dtype: str
    device: str
    #: Hugging Face fast tokenizers may not be used from two threads at once
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def chat_tokenizer(self) -> bool:
        from ..chat import ChatTokenizer

        return isinstance(self.tokenizer, ChatTokenizer)

    def encode_chat(self, messages: List[dict]) -> List[int]:
        """Token ids of the conversation in the target's chat template, ending with the generation prompt;
        ValueError when the template cannot render it."""
        with self.lock:
            if self.chat_tokenizer:
                return self.tokenizer.encode_chat(messages, add_generation_prompt=True)
            if not getattr(self.tokenizer, "chat_template", None):
                raise ValueError(f"the model {self.name} has no chat template; use /v1/completions")
            try:
                text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            except Exception as e:  # the template's own errors (jinja): the conversation does not fit it
                raise ValueError(f"the chat template cannot render these messages: {e}") from None
            return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def encode_text(self, text: str) -> List[int]:
        """Token ids of a completion prompt (the tokenizer's own special tokens added, as for training text)."""
        with self.lock:
            if self.chat_tokenizer:
                return self.tokenizer.encode_text(text)
            return list(self.tokenizer(text)["input_ids"])

    def decode(self, ids: List[int]) -> str:
        with self.lock:
            return self.tokenizer.decode(ids, skip_special_tokens=True)


def _target_on_meta(folder: str, dtype: torch.dtype) -> torch.nn.Module:
    """The target of `folder` built on the meta device: its config, shapes and generation config (the eos
    ids of generation_config.json, as from_pretrained reads them), no weights read."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(folder)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    model.to(dtype)
    try:
        model.generation_config = GenerationConfig.from_pretrained(folder)
    except OSError:  # no generation_config.json: the one from_config derived from the model's config
        pass
    return model.eval()


def load_models(cfg: ServeConfig, weights: bool = True) -> ModelSet:
    """Load the target, its tokenizer and the drafters of `cfg` (shipped files checked against their
    manifests). ``weights=False``: what a server whose engine runs in a process of its own needs here, the
    tokenizer and the target's facts (context, vocabulary, eos ids) with the target on the meta device, no
    weights read and no drafters loaded (the names map to None; the engine's process loads and checks
    them)."""
    from .. import models
    from ..drafters import (EagleDrafter, ModelDrafter, NgramTable, NgramTableDrafter, PromptLookupDrafter,
                            target_vocab_size)

    device = resolve_device(cfg.device)
    dtype = models.resolve_dtype(cfg.dtype, device)
    if cfg.shipped_target:
        if weights:
            target, tok = models.load_target(dtype=dtype)
        else:
            from ..chat import ChatTokenizer

            folder = models.models_dir() / "target"
            target, tok = _target_on_meta(str(folder), dtype), ChatTokenizer.from_pretrained(folder)
        name = cfg.model_name or "taps-mini"
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        target = (AutoModelForCausalLM.from_pretrained(cfg.target, dtype=dtype).eval() if weights
                  else _target_on_meta(cfg.target, dtype))
        tok = AutoTokenizer.from_pretrained(cfg.target)
        name = cfg.model_name or cfg.target.rstrip("/").rsplit("/", 1)[-1]
    if weights:
        target.to(device)
    drafters: Dict[str, Any] = {}
    for key, spec in cfg.drafters.items():
        if not weights:
            drafters[key] = None
            continue
        if spec.kind == "shipped":
            family, data = spec.path.split("-", 1)
            vocab = spec.options.get("draft_vocab", cfg.draft_vocab)
            drafters[key] = models.load_drafter(family, data, target, draft_vocab=vocab or None)
        elif spec.kind == "eagle":
            drafters[key] = EagleDrafter.from_pretrained(spec.path, target=target, dtype=dtype)
        elif spec.kind == "model":
            drafters[key] = ModelDrafter.from_pretrained(spec.path, dtype=dtype)
            drafters[key].bind(target)
        elif spec.kind == "table":
            drafters[key] = NgramTableDrafter(NgramTable.load(spec.path), **spec.options)
            drafters[key].bind(target)
        else:
            options = dict(spec.options)
            if "store" in options:
                options["store"] = _load_store(options["store"], None if cfg.shipped_target else cfg.target)
            drafters[key] = PromptLookupDrafter(**options)
            drafters[key].bind(target)
    config = target.config
    context = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    eos = set()
    for source in (getattr(tok, "eos_token_id", None), getattr(getattr(target, "generation_config", None),
                                                                    "eos_token_id", None)):
        if source is not None:
            eos |= {int(source)} if isinstance(source, int) else {int(e) for e in source}
    return ModelSet(name, target, tok, drafters, int(context) if context else None, target_vocab_size(target),
                    sorted(eos), str(dtype).replace("torch.", ""), str(device))


@dataclass
class Output:
    """What the engine sends a request: new text and the tokens generated so far, then with the last
    text the finish reason (``stop`` / ``length``) and the request's ``taps`` report (:meth:`Engine.report`);
    or an error instead."""

    text: str = ""
    completion_tokens: int = 0
    finish_reason: Optional[str] = None
    taps: Optional[dict] = None
    #: (HTTP status, message, code) when the request failed
    error: Optional[Tuple[int, str, Optional[str]]] = None


@dataclass
class Submission:
    """A request as the asyncio side hands it to the engine."""

    request_id: Hashable
    key: BatchKey
    prompt_ids: List[int]
    params: Any  # taps.batching.SamplingParams
    stop: List[str]
    deadline: float
    send: Callable[[Output], None]
    arrival: float = field(default_factory=time.perf_counter)


class _Live:
    """A request's engine-side state."""

    def __init__(self, sub: Submission, stream: TextStream):
        self.sub, self.stream = sub, stream
        self.first = True
        #: no output wanted any more (the answer is complete, the client left, or it timed out); the
        #: request is still in its batch until the batch reports it cancelled
        self.closed = False


class Engine:
    """The engine thread over `models` (see the module docstring).

    Args:
        models: the loaded :class:`ModelSet`.
        config: the server's settings (decoder settings, max_batch).
        metrics: a :class:`taps.serve.metrics.ServerMetrics` (or None).
    """

    def __init__(self, models: ModelSet, config: ServeConfig, metrics=None, max_decoders: int = 16):
        self.models, self.config, self.metrics = models, config, metrics
        self.max_decoders = max_decoders
        self._inbox: "queue.Queue" = queue.Queue()
        self._pending: Deque[Submission] = deque()
        self._live: Dict[Hashable, _Live] = {}
        self._where: Dict[Hashable, BatchKey] = {}
        self._batches: "OrderedDict[BatchKey, Any]" = OrderedDict()
        self._decoders: Dict[BatchKey, Any] = {}
        self._thread: Optional[threading.Thread] = None
        self._stopping = False
        #: the engine thread died on an unexpected error (the server answers 503 then)
        self.failed: Optional[str] = None
        #: requests admitted to a batch (running or waiting there) and waiting in the engine's queue,
        #: as of the last turn of the loop
        self.num_running = 0
        self.num_waiting = 0
        self._throughput = _TokenRate()
        #: called at the end of every turn of the loop, in the engine's thread (ProcessEngine's child:
        #: sends the turn's outputs)
        self.on_turn: Optional[Callable[[], None]] = None

    # -- the asyncio side ------------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="taps-engine", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and end the thread."""
        if self._thread is not None:
            self._inbox.put(("stop", None))
            self._thread.join(timeout)
            self._thread = None

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, sub: Submission) -> None:
        self._inbox.put(("add", sub))

    def cancel(self, request_id: Hashable) -> None:
        """The client left: drop the request without output (unknown or finished ids are ignored)."""
        self._inbox.put(("cancel", request_id))

    # -- the engine thread -----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            with torch.no_grad():
                while not self._stopping:
                    self._turn()
        except BaseException:  # an engine bug: fail every request rather than leave them waiting
            self.failed = traceback.format_exc()
            log.error("taps serve: the engine thread stopped:\n%s", self.failed)
        finally:
            for key in list(self._decoders):
                self._save_tuner(key)
            why = "the server is shutting down" if self._stopping else "the decoding engine stopped on an internal error"
            for sub in list(self._pending) + [live.sub for live in self._live.values() if not live.closed]:
                sub.send(Output(error=(503, why, None)))
            self._pending.clear()
            self._live.clear()

    def _turn(self) -> None:
        busy = bool(self._pending) or any(self._batches.values())
        try:
            command = self._inbox.get(block=not busy, timeout=None)
        except queue.Empty:
            command = None
        while command is not None:
            self._command(*command)
            try:
                command = self._inbox.get_nowait()
            except queue.Empty:
                command = None
        if self._stopping:
            return
        self._expire()
        self._admit()
        for key, batch in list(self._batches.items()):
            if batch:
                self._step(key, batch)
        self._count()
        if self.on_turn is not None:
            self.on_turn()

    def _command(self, kind: str, value) -> None:
        if kind == "stop":
            self._stopping = True
        elif kind == "add":
            self._pending.append(value)
        elif kind == "cancel":
            self._drop(value)

    def _drop(self, request_id: Hashable) -> None:
        """Leave without further output: out of the queue now, or out of its batch at its next step."""
        for sub in self._pending:
            if sub.request_id == request_id:
                self._pending.remove(sub)
                return
        live = self._live.get(request_id)
        if live is not None and not live.closed:
            live.closed = True
            self._batches[self._where[request_id]].cancel(request_id)

    def _expire(self) -> None:
        now = time.perf_counter()
        late = [s for s in self._pending if s.deadline <= now]
        late += [live.sub for live in self._live.values() if not live.closed and live.sub.deadline <= now]
        for sub in late:
            self._drop(sub.request_id)
            sub.send(Output(error=(408, f"the request took longer than the server's timeout "
                                        f"({self.config.timeout:g} s)", "timeout")))
            if self.metrics is not None:
                self.metrics.finished.labels("timeout").inc()

    def _in_batches(self) -> int:
        return sum(b.num_running + b.num_waiting for b in self._batches.values())

    def _admit(self) -> None:
        room = self.config.max_batch - self._in_batches()
        while self._pending and room > 0:
            sub = self._pending.popleft()
            try:
                batch = self._batch(sub.key)
                batch.add(sub.request_id, sub.prompt_ids, sub.params)
            except (ValueError, TypeError) as e:  # a decoder the drafters cannot make, a prompt it refuses
                sub.send(Output(error=(400, str(e), None)))
                continue
            self._live[sub.request_id] = _Live(sub, TextStream(self.models.decode, sub.stop))
            self._where[sub.request_id] = sub.key
            room -= 1

    def _batch(self, key: BatchKey):
        """The batch of `key`, made on first use (the least recently used idle one goes past
        ``max_decoders``)."""
        from ..batching import ContinuousBatch
        from ..decoder import SpeculativeDecoder

        batch = self._batches.get(key)
        if batch is not None:
            self._batches.move_to_end(key)
            return batch
        cfg = self.config
        decoder = SpeculativeDecoder(self.models.target, [self.models.drafters[n] for n in key.drafters],
                                     key.strategy, depth=cfg.depth, top_k=cfg.top_k,
                                     budget="auto" if key.auto else None if cfg.budget == "auto" else cfg.budget,
                                     tokenizer=self.models.tokenizer)
        decoder.retire_after = cfg.retire_steps
        batch = self._batches[key] = ContinuousBatch(decoder, max_batch=cfg.max_batch,
                                                     judge=cfg.judge if decoder.tuner is not None else None)
        self._decoders[key] = decoder
        path = self._tuner_path(key)
        if path is not None and path.is_file():
            try:
                decoder.load_tuner(path, window_judge=batch.judge)
                log.info("taps serve: %s: the tuner's state from %s", key, path)
            except (ValueError, OSError) as e:  # measured on another setup, or unreadable: start afresh
                log.warning("taps serve: %s: not using %s: %s", key, path, e)
        idle = [k for k, b in self._batches.items() if not b and k != key]
        for k in idle[:max(0, len(self._batches) - self.max_decoders)]:
            self._save_tuner(k)
            del self._batches[k], self._decoders[k]
        return batch

    def _tuner_path(self, key: BatchKey):
        """Where the tuner of `key`'s decoder keeps its state between runs (``tuner_dir``), or None."""
        if not self.config.tuner_dir or not key.auto:
            return None
        import hashlib
        from pathlib import Path

        name = hashlib.sha256(repr((key.strategy, key.drafters)).encode()).hexdigest()[:16]
        return Path(self.config.tuner_dir) / f"tuner-{name}.json"

    def _save_tuner(self, key: BatchKey) -> None:
        path = self._tuner_path(key)
        decoder = self._decoders.get(key)
        if path is None or decoder is None or decoder.tuner is None:
            return
        batch = self._batches.get(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            decoder.save_tuner(path, window_judge=None if batch is None else batch.judge)
        except OSError as e:
            log.warning("taps serve: %s: could not save the tuner's state to %s: %s", key, path, e)

    def _step(self, key: BatchKey, batch) -> None:
        t0 = time.perf_counter()
        try:
            events = batch.step()
        except Exception:  # a decoding error: this batch's requests fail, the others go on
            log.error("taps serve: a decoding step failed (%s):\n%s", key, traceback.format_exc())
            for rid in [r for r, k in self._where.items() if k == key]:
                live = self._live.pop(rid)
                del self._where[rid]
                if not live.closed:
                    live.sub.send(Output(error=(500, "the decoding step failed on an internal error", None)))
                    if self.metrics is not None:
                        self.metrics.finished.labels("error").inc()
            del self._batches[key], self._decoders[key]
            return
        seconds = time.perf_counter() - t0
        committed = 0
        for event in events:
            committed += len(event.tokens)
            self._event(event)
        if self.metrics is not None:
            self.metrics.step_seconds.observe(seconds)
        now = time.perf_counter()
        self._throughput.add(now, committed)

    def _event(self, event) -> None:
        live = self._live.get(event.request_id)
        if live is None:
            return
        sub = live.sub
        if event.finish_reason is not None:  # out of its batch
            del self._live[event.request_id]
            del self._where[event.request_id]
        if live.closed:
            return
        now = time.perf_counter()
        if live.first and event.tokens and self.metrics is not None:
            self.metrics.time_to_first_token.observe(now - sub.arrival)
        text = live.stream.feed(event.tokens)
        reason = event.finish_reason
        if live.stream.stopped:
            reason = "stop"
            if event.finish_reason is None:
                live.closed = True
                self._batches[self._where[event.request_id]].cancel(event.request_id)
        elif reason in ("eos", "length"):
            text += live.stream.finish()
            reason = "stop" if reason == "eos" else "length"
        elif reason is not None:  # cancelled by no one here: the batch dropped it
            sub.send(Output(error=(500, f"the request ended unexpectedly ({reason})", None)))
            return
        done = reason is not None
        report = self.report(sub.key, event.stats) if done else None
        if text or done or live.first:
            sub.send(Output(text=text, completion_tokens=live.stream.num_tokens, finish_reason=reason, taps=report))
        live.first = False
        if done and self.metrics is not None:
            self.metrics.request_done(len(sub.prompt_ids), live.stream.num_tokens, reason, event.stats,
                                      now - sub.arrival, report)

    def report(self, key: BatchKey, stats) -> dict:
        """The ``taps`` block of a response: the strategy and drafters, tau, each drafter's share of the
        accepted draft tokens, and the steps per draft shape (drafters, depth ``d``, node budget ``n``:
        the tuner's choices, or the fixed shape)."""
        decoder = self._decoders[key]
        names = list(key.drafters)
        if len(decoder.drafters) != len(names):  # checkpoint averaging: one drafter, their mean
            names = ["+".join(names)] if decoder.drafters else []
        if stats.draft_shapes:
            shapes = {_shape_name(label, names): n for label, n in stats.shape_histogram.items()}
        elif stats.target_forwards:
            label = f"{'+'.join(names)} d{decoder.depth} n{decoder.budget}" if names else "none"
            shapes = {label: stats.target_forwards}
        else:
            shapes = {}
        return {"strategy": key.strategy, "drafters": list(key.drafters), "budget": "auto" if key.auto else decoder.budget,
                "tau": round(stats.tau, 4), "target_forwards": stats.target_forwards,
                "accepted_draft_tokens": sum(stats.accepted),
                "drafter_share": {n: round(s, 4) for n, s in zip(names, stats.drafter_share)},
                "draft_shapes": shapes}

    def _count(self) -> None:
        in_batches = sum(b.num_running for b in self._batches.values())
        waiting = len(self._pending) + sum(b.num_waiting for b in self._batches.values())
        self.num_running, self.num_waiting = in_batches, waiting
        if self.metrics is not None:
            self.metrics.running.set(in_batches)
            self.metrics.queue_depth.set(waiting)
            self.metrics.tokens_per_second.set(self._throughput.per_second())


class ProcessEngine:
    """The engine in a process of its own (``ServeConfig.engine`` "process", what ``taps serve`` runs): the
    same interface as :class:`Engine`, whose loop runs in a child process (a fresh interpreter) that loads
    its own models from the config (:func:`load_models`).

    In one process the engine thread shares Python's interpreter lock with the event loop: every torch op
    of a step releases it and the step waits to take it back while the loop parses and answers HTTP (an
    autoregressive step of 8 requests measured 3.3-4.0 ms served in one process against 1.8 ms alone).
    Here the loop's process only tokenises prompts, answers HTTP and forwards each turn's outputs; the
    engine's process decodes. Requests go to the child through a pipe; each turn of its loop sends back
    one message with the turn's outputs, the metrics' updates (replayed on this process's
    :class:`~taps.serve.metrics.ServerMetrics`) and the running / waiting counts; a thread here receives
    them and hands each output to its request's ``send``.
    """

    def __init__(self, models: ModelSet, config: ServeConfig, metrics=None, max_decoders: int = 16):
        self.models, self.config, self.metrics = models, config, metrics
        self.max_decoders = max_decoders
        self._subs: Dict[Hashable, Submission] = {}
        self._lock = threading.Lock()  # the sending end of the pipe and _subs
        self._process = None
        self._conn = None
        self._reader: Optional[threading.Thread] = None
        self._stopping = False
        self._closed = False  # the reader has ended: no output will come
        #: why the engine's process stopped (the server answers 503 then)
        self.failed: Optional[str] = None
        self.num_running = 0
        self.num_waiting = 0

    def start(self, timeout: float = 600.0) -> None:
        """Start the engine's process and wait until its models are loaded (RuntimeError with the child's
        error if it fails or takes longer than `timeout` seconds). The child is a fresh interpreter
        (``python -c``, this process's ``sys.path``) that imports taps only: unlike multiprocessing's spawn
        it does not import the caller's main module again."""
        import socket
        import subprocess
        import sys
        from multiprocessing.connection import Connection

        if self._process is not None:
            return
        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                f"from taps.serve.engine import _engine_main; _engine_main({theirs.fileno()})")
        try:
            self._process = subprocess.Popen([sys.executable, "-c", code], pass_fds=(theirs.fileno(),))
        finally:
            theirs.close()
        self._conn = conn = Connection(ours.detach())
        conn.send((self.config, self.max_decoders, torch.get_num_threads(),
                   logging.getLogger("taps").getEffectiveLevel()))
        deadline = time.monotonic() + timeout
        problem = None
        while problem is None and not conn.poll(0.05):
            if self._process.poll() is not None:
                problem = f"exited while loading the models (code {self._process.returncode})"
            elif time.monotonic() > deadline:
                problem = f"did not load the models in {timeout:g} s"
        if problem is None:
            message = conn.recv()
            if message[0] != "ready":
                problem = f"could not start:\n{message[1]}"
        if problem is not None:
            if self._process.poll() is None:
                try:
                    self._process.wait(5)
                except subprocess.TimeoutExpired:
                    self._process.kill()
                    self._process.wait(5)
            conn.close()
            self._process = self._conn = None
            raise RuntimeError(f"taps serve: the engine's process {problem}")
        self._reader = threading.Thread(target=self._read, name="taps-engine-reader", daemon=True)
        self._reader.start()

    def stop(self, timeout: float = 30.0) -> None:
        """Cancel everything and end the process (killed past `timeout` seconds)."""
        import subprocess

        if self._process is None:
            return
        self._stopping = True
        self._send(("stop", None))
        try:
            self._process.wait(timeout)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait(5)
        if self._reader is not None:
            self._reader.join(timeout)
        self._conn.close()
        self._process = self._reader = None

    @property
    def alive(self) -> bool:
        return (self._process is not None and self._process.poll() is None and self._reader is not None
                and self._reader.is_alive())

    def submit(self, sub: Submission) -> None:
        with self._lock:
            closed = self._closed
            if not closed:
                self._subs[sub.request_id] = sub
        if closed:  # the process ended after the server checked that it was alive
            sub.send(Output(error=(503, "the decoding engine stopped", None)))
        elif not self._send(("add", (sub.request_id, sub.key, list(sub.prompt_ids), sub.params, list(sub.stop),
                                   sub.deadline, sub.arrival))):
            self._finish(sub.request_id, Output(error=(503, "the decoding engine stopped", None)))

    def cancel(self, request_id: Hashable) -> None:
        """The client left: drop the request without output (unknown or finished ids are ignored)."""
        with self._lock:
            known = self._subs.pop(request_id, None) is not None
        if known:
            self._send(("cancel", request_id))

    def _send(self, message) -> bool:
        with self._lock:
            try:
                self._conn.send(message)
                return True
            except (OSError, ValueError, AttributeError):  # the process is gone (or stopped)
                return False

    def _finish(self, request_id: Hashable, out: Output) -> None:
        with self._lock:
            sub = self._subs.pop(request_id, None)
        if sub is not None:
            sub.send(out)

    def _read(self) -> None:
        """This process's side of the pipe: each turn's outputs to their requests, the metrics' updates."""
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                break
            kind = message[0]
            if kind == "out":
                _, outputs, calls, counts = message
                self.num_running, self.num_waiting = counts
                for request_id, out in outputs:
                    final = out.error is not None or out.finish_reason is not None
                    with self._lock:
                        sub = self._subs.pop(request_id, None) if final else self._subs.get(request_id)
                    if sub is not None:
                        sub.send(out)
                if self.metrics is not None and calls:
                    _replay(self.metrics, calls)
            elif kind == "failed":
                self.failed = message[1]
                log.error("taps serve: the engine stopped:\n%s", self.failed)
        if not self._stopping and self.failed is None:
            code = self._process.poll() if self._process is not None else None
            self.failed = f"the engine's process exited (code {code})"
            log.error("taps serve: %s", self.failed)
        why = "the server is shutting down" if self._stopping else "the decoding engine stopped on an internal error"
        with self._lock:
            subs, self._subs, self._closed = list(self._subs.values()), {}, True
        for sub in subs:
            sub.send(Output(error=(503, why, None)))


@dataclass
class _StatsView:
    """What :meth:`ServerMetrics.request_done` reads of a request's stats, sent between processes."""

    target_forwards: int
    tau: float
    accepted: List[int]
    drafter_accepted: List[int]


class _Recorder:
    """Stands for a :class:`~taps.serve.metrics.ServerMetrics` in the engine's process: records each call
    (the attribute path, ``labels(...)`` included, and the arguments) for :func:`_replay` in the server's."""

    def __init__(self, calls: Optional[list] = None, path: tuple = ()):
        self._calls = calls if calls is not None else []
        self._path = path

    def __getattr__(self, name: str) -> "_Recorder":
        if name.startswith("__"):
            raise AttributeError(name)
        return _Recorder(self._calls, self._path + (name,))

    def labels(self, *values) -> "_Recorder":
        return _Recorder(self._calls, self._path + (("labels", values),))

    def __call__(self, *args) -> None:
        self._calls.append((self._path, args))

    def request_done(self, prompt_tokens, completion_tokens, reason, stats, seconds, report) -> None:
        view = _StatsView(int(stats.target_forwards), float(stats.tau), [int(a) for a in stats.accepted],
                          [int(a) for a in stats.drafter_accepted])
        self._calls.append((("request_done",), (prompt_tokens, completion_tokens, reason, view, seconds, report)))

    def take(self) -> list:
        calls, self._calls[:] = list(self._calls), []
        return calls


def _replay(metrics, calls: list) -> None:
    for path, args in calls:
        target = metrics
        for part in path:
            target = target.labels(*part[1]) if isinstance(part, tuple) else getattr(target, part)
        target(*args)


def _engine_main(fd: int) -> None:
    """The engine's process (:class:`ProcessEngine`): its settings, then requests, through the socket `fd`.
    Ctrl-C reaches the terminal's whole process group: the server's process stops this one (a stop message,
    or the pipe's end), so it ignores SIGINT rather than die mid-step with a traceback."""
    import signal
    from multiprocessing.connection import Connection

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    conn = Connection(fd)
    config, max_decoders, threads, log_level = conn.recv()
    _engine_process(config, max_decoders, conn, threads, log_level)


def _engine_process(config: ServeConfig, max_decoders: int, conn, threads: int, log_level: int) -> None:
    """Load the models, then run the engine's loop in this thread while a second thread moves the requests
    arriving through `conn` into its queue."""
    logging.basicConfig(level=log_level, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("taps").setLevel(log_level)
    torch.set_num_threads(max(1, threads))
    try:
        models = load_models(config)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        conn.close()
        return
    recorder = _Recorder()
    engine = Engine(models, config, recorder, max_decoders)
    outbox: List[Tuple[Hashable, Output]] = []
    sent_counts = [(-1, -1)]

    def flush() -> None:
        counts = (engine.num_running, engine.num_waiting)
        calls = recorder.take()
        if outbox or calls or counts != sent_counts[0]:
            try:
                conn.send(("out", outbox[:], calls, counts))
            except OSError:  # the server's process is gone: nobody to decode for
                engine._inbox.put(("stop", None))
            outbox.clear()
            sent_counts[0] = counts

    def receive() -> None:
        while True:
            try:
                kind, value = conn.recv()
            except (EOFError, OSError):  # the server's process is gone
                kind, value = "stop", None
            if kind == "add":
                request_id, key, prompt_ids, params, stop, deadline, arrival = value
                send = (lambda out, rid=request_id: outbox.append((rid, out)))
                value = Submission(request_id, key, prompt_ids, params, stop, deadline, send, arrival)
            engine._inbox.put((kind, value))
            if kind == "stop":
                return

    engine.on_turn = flush
    threading.Thread(target=receive, name="taps-engine-inbox", daemon=True).start()
    conn.send(("ready", None))
    engine._run()
    flush()
    if engine.failed is not None:
        try:
            conn.send(("failed", engine.failed))
        except OSError:
            pass
    conn.close()


class _TokenRate:
    """Tokens per second over the steps of the last `window` seconds: the tokens of every step but the
    first of the window over the time from the first to the last (a running sum: a server makes hundreds
    of steps a second, and a sum over the window at each step grew with it)."""

    def __init__(self, window: float = 10.0):
        self.window = window
        self.steps: Deque[Tuple[float, int]] = deque()
        self.tokens = 0  # of every step in `steps` but the first

    def add(self, now: float, tokens: int) -> None:
        if self.steps:
            self.tokens += tokens
        self.steps.append((now, tokens))
        while self.steps[0][0] < now - self.window:
            self.steps.popleft()
            self.tokens -= self.steps[0][1]  # the new first step's tokens leave the sum

    def per_second(self) -> float:
        span = self.steps[-1][0] - self.steps[0][0] if len(self.steps) > 1 else 0.0
        return self.tokens / span if span > 0 else 0.0


def _shape_name(label: str, names: Sequence[str]) -> str:
    """A tuner's shape label (``0+1 d3 n16``) with drafter names for indices (``math+chat d3 n16``)."""
    head, _, rest = label.partition(" ")
    try:
        drafters = "+".join(names[int(i)] for i in head.split("+"))
    except (ValueError, IndexError):
        return label
    return f"{drafters} {rest}".strip()
