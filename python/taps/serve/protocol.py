"""The OpenAI API subset the server speaks: request models (pydantic), their checks, the response bodies.

Requests are parsed leniently where OpenAI is (fields it does not know are ignored) and strictly in
type (``"5"`` is not an integer). Every refusal is an :class:`APIError`, answered with OpenAI's error body
``{"error": {"message", "type", "param", "code"}}``. A field the server cannot honour and that would change
the answer (``n`` > 1, logprobs, tools, penalties, ``echo``, ...) is refused rather than ignored.

The ``taps`` extra of a request: ``{"strategy": <a taps strategy>, "drafters": [<drafter names>] or
"auto"}``; every response carries a ``taps`` block (see :meth:`taps.serve.engine.Engine.report`).
"""

from __future__ import annotations

import math
from typing import Any, Dict, List, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["APIError", "ChatCompletionRequest", "CompletionRequest", "TapsOptions", "parse_request",
           "chat_messages", "completion_prompt", "check_sampling", "usage", "chat_response", "chat_chunk",
           "completion_response", "completion_chunk"]

#: the seeds a request may give (those a torch.Generator takes)
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)
MAX_STOP = 4


class APIError(Exception):
    """A refused request: HTTP `status` and OpenAI's error body."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 type: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Model(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class StreamOptions(_Model):
    include_usage: Optional[bool] = None


class TapsOptions(_Model):
    """The ``taps`` extra: a strategy and the drafters by name (or ``"auto"``)."""

    strategy: Optional[str] = None
    drafters: Union[Literal["auto"], List[str], None] = None


class ContentPart(_Model):
    type: str
    text: Optional[str] = None


class ChatMessage(_Model):
    role: str
    content: Union[str, List[ContentPart], None] = None


class _Request(_Model):
    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: Union[str, List[str], None] = None
    n: Optional[int] = None
    stream: Optional[bool] = None
    stream_options: Optional[StreamOptions] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[Dict[str, Any]] = None
    taps: Optional[TapsOptions] = None


class ChatCompletionRequest(_Request):
    messages: List[ChatMessage]
    max_completion_tokens: Optional[int] = None
    logprobs: Optional[bool] = None
    top_logprobs: Optional[int] = None
    tools: Optional[List[Any]] = None
    functions: Optional[List[Any]] = None
    response_format: Optional[Dict[str, Any]] = None


class CompletionRequest(_Request):
    prompt: Union[str, List[int], List[str], List[List[int]]]
    echo: Optional[bool] = None
    logprobs: Optional[int] = None
    best_of: Optional[int] = None
    suffix: Optional[str] = None


def _param(loc, body, missing: bool) -> Optional[str]:
    """The dotted name (``messages[0].content``) of a pydantic error location in `body`: the union
    branch names pydantic adds are left out; a missing field is named last."""
    parts: List[str] = []
    node = body
    for k, item in enumerate(loc):
        if isinstance(item, int) and isinstance(node, list) and 0 <= item < len(node) and parts:
            parts[-1] += f"[{item}]"
            node = node[item]
        elif isinstance(item, str) and isinstance(node, dict) and item in node:
            parts.append(item)
            node = node[item]
        elif missing and k == len(loc) - 1 and isinstance(item, str):
            parts.append(item)
    return ".".join(parts) or None


def parse_request(model, body: Any):
    """`body` (parsed JSON) as the request model `model`; APIError 400 naming the first bad field."""
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    try:
        return model.model_validate(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        param = _param(first["loc"], body, first["type"] == "missing")
        message = first["msg"]
        raise APIError(400, f"{param}: {message}" if param else message, param) from None


def _refuse_unsupported(req) -> None:
    """APIError 400 for options the server cannot honour (ignoring them would change the answer)."""
    if req.n is not None and req.n != 1:
        raise APIError(400, f"n must be 1 (this server returns one choice per request), got {req.n}", "n")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is not None and value != 0:
            raise APIError(400, f"{name} is not supported (only 0)", name)
    if req.logit_bias:
        raise APIError(400, "logit_bias is not supported", "logit_bias")
    if req.stream_options is not None and not req.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", "stream_options")
    if isinstance(req, ChatCompletionRequest):
        if req.logprobs or req.top_logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if req.tools or req.functions:
            raise APIError(400, "tools and functions are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise APIError(400, "response_format: only type 'text' is supported", "response_format")
    else:
        if req.echo:
            raise APIError(400, "echo is not supported", "echo")
        if req.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if req.best_of is not None and req.best_of != 1:
            raise APIError(400, f"best_of must be 1, got {req.best_of}", "best_of")
        if req.suffix:
            raise APIError(400, "suffix is not supported", "suffix")


def chat_messages(req: ChatCompletionRequest) -> List[dict]:
    """The conversation as ``{"role", "content"}`` dicts of strings (text parts joined; ``developer``
    read as ``system``)."""
    _refuse_unsupported(req)
    if not req.messages:
        raise APIError(400, "messages must hold at least one message", "messages")
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.type != "text" or part.text is None:
                    raise APIError(400, f"messages[{i}].content[{j}]: only text parts are supported, got type "
                                        f"{part.type!r}", f"messages[{i}].content")
                texts.append(part.text)
            content = "".join(texts)
        if content is None:
            raise APIError(400, f"messages[{i}]: content is required", f"messages[{i}].content")
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


def completion_prompt(req: CompletionRequest, vocab_size: int):
    """The prompt: a string, or token ids checked against the vocabulary. One prompt per request."""
    _refuse_unsupported(req)
    prompt = req.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        if len(prompt) != 1:
            raise APIError(400, f"one prompt per request (this server returns one choice), got {len(prompt)}",
                           "prompt")
        prompt = prompt[0]
    if isinstance(prompt, list):
        if not prompt:
            raise APIError(400, "the prompt is empty", "prompt")
        bad = [t for t in prompt if not 0 <= t < vocab_size]
        if bad:
            raise APIError(400, f"prompt token ids must be in [0, {vocab_size}), got {bad[0]}", "prompt")
    return prompt


def check_sampling(req, vocab_size: int) -> Dict[str, Any]:
    """temperature, top_p, top_k, seed and stop strings of a request, checked (OpenAI's ranges; defaults
    as OpenAI's: temperature 1, top_p 1; top_k 0 or -1: off, as is one of at least the vocabulary)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    if not math.isfinite(temperature) or not 0.0 <= temperature <= 2.0:
        raise APIError(400, f"temperature must be in [0, 2], got {temperature}", "temperature")
    top_p = 1.0 if req.top_p is None else req.top_p
    if not math.isfinite(top_p) or not 0.0 < top_p <= 1.0:
        raise APIError(400, f"top_p must be in (0, 1], got {top_p}", "top_p")
    top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
    if top_k < 0:
        raise APIError(400, f"top_k must be >= 0 (0 or -1: off), got {top_k}", "top_k")
    if top_k >= vocab_size:
        top_k = 0
    if req.seed is not None and not SEED_RANGE[0] <= req.seed <= SEED_RANGE[1]:
        raise APIError(400, f"seed must be in [{SEED_RANGE[0]}, {SEED_RANGE[1]}], got {req.seed}", "seed")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise APIError(400, f"stop: at most {MAX_STOP} stop strings, got {len(stop)}", "stop")
    if any(not s for s in stop):
        raise APIError(400, "stop strings must not be empty", "stop")
    return dict(temperature=float(temperature), top_p=float(top_p), top_k=int(top_k), seed=req.seed, stop=stop)


# ---------------------------------------------------------------------------------------------------
# responses

def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def chat_response(rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
                  taps: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": finish_reason}],
            "usage": usage_, "taps": taps}


def chat_chunk(rid: str, created: int, model: str, delta: Optional[dict], finish_reason: Optional[str] = None,
               **extra) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}]
    return {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": choices,
            **extra}


def completion_response(rid: str, created: int, model: str, text: str, finish_reason: str, usage_: dict,
                        taps: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}],
            "usage": usage_, "taps": taps}


def completion_chunk(rid: str, created: int, model: str, text: Optional[str], finish_reason: Optional[str] = None,
                     **extra) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}]
    return {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": choices, **extra}
