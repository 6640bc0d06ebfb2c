"""Load test of ``taps serve``: a bounded mixed load, then the same load with ``strategy="autoregressive"``.

    PYTHONPATH=python python bench/bench_serve.py --threads 1                    # a server in this process
    PYTHONPATH=python python bench/bench_serve.py --url http://127.0.0.1:8000    # a running server

``--requests`` streamed chat requests (default 64), ``--concurrency`` at a time (default 8): GSM8K test and
MT-Bench prompts in turn (``data/``), temperatures cycling through ``--temperatures`` (``--seeds``: each
with a seed of its own; a seeded request at a temperature decodes with fixed tree settings, in a batch
apart from the tuner's); every ``--cancel-every``-th request is cancelled after its first ``--cancel-after`` text chunks (the
client closes the stream). The load runs on the same server with the server's default strategy and
drafters (or ``--strategy`` / ``--drafters``) and with ``taps.strategy = "autoregressive"`` (the target
alone, through the same server and batching), after a short warm-up of each, ``--rounds`` times each in
alternation (the order swapped every round: a load of 64 requests lasts a second or two, and a single
pass in a fixed order carried the machine's drift and the second load's warmer caches into the ratio).

Checked, else exit status 1: no request lost (each one finished with ``stop`` / ``length`` and ``[DONE]``,
or was cancelled by the client), no error, and no leaked batch rows (the server's running and waiting
counts, ``GET /health``, back to 0 after each load). Printed: throughput (completion tokens of finished
requests per second of the load's wall time), p50 / p99 latency and time to first token of the
finished requests, mean tau, and the ratios of the speculative load to the autoregressive one (each load's
row: its median round; the ratio row: the median of the rounds' ratios, with every round's throughput ratio
listed); with the CPU (``taps_ops.cpu_info()["summary"]``) and the server's torch threads.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import List, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import print_table  # noqa: E402


@dataclass
class Result:
    cancel: bool
    ok: bool = False
    cancelled: bool = False
    error: Optional[str] = None
    finish_reason: Optional[str] = None
    completion_tokens: int = 0
    latency: float = 0.0
    ttft: Optional[float] = None
    tau: Optional[float] = None
    chunks: int = 0


@dataclass
class Load:
    prompts: List[str]
    temperatures: List[float]
    max_tokens: int
    cancel_every: int
    cancel_after: int
    seed: Optional[int]
    taps: dict = field(default_factory=dict)


def load_prompts(count: int) -> List[str]:
    """`count` user prompts, GSM8K test and MT-Bench first turns in turn."""
    from taps.data import load_eval_prompts

    math, chat = load_eval_prompts("gsm8k"), load_eval_prompts("mt_bench")
    out = []
    for i in range(count):
        source = math if i % 2 == 0 else chat
        out.append(source[(i // 2) % len(source)].messages[-1]["content"])
    return out


async def one_request(client, model: str, load: Load, i: int) -> Result:
    import httpx

    res = Result(cancel=load.cancel_every > 0 and i % load.cancel_every == load.cancel_every - 1)
    body = {"model": model, "messages": [{"role": "user", "content": load.prompts[i]}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": load.max_tokens,
            "temperature": load.temperatures[i % len(load.temperatures)]}
    if load.seed is not None:
        body["seed"] = load.seed + i
    if load.taps:
        body["taps"] = load.taps
    start = time.perf_counter()
    done = False
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                res.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return res
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    done = True
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    res.error = chunk["error"].get("message")
                    return res
                for choice in chunk.get("choices", []):
                    if choice["delta"].get("content"):
                        res.chunks += 1
                        if res.ttft is None:
                            res.ttft = time.perf_counter() - start
                    if choice.get("finish_reason"):
                        res.finish_reason = choice["finish_reason"]
                if chunk.get("usage"):
                    res.completion_tokens = chunk["usage"]["completion_tokens"]
                    res.tau = chunk.get("taps", {}).get("tau")
                if res.cancel and res.chunks >= load.cancel_after:
                    res.cancelled = True
                    return res  # leaving the block closes the stream: the server cancels the request
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.latency = time.perf_counter() - start
    res.ok = done and res.finish_reason in ("stop", "length")
    if not res.ok and res.error is None:
        res.error = f"the stream ended without a finish reason and [DONE] (finish_reason {res.finish_reason})"
    return res


async def run_load(url: str, model: str, load: Load, concurrency: int):
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 2)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(600.0), limits=limits) as client:
        async def guarded(i):
            async with gate:
                return await one_request(client, model, load, i)

        start = time.perf_counter()
        results = await asyncio.gather(*(guarded(i) for i in range(len(load.prompts))))
        wall = time.perf_counter() - start
    return results, wall


def wait_idle(url: str, timeout: float = 15.0) -> dict:
    """The server's /health once nothing runs or waits (or after `timeout`)."""
    import httpx

    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(f"{url}/health", timeout=10).json()
        if (health["running"] == 0 and health["waiting"] == 0 and health["outstanding"] == 0) or \
                time.monotonic() > deadline:
            return health
        time.sleep(0.05)


def step_totals(url: str):
    """(seconds, count) of the server's decoding steps so far, from ``GET /metrics`` (``taps_step_seconds``)."""
    import httpx

    text = httpx.get(f"{url}/metrics", timeout=10).text
    values = {}
    for line in text.splitlines():
        for key in ("taps_step_seconds_sum", "taps_step_seconds_count"):
            if line.startswith(key + " "):
                values[key] = float(line.split()[1])
    return values.get("taps_step_seconds_sum", 0.0), values.get("taps_step_seconds_count", 0.0)


def percentile(values: List[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    k = (len(values) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(values) - 1)
    return values[lo] + (values[hi] - values[lo]) * (k - lo)


def summarize(results: List[Result], wall: float) -> dict:
    done = [r for r in results if r.ok]
    taus = [r.tau for r in done if r.tau]
    return dict(finished=len(done), cancelled=sum(r.cancelled for r in results),
                errors=[r.error for r in results if r.error], lost=sum(not (r.ok or r.cancelled or r.error)
                                                                      for r in results),
                tokens=sum(r.completion_tokens for r in done), wall=wall,
                throughput=sum(r.completion_tokens for r in done) / wall if wall > 0 else 0.0,
                p50=percentile([r.latency for r in done], 0.5), p99=percentile([r.latency for r in done], 0.99),
                ttft50=percentile([r.ttft for r in done if r.ttft is not None], 0.5),
                ttft99=percentile([r.ttft for r in done if r.ttft is not None], 0.99),
                tau=statistics.mean(taus) if taus else float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--url", help="a running server (default: start one in this process)")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperatures", default="0,0.7,1", help="comma list, cycled over the requests")
    ap.add_argument("--cancel-every", type=int, default=8, help="cancel every N-th request mid-stream (0: none)")
    ap.add_argument("--cancel-after", type=int, default=3, help="text chunks a cancelled request reads first")
    ap.add_argument("--strategy", help="the speculative load's strategy (default: the server's)")
    ap.add_argument("--drafters", help="the speculative load's drafters, comma list or auto (default: the server's)")
    ap.add_argument("--warmup", type=int, default=16,
                    help="untimed requests of each load first, at the load's concurrency and up to 32 tokens each: "
                         "a server's steady state (on the CPU oneDNN builds a kernel the first time a bf16 product "
                         "meets a shape, 0.4-1.6 ms each; a speculative load meets more shapes than an "
                         "autoregressive one)")
    ap.add_argument("--rounds", type=int, default=3, help="timed passes of each load, alternating (default 3)")
    ap.add_argument("--seeds", action="store_true", help="give request i the seed i")
    ap.add_argument("--threads", type=int, default=0, help="in-process server: torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="auto", help="in-process server: auto, fp32 or bf16")
    ap.add_argument("--config", metavar="FILE",
                    help="in-process server: its settings from a `taps serve --config` file (drafters, strategy, "
                         "budget, ...); --dtype, --threads, --engine and the concurrency as max batch over it")
    ap.add_argument("--engine", choices=("process", "thread"), default="process",
                    help="in-process server: where its decoding loop runs (ServeConfig.engine; default process)")
    args = ap.parse_args(argv)

    import httpx
    import taps_ops
    import torch

    server = None
    url = args.url
    if url is None:
        from taps.serve import BackgroundServer, ServeConfig

        if args.threads:
            torch.set_num_threads(args.threads)
        if args.config:
            from taps.serve.config import add_serve_arguments, config_from_args

            serve_args = argparse.ArgumentParser()
            add_serve_arguments(serve_args)
            config = config_from_args(serve_args.parse_args(["--config", args.config]))
            config.dtype, config.max_batch, config.engine = args.dtype, max(args.concurrency, 1), args.engine
        else:
            config = ServeConfig(dtype=args.dtype, max_batch=max(args.concurrency, 1), engine=args.engine)
        server = BackgroundServer(config).start()
        url = server.url
    try:
        card = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]
        model = card["id"]
        info = card.get("taps", {})
        spec_taps = {}
        if args.strategy:
            spec_taps["strategy"] = args.strategy
        if args.drafters:
            spec_taps["drafters"] = "auto" if args.drafters == "auto" else args.drafters.split(",")
        label = (f"{spec_taps.get('strategy', info.get('default_strategy'))} with "
                 f"{spec_taps.get('drafters', info.get('default_drafters'))}, budget {info.get('budget')}")
        temperatures = [float(t) for t in args.temperatures.split(",")]
        seed = 0 if args.seeds else None
        prompts = load_prompts(args.requests)
        loads = {"taps": Load(prompts, temperatures, args.max_tokens, args.cancel_every, args.cancel_after, seed,
                              spec_taps),
                 "autoregressive": Load(prompts, temperatures, args.max_tokens, args.cancel_every, args.cancel_after,
                                        seed, {"strategy": "autoregressive"})}
        print(f"bench_serve: {url} serving {model} ({info.get('dtype')}, {info.get('device')}, "
              f"{info.get('threads')} torch thread(s){'' if server is None else ', engine: ' + server.engine}); "
              f"CPU: {taps_ops.cpu_info()['summary']}")
        print(f"load: {args.requests} streamed chat requests (GSM8K and MT-Bench in turn), {args.concurrency} at a "
              f"time, max_tokens {args.max_tokens}, temperatures {args.temperatures}, every "
              f"{args.cancel_every or 'no'}-th cancelled after {args.cancel_after} chunks, "
              f"{'seeded' if args.seeds else 'no seeds'}; taps: {label}")
        failures = []
        for name, load in loads.items():
            if args.warmup:
                warm = Load(prompts[:args.warmup], temperatures, min(args.max_tokens, 32), 0, 0, seed, load.taps)
                asyncio.run(run_load(url, model, warm, args.concurrency))
                wait_idle(url)
        passes = {name: [] for name in loads}
        for r in range(max(args.rounds, 1)):
            for name in (list(loads) if r % 2 == 0 else list(loads)[::-1]):
                before = step_totals(url)
                results, wall = asyncio.run(run_load(url, model, loads[name], args.concurrency))
                health = wait_idle(url)
                after = step_totals(url)
                s = summarize(results, wall)
                s["steps"] = after[1] - before[1]
                s["step_ms"] = 1e3 * (after[0] - before[0]) / max(s["steps"], 1)
                s["busy"] = (after[0] - before[0]) / wall if wall > 0 else 0.0
                passes[name].append(s)
                if s["errors"]:
                    failures.append(f"{name}: {len(s['errors'])} error(s), first: {s['errors'][0]}")
                if s["lost"]:
                    failures.append(f"{name}: {s['lost']} request(s) lost")
                if health["running"] or health["waiting"] or health["outstanding"]:
                    failures.append(f"{name}: batch rows leaked: {health}")
        # each load's median pass by throughput; the ratios: the median over the rounds
        summaries = {name: sorted(ps, key=lambda s: s["throughput"])[len(ps) // 2] for name, ps in passes.items()}
        rows = []
        for name, s in summaries.items():
            rows.append([name, f"{s['finished']}/{s['cancelled']}", s["tokens"], f"{s['wall']:.2f}",
                         f"{s['throughput']:.1f}", f"{s['p50']:.3f}", f"{s['p99']:.3f}", f"{s['ttft50']:.3f}",
                         f"{s['ttft99']:.3f}", f"{s['tau']:.2f}", int(s["steps"]), f"{s['step_ms']:.2f}",
                         f"{100 * s['busy']:.0f}%"])
        def ratio(key):
            values = [x[key] / y[key] for x, y in zip(passes["taps"], passes["autoregressive"]) if y[key]]
            return f"{statistics.median(values):.2f}x" if values else "-"

        rows.append(["taps / AR", "", "", "", ratio("throughput"), ratio("p50"), ratio("p99"), ratio("ttft50"),
                     ratio("ttft99"), "", ratio("steps"), ratio("step_ms"), ""])
        print_table(["load", "done/cancelled", "tokens", "wall s", "tokens/s", "p50 s", "p99 s", "TTFT p50 s",
                     "TTFT p99 s", "tau", "steps", "step ms", "busy"], rows,
                    title=f"taps serve under load (latency and TTFT of finished requests; each load's median of "
                          f"{len(passes['taps'])} pass(es), the ratios' median over the rounds)")
        print("throughput taps / AR by round: " + ", ".join(
            f"{x['throughput'] / y['throughput']:.3f}" for x, y in zip(passes["taps"], passes["autoregressive"])))
        if failures:
            print("bench_serve: FAILED: " + "; ".join(failures), file=sys.stderr)
            return 1
        print("bench_serve: every request finished or was cancelled cleanly, no error, no leaked batch rows")
        return 0
    finally:
        if server is not None:
            server.stop()


if __name__ == "__main__":
    sys.exit(main())
