"""``taps serve``: an OpenAI-compatible HTTP server (FastAPI + uvicorn) over taps' speculative decoding.

The shipped models by default (the target, the HASS math and chat drafters, prompt lookup and the shipped
n-gram table, named ``math``, ``chat``, ``lookup`` and ``table``; a request that names none drafts with ``table``),
or any Hugging Face target with EAGLE / small-LM drafters and prompt
lookup (:mod:`taps.serve.config`). Requests join the running batch between decoding steps and leave
when they finish (:mod:`taps.serve.engine`); each may choose its strategy and drafters with a ``taps``
extra, and every answer reports tau, the drafters' shares and the draft shapes (:mod:`taps.serve.protocol`).

Modules: ``config`` (flags and config file), ``protocol`` (request models, checks, response bodies),
``engine`` (the engine: its loop over the batches, in a thread or a process of its own), ``text`` (incremental detokenizing and stop strings),
``metrics`` (Prometheus), ``app`` (the routes: ``create_app``), ``server`` (``serve``,
:class:`BackgroundServer`). Needs the ``serve`` extra: ``pip install 'taps[serve]'``.
"""

from .config import DrafterSpec, ServeConfig
from .server import BackgroundServer, serve

__all__ = ["BackgroundServer", "DrafterSpec", "ServeConfig", "serve"]
