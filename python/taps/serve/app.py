"""The HTTP routes (FastAPI): the OpenAI API subset, ``/health`` and ``/metrics``.

    POST /v1/chat/completions   messages in the target's chat template -> one choice (or server-sent events)
    POST /v1/completions        a text prompt (or token ids) -> one choice (or server-sent events)
    GET  /v1/models             the served model (with its drafters and strategies in a ``taps`` field)
    GET  /health                200 {"status": "ok", ...} while the engine runs, else 503
    GET  /metrics               Prometheus text format (taps.serve.metrics)

Handlers parse and check a request (:mod:`taps.serve.protocol`), tokenize its prompt, check its length
against the model, and hand it to the engine (:mod:`taps.serve.engine`); what the engine sends
back arrives in the request's own asyncio queue. A request beyond ``max_batch + max_queue`` outstanding
ones gets 429. Any refusal is OpenAI's error body; an unexpected exception is a 500 with that body too.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
import weakref
from typing import AsyncIterator, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from . import protocol as P
from .config import ServeConfig, strategy_problem
from .engine import BatchKey, Engine, ModelSet, Output, ProcessEngine, Submission
from .metrics import CONTENT_TYPE_LATEST, ServerMetrics

__all__ = ["create_app", "Service"]

log = logging.getLogger("taps.serve")

#: the largest request body read (a prompt beyond the model's context is refused after tokenizing)
MAX_BODY_BYTES = 16 * 2 ** 20
#: the context assumed for a target whose config states none
DEFAULT_CONTEXT = 4096
#: how often a handler that is not streaming checks whether its client is still there
DISCONNECT_POLL_S = 0.25


class _Mailbox:
    """Outputs from the engine thread to one event loop's request queues, delivered in one wake-up of the
    loop for all that arrive before it runs (a step's outputs for every request of the batch): waking the
    loop writes to its self-pipe (about 20 us a call, in the engine thread) and runs a loop iteration."""

    _of_loop: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.items: list = []
        self.lock = threading.Lock()

    @classmethod
    def of(cls, loop: asyncio.AbstractEventLoop) -> "_Mailbox":
        box = cls._of_loop.get(loop)
        if box is None:
            box = cls._of_loop[loop] = cls(loop)
        return box

    def post(self, queue: "asyncio.Queue", out: Output) -> None:  # the engine thread (or ProcessEngine's reader)
        with self.lock:
            self.items.append((queue, out))
            wake = len(self.items) == 1  # else a wake-up is on its way and will take this one too
        if wake:
            try:
                self.loop.call_soon_threadsafe(self._deliver)
            except RuntimeError:  # the loop is closed: the server is gone
                with self.lock:
                    self.items.clear()

    def _deliver(self) -> None:  # the loop
        with self.lock:
            items, self.items = self.items, []
        for queue, out in items:
            queue.put_nowait(out)


class _Handle:
    """One request's link to the engine: the queue its outputs arrive in (from the engine thread)."""

    def __init__(self, service: "Service", rid: str):
        self.service, self.rid = service, rid
        self.mailbox = _Mailbox.of(asyncio.get_running_loop())
        self.queue: "asyncio.Queue[Output]" = asyncio.Queue()
        self.finished = False
        self.checked = time.monotonic()  # when the connection was last checked

    def send(self, out: Output) -> None:  # engine thread
        self.mailbox.post(self.queue, out)

    async def next(self) -> Output:
        out = await self.queue.get()
        if out.error is not None or out.finish_reason is not None:
            self._release()
        return out

    async def next_while_connected(self, request: Request) -> Optional[Output]:
        """The next output, or None when the client has left (the request is then cancelled). Checks the
        connection every DISCONNECT_POLL_S, however often outputs arrive."""
        while True:
            wait = DISCONNECT_POLL_S - (time.monotonic() - self.checked)
            if wait > 0:
                try:
                    return await asyncio.wait_for(self.next(), wait)
                except asyncio.TimeoutError:
                    pass
            self.checked = time.monotonic()
            if await request.is_disconnected():
                self.abandon()
                return None

    def _release(self) -> None:
        if not self.finished:
            self.finished = True
            self.service.outstanding -= 1

    def abandon(self) -> None:
        """The client left (or the stream closed early): cancel at the engine."""
        if not self.finished:
            self._release()
            self.service.engine.cancel(self.rid)


class Service:
    """What the routes share: the models, settings, engine and metrics."""

    def __init__(self, models: ModelSet, config: ServeConfig, metrics: Optional[ServerMetrics] = None,
                 engine: str = "thread"):
        self.models, self.config = models, config
        self.metrics = metrics or ServerMetrics()
        self.engine = (ProcessEngine if engine == "process" else Engine)(models, config, self.metrics)
        self.outstanding = 0
        self.created = int(time.time())

    @property
    def capacity(self) -> int:
        return self.config.max_batch + self.config.max_queue

    def key(self, options: Optional[P.TapsOptions], seeded: bool = False) -> BatchKey:
        """The decoder a request's ``taps`` options ask for; APIError 400 for a strategy or drafters that
        do not exist or do not go together. A `seeded` request (a seed, temperature > 0) decodes with
        the fixed tree settings: a tuner's choices follow measured timings, and the tree shapes decide
        which coins of the request's generator each step draws, so the seed would not reproduce its answer."""
        from ..strategies import strategy_class, strategy_names

        cfg = self.config
        strategy = options.strategy if options is not None and options.strategy is not None else cfg.strategy
        if strategy not in strategy_names():
            raise P.APIError(400, f"taps.strategy: unknown strategy {strategy!r}; choose one of "
                                  f"{', '.join(strategy_names())}", "taps.strategy")
        asked = options.drafters if options is not None else None
        if asked == "auto":
            names, auto = list(cfg.drafters), True
        elif asked is None:
            names, auto = cfg.request_drafters(), cfg.budget == "auto"
        else:
            unknown = [n for n in asked if n not in self.models.drafters]
            if unknown:
                raise P.APIError(400, f"taps.drafters: unknown drafter {unknown[0]!r}; this server has "
                                      f"{', '.join(self.models.drafters) or 'none'}", "taps.drafters")
            if len(set(asked)) != len(asked):
                raise P.APIError(400, "taps.drafters: a drafter is named twice", "taps.drafters")
            names, auto = list(asked), cfg.budget == "auto"
        if strategy_class(strategy).max_drafters == 0:
            if asked and asked != "auto":
                raise P.APIError(400, f"taps.drafters: strategy {strategy!r} uses no drafter", "taps.drafters")
            names, auto = [], False
        problem = strategy_problem(strategy, names)
        if problem:
            raise P.APIError(400, f"taps: {problem} (drafters {', '.join(names) or 'none'})", "taps.drafters")
        return BatchKey(strategy, tuple(names), auto and bool(names) and not seeded)

    def max_tokens(self, asked: Optional[int], prompt_tokens: int, param: str, what: str) -> int:
        """The request's max_tokens checked against the server's limit and the model's context."""
        cfg, context = self.config, self.models.context_length or DEFAULT_CONTEXT
        if asked is not None and asked < 1:
            raise P.APIError(400, f"{param} must be >= 1, got {asked}", param)
        if asked is not None and cfg.max_tokens is not None and asked > cfg.max_tokens:
            raise P.APIError(400, f"{param} is too large: {asked}; this server allows at most {cfg.max_tokens}",
                             param)
        room = context - prompt_tokens
        if room < 1 or (asked is not None and asked > room):
            total = prompt_tokens + (asked if asked is not None else 1)
            raise P.APIError(400, f"This model's maximum context length is {context} tokens. However, you "
                                  f"requested {total} tokens ({prompt_tokens} in the {what}, {total - prompt_tokens} "
                                  f"in the completion). Please reduce the length of the {what} or completion.",
                             what, "context_length_exceeded")
        if asked is not None:
            return asked
        return min(x for x in (cfg.default_max_tokens, cfg.max_tokens, room) if x is not None)

    def submit(self, prompt_ids, sampling: dict, max_tokens: int, key: BatchKey) -> _Handle:
        """Hand a checked request to the engine; APIError 429 when the server is full."""
        from ..batching import SamplingParams

        if not self.engine.alive:
            raise P.APIError(503, "the decoding engine is not running", None, None, "server_error")
        if self.outstanding >= self.capacity:
            raise P.APIError(429, f"the server is busy: {self.outstanding} requests are running or queued "
                                  f"(at most {self.capacity}); retry later", None, "rate_limit_exceeded",
                             "rate_limit_error")
        rid = uuid.uuid4().hex
        handle = _Handle(self, rid)
        params = SamplingParams(max_new_tokens=max_tokens, temperature=sampling["temperature"],
                                top_k=sampling["top_k"], top_p=sampling["top_p"], seed=sampling["seed"],
                                eos_token_id=list(self.models.eos_token_ids))
        self.outstanding += 1
        self.engine.submit(Submission(rid, key, list(prompt_ids), params, sampling["stop"],
                                      time.perf_counter() + self.config.timeout, handle.send))
        return handle


def _error_response(e: P.APIError) -> JSONResponse:
    headers = {"Retry-After": "1"} if e.status == 429 else None
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _engine_error(error) -> P.APIError:
    """The APIError of an engine's (status, message, code)."""
    status, message, code = error
    kind = "server_error" if status >= 500 else "timeout_error" if status == 408 else "invalid_request_error"
    return P.APIError(status, message, None, code, kind)


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _json_body(request: Request):
    body = await request.body()
    if len(body) > MAX_BODY_BYTES:
        raise P.APIError(413, f"the request body is larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(body)
    except (ValueError, RecursionError) as e:
        raise P.APIError(400, f"the request body is not valid JSON ({e})") from None


def create_app(models: ModelSet, config: ServeConfig, metrics: Optional[ServerMetrics] = None,
               engine: str = "thread") -> FastAPI:
    """The server's FastAPI app over loaded `models`; its lifespan starts and stops the engine.
    `engine`: "thread" (:class:`Engine` over `models`) or "process" (:class:`ProcessEngine`: a child process
    that loads the models of `config`; `models` here serve the tokenizer and the model's facts, as
    :func:`~taps.serve.engine.load_models` with ``weights=False`` loads them)."""
    service = Service(models, config, metrics, engine)

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        service.engine.start()
        try:
            yield
        finally:
            service.engine.stop()

    app = FastAPI(title="taps serve", version="0.1.0", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.service = service
    counted = ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/metrics")

    def count(request: Request, status: int) -> None:
        path = request.url.path
        service.metrics.requests.labels(path if path in counted else "other", str(status)).inc()

    @app.exception_handler(P.APIError)
    async def api_error(request: Request, e: P.APIError):
        count(request, e.status)
        return _error_response(e)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        count(request, e.status_code)
        kind = "not_found" if e.status_code == 404 else None
        return _error_response(P.APIError(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                                          None, kind))

    @app.exception_handler(Exception)
    async def internal_error(request: Request, e: Exception):
        log.exception("taps serve: an internal error on %s", request.url.path)
        count(request, 500)
        return _error_response(P.APIError(500, "internal server error", None, None, "server_error"))

    @app.get("/health")
    async def health(request: Request):
        engine = service.engine
        ok = engine.alive and engine.failed is None
        body = {"status": "ok" if ok else "error", "model": models.name, "running": engine.num_running,
                "waiting": engine.num_waiting, "outstanding": service.outstanding}
        count(request, 200 if ok else 503)
        return JSONResponse(body, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_route(request: Request):
        count(request, 200)
        return Response(service.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        import torch

        from ..strategies import strategy_names

        return {"id": models.name, "object": "model", "created": service.created, "owned_by": "taps",
                "taps": {"drafters": {n: s.describe() for n, s in config.drafters.items()},
                         "default_drafters": config.request_drafters(), "default_strategy": config.strategy,
                         "strategies": list(strategy_names()), "budget": config.budget,
                         "context_length": models.context_length, "dtype": models.dtype, "device": models.device,
                         "threads": torch.get_num_threads(), "engine": engine}}

    @app.get("/v1/models")
    async def list_models(request: Request):
        count(request, 200)
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str, request: Request):
        check_model(model)
        count(request, 200)
        return model_card()

    def check_model(model: Optional[str]) -> None:
        if model is not None and model != models.name:
            raise P.APIError(404, f"The model `{model}` does not exist (this server serves {models.name})",
                             "model", "model_not_found")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        req = P.parse_request(P.ChatCompletionRequest, await _json_body(request))
        check_model(req.model)
        messages = P.chat_messages(req)
        try:
            prompt = models.encode_chat(messages)
        except ValueError as e:
            raise P.APIError(400, f"messages: {e}", "messages") from None
        asked = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        return await generate(request, req, prompt, service.max_tokens(asked, len(prompt), param, "messages"), True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        req = P.parse_request(P.CompletionRequest, await _json_body(request))
        check_model(req.model)
        prompt = P.completion_prompt(req, models.vocab_size)
        if isinstance(prompt, str):
            prompt = models.encode_text(prompt)
        if not prompt:
            raise P.APIError(400, "the prompt is empty", "prompt")
        return await generate(request, req, prompt, service.max_tokens(req.max_tokens, len(prompt), "max_tokens",
                                                                        "prompt"), False)

    async def generate(request: Request, req, prompt, max_tokens: int, chat: bool):
        """Submit a checked request; the response starts once the engine sends its first output (its first
        token, or an error: a request the decoder refuses gets its 4xx even when streamed)."""
        sampling = P.check_sampling(req, models.vocab_size)
        key = service.key(req.taps, seeded=sampling["seed"] is not None and sampling["temperature"] > 0)
        handle = service.submit(prompt, sampling, max_tokens, key)
        rid = ("chatcmpl-" if chat else "cmpl-") + handle.rid
        created = int(time.time())
        out = await handle.next_while_connected(request)
        parts = []
        while out is not None:
            if out.error is not None:
                raise _engine_error(out.error)
            if req.stream:
                count(request, 200)
                usage_wanted = bool(req.stream_options and req.stream_options.include_usage)
                return StreamingResponse(stream(handle, out, rid, created, len(prompt), chat, usage_wanted),
                                         media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            parts.append(out.text)
            if out.finish_reason is not None:
                count(request, 200)
                build = P.chat_response if chat else P.completion_response
                return build(rid, created, models.name, "".join(parts), out.finish_reason,
                             P.usage(len(prompt), out.completion_tokens), out.taps)
            out = await handle.next_while_connected(request)
        count(request, 499)  # the client left
        return Response(status_code=499)

    async def stream(handle: _Handle, out: Output, rid: str, created: int, prompt_tokens: int, chat: bool,
                     usage_wanted: bool) -> AsyncIterator[str]:
        """Server-sent events from the first output `out` on (a client that leaves cancels the task)."""
        chunk = P.chat_chunk if chat else P.completion_chunk
        extra = {"usage": None} if usage_wanted else {}
        try:
            if chat:
                yield _sse(chunk(rid, created, models.name, {"role": "assistant", "content": ""}, **extra))
            while True:
                if out.error is not None:
                    yield _sse(_engine_error(out.error).body())
                    break
                if out.text:
                    yield _sse(chunk(rid, created, models.name, {"content": out.text} if chat else out.text, **extra))
                if out.finish_reason is not None:
                    # the finish reason with the taps block; then the usage chunk
                    yield _sse(chunk(rid, created, models.name, {} if chat else "", out.finish_reason, taps=out.taps,
                                     **extra))
                    if usage_wanted:
                        yield _sse(chunk(rid, created, models.name, None,
                                         usage=P.usage(prompt_tokens, out.completion_tokens), taps=out.taps))
                    break
                out = await handle.next()
            yield "data: [DONE]\n\n"
        finally:
            handle.abandon()

    return app
