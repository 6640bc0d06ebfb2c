"""The server's Prometheus metrics (``GET /metrics``), in a registry of each server's own.

    taps_requests_total{endpoint, status}        HTTP requests answered, by route and status code (499:
                                                 the client left first)
    taps_finished_requests_total{reason}         generations ended: stop, length, timeout, error
    taps_prompt_tokens_total                     prompt tokens of finished generations
    taps_completion_tokens_total                 tokens generated for finished generations
    taps_generation_tokens_per_second            tokens committed per second over the last 10 s of steps
    taps_request_tau{strategy}                   tau (tokens per target forward) of each finished request
    taps_target_forwards_total{strategy}         verification forwards of finished requests
    taps_accepted_draft_tokens_total{strategy}   draft tokens the target accepted
    taps_drafter_accepted_tokens_total{drafter}  accepted draft tokens each drafter had proposed (a token
                                                 proposed by several counts for each)
    taps_queue_depth                             requests waiting for a place in the running batch
    taps_running_requests                        requests in the running batches
    taps_step_seconds                            one decoding step of one batch
    taps_time_to_first_token_seconds             arrival to the first generated token
    taps_request_seconds                         arrival to the last token
"""

from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

__all__ = ["ServerMetrics", "CONTENT_TYPE_LATEST"]

_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class ServerMetrics:
    """The metrics above, registered in `registry` (default: a new one)."""

    def __init__(self, registry: Optional[CollectorRegistry] = None):
        self.registry = r = registry if registry is not None else CollectorRegistry()
        self.requests = Counter("taps_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.finished = Counter("taps_finished_requests", "Generations ended, by reason", ["reason"], registry=r)
        self.prompt_tokens = Counter("taps_prompt_tokens", "Prompt tokens of finished generations", registry=r)
        self.completion_tokens = Counter("taps_completion_tokens", "Tokens generated for finished generations",
                                         registry=r)
        self.tokens_per_second = Gauge("taps_generation_tokens_per_second",
                                       "Tokens committed per second over the last 10 s of steps", registry=r)
        self.tau = Histogram("taps_request_tau", "Tokens per target forward of each finished request", ["strategy"],
                             buckets=(1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 8.0), registry=r)
        self.target_forwards = Counter("taps_target_forwards", "Verification forwards of finished requests",
                                       ["strategy"], registry=r)
        self.accepted = Counter("taps_accepted_draft_tokens", "Draft tokens the target accepted", ["strategy"],
                                registry=r)
        self.drafter_accepted = Counter("taps_drafter_accepted_tokens",
                                        "Accepted draft tokens each drafter had proposed", ["drafter"], registry=r)
        self.queue_depth = Gauge("taps_queue_depth", "Requests waiting for a place in the running batch", registry=r)
        self.running = Gauge("taps_running_requests", "Requests in the running batches", registry=r)
        self.step_seconds = Histogram("taps_step_seconds", "One decoding step of one batch",
                                      buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5),
                                      registry=r)
        self.time_to_first_token = Histogram("taps_time_to_first_token_seconds", "Arrival to the first token",
                                             buckets=_SECONDS, registry=r)
        self.request_seconds = Histogram("taps_request_seconds", "Arrival to the last token", buckets=_SECONDS,
                                         registry=r)

    def request_done(self, prompt_tokens: int, completion_tokens: int, reason: str, stats, seconds: float,
                     report: dict) -> None:
        """A generation that ended with `reason` (``stop`` / ``length``); `report` is its ``taps`` block."""
        strategy = report["strategy"]
        self.finished.labels(reason).inc()
        self.prompt_tokens.inc(prompt_tokens)
        self.completion_tokens.inc(completion_tokens)
        self.request_seconds.observe(seconds)
        if stats.target_forwards:
            self.tau.labels(strategy).observe(stats.tau)
            self.target_forwards.labels(strategy).inc(stats.target_forwards)
            self.accepted.labels(strategy).inc(sum(stats.accepted))
        for name, count in zip(report["drafter_share"], stats.drafter_accepted):
            self.drafter_accepted.labels(name).inc(count)

    def render(self) -> bytes:
        return generate_latest(self.registry)
