"""Running the server: in the foreground for ``taps serve``, or in a thread of this process.

    serve(config)                                    # load the models, listen until interrupted

    with BackgroundServer() as server:               # the same server on a free port, in a thread (its
                                                     # decoding loop in a process of its own)
        server.url                                   # http://127.0.0.1:<port>
"""

from __future__ import annotations

import importlib.util
import socket
import threading
import time
from typing import Optional

from .config import ServeConfig
from .engine import ModelSet, load_models

__all__ = ["serve", "BackgroundServer", "check_dependencies", "engine_kind"]

_NEEDED = {"fastapi": "fastapi", "uvicorn": "uvicorn", "prometheus_client": "prometheus-client"}


def check_dependencies() -> None:
    """ValueError naming the missing packages of the ``serve`` extra."""
    missing = [pip for module, pip in _NEEDED.items() if importlib.util.find_spec(module) is None]
    if missing:
        raise ValueError(f"serving needs {', '.join(missing)}: pip install 'taps[serve]' (or pip install "
                         f"{' '.join(missing)})")


def _summary(models: ModelSet, config: ServeConfig) -> str:
    import torch

    drafters = ", ".join(f"{n} ({s.describe()})" for n, s in config.drafters.items()) or "none"
    return (f"taps serve: model {models.name} ({models.dtype}, {models.device}, {torch.get_num_threads()} thread(s), "
            f"context {models.context_length}); drafters: {drafters}; default strategy {config.strategy} with "
            f"{', '.join(config.request_drafters()) or 'no drafter'}, budget {config.budget}; max batch "
            f"{config.max_batch}, queue {config.max_queue}, timeout {config.timeout:g} s")


def engine_kind(config: ServeConfig, models_given: bool) -> str:
    """Where `config`'s decoding loop runs ("process" or "thread"): ``config.engine``, "auto" being a
    process unless the caller passed loaded models (which a child process cannot share). ValueError for
    "process" with loaded models."""
    if config.engine == "auto":
        return "thread" if models_given else "process"
    if config.engine == "process" and models_given:
        raise ValueError("engine 'process': the engine's process loads the models of the config itself; pass "
                         "no loaded models (or use engine 'thread')")
    return config.engine


def serve(config: ServeConfig) -> int:
    """Load the models of `config` and serve them on ``config.host:config.port`` until interrupted."""
    import torch
    import uvicorn

    from .app import create_app

    check_dependencies()
    if config.threads:
        torch.set_num_threads(config.threads)
    engine = engine_kind(config, models_given=False)
    # with the process engine this process runs no model: the tokenizer and the target's facts only
    models = load_models(config, weights=engine != "process")
    print(_summary(models, config) + f"; engine: {engine}", flush=True)
    uvicorn.run(create_app(models, config, engine=engine), host=config.host, port=config.port,
                log_level=config.log_level, timeout_graceful_shutdown=5)
    return 0


class BackgroundServer:
    """The server in a thread of this process, on `port` (0: a free one), until :meth:`stop` or the end
    of a ``with`` block; its decoding loop in a process of its own unless `models` are given or
    ``config.engine`` is "thread" (:func:`engine_kind`).

    Args:
        config: the settings (default: ``ServeConfig()``, the shipped models as ``taps serve`` serves them).
        models: models already loaded (default: :func:`taps.serve.engine.load_models` of `config`);
            servers of several configs may share one set.
    """

    def __init__(self, config: Optional[ServeConfig] = None, models: Optional[ModelSet] = None,
                 host: str = "127.0.0.1", port: int = 0, log_level: str = "warning"):
        import uvicorn

        from .app import create_app

        check_dependencies()
        self.config = config = (config if config is not None else ServeConfig()).check()
        self.engine = engine_kind(config, models_given=models is not None)
        # with the process engine this process runs no model: the tokenizer and the target's facts only (the
        # engine's process loads the weights; engine_kind refuses it with models passed in)
        self.models = models if models is not None else load_models(config, weights=self.engine != "process")
        self.app = create_app(self.models, config, engine=self.engine)
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind((host, port))
        self.host, self.port = host, self._socket.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level=log_level, timeout_graceful_shutdown=2))
        self._thread: Optional[threading.Thread] = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def service(self):
        """The app's :class:`taps.serve.app.Service` (its engine, metrics and counts)."""
        return self.app.state.service

    def start(self, timeout: float = 600.0) -> "BackgroundServer":
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]},
                                        name="taps-serve", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the server did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        if self._thread is not None:
            self._server.should_exit = True
            self._thread.join(30)
            self._thread = None
        self._socket.close()

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
