"""`taps serve` as a client sees it: the official `openai` client (and raw HTTP) against servers started
on 127.0.0.1 in this process (uvicorn in a thread, a free port), over the shipped models in fp32 on one
torch thread, the decoding loop in a thread of this process or in a process of its own (``engine``).

Greedy answers equal `SpeculativeDecoder.generate` of the same prompt ids with the same strategy and
drafters; streaming gives the same text as not streaming; stop strings cut the text; seeds reproduce a
sampled answer whatever else runs; bad requests get OpenAI's error body with a 4xx status (a fuzz of
random JSON bodies never gets a 5xx); a full queue gets 429; a slow request times out; clients that
leave free their batch rows; /health and /metrics answer.
"""

import concurrent.futures
import importlib.util
import json
import sys
import time

import httpx
import openai
import pytest

from taps.data import REPO_ROOT
from taps.models import models_dir
from taps.serve import BackgroundServer, ServeConfig
from taps.serve.engine import load_models

pytestmark = pytest.mark.usefixtures("one_thread")

QUESTION = [{"role": "user", "content": "What is 17 * 23?"}]
ERROR_KEYS = {"message", "type", "param", "code"}


@pytest.fixture(scope="module")
def models():
    return load_models(ServeConfig(dtype="fp32"))


@pytest.fixture(scope="module", params=["thread", "process"])
def server(request, models):
    """A server over the shipped fp32 models, its engine a thread over `models` or a process of its own
    (which loads the same models itself)."""
    if request.param == "thread":
        with BackgroundServer(ServeConfig(dtype="fp32"), models=models) as s:
            yield s
    else:
        with BackgroundServer(ServeConfig(dtype="fp32", engine="process")) as s:
            assert s.engine == "process"
            yield s


@pytest.fixture(scope="module")
def endless_target(tmp_path_factory, models):
    """A random Llama folder whose context (65,536 positions) no test's request runs through: a LONG request
    (60,000 tokens) lasts as long as the test keeps it, however fast the machine decodes."""
    folder = tmp_path_factory.mktemp("endless") / "target"
    _save_hf_target(folder, models, max_positions=1 << 16)
    return folder


def endless(folder, engine="thread", **limits):
    """A server over the `endless_target` folder whose requests never meet an EOS (they run to max_tokens);
    its engine a thread or a process (whose requests take their EOS ids from the server's process: none
    here either)."""
    server = BackgroundServer(ServeConfig(target=str(folder), dtype="fp32", engine=engine, **limits))
    server.models.eos_token_ids = []
    return server


def client_of(server, **kw):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, **kw)


def extra(obj, name):
    """A field the OpenAI client's models do not declare (the taps block)."""
    return (obj.model_extra or {}).get(name)


def wait_health(server, running=0, waiting=0, outstanding=0, timeout=10.0):
    """/health once it shows these counts (fails after `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        health = httpx.get(server.url + "/health").json()
        if (health["running"], health["waiting"], health["outstanding"]) == (running, waiting, outstanding):
            return health
        assert time.monotonic() < deadline, f"expected {running} running, {waiting} waiting: {health}"
        time.sleep(0.02)


def wait_idle(server):
    return wait_health(server)


def reference(models, prompt, strategy, drafters, budget, max_tokens):
    """SpeculativeDecoder.generate's greedy tokens and text for `prompt` (ids)."""
    from taps import SpeculativeDecoder

    dec = SpeculativeDecoder(models.target, [models.drafters[n] for n in drafters], strategy, budget=budget,
                             tokenizer=models.tokenizer)
    tokens = dec.generate([prompt], max_new_tokens=max_tokens, temperature=0.0,
                          eos_token_id=models.eos_token_ids).tokens[0]
    return tokens, models.decode(tokens)


@pytest.mark.parametrize("strategy, drafters", [("merged-budget", None), ("single", ["lookup"]),
                                                ("route-confidence", ["math", "chat"]), ("autoregressive", None)])
def test_greedy_answers_equal_generate(server, models, strategy, drafters):
    client = client_of(server)
    taps = {"strategy": strategy, **({"drafters": drafters} if drafters else {})}
    reply = client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=40, temperature=0,
                                           extra_body={"taps": taps})
    used = [] if strategy == "autoregressive" else drafters or ["table"]  # (the shipped defaults' request drafters)
    tokens, text = reference(models, models.encode_chat(QUESTION), strategy, used, "auto", 40)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == text
    assert choice.finish_reason == ("stop" if tokens[-1] in models.eos_token_ids else "length")
    assert reply.usage.prompt_tokens == len(models.encode_chat(QUESTION))
    assert reply.usage.completion_tokens == len(tokens)
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    block = extra(reply, "taps")
    assert block["strategy"] == strategy and block["drafters"] == used
    assert block["tau"] >= 1.0 and sum(block["draft_shapes"].values()) == block["target_forwards"] > 0
    assert list(block["drafter_share"]) == used and all(0 <= s <= 1 for s in block["drafter_share"].values())

    # the same prompt as token ids through /v1/completions
    plain = client.completions.create(model="taps-mini", prompt=models.encode_chat(QUESTION), max_tokens=40,
                                      temperature=0, extra_body={"taps": taps})
    assert plain.choices[0].text == text and plain.usage.completion_tokens == len(tokens)


def test_a_table_drafter_serves_greedy_and_sampled_requests(tmp_path, models):
    """A server with an n-gram table drafter (config kind "table"): greedy answers equal autoregressive
    decoding's, seeded sampled ones repeat, its drafts are accepted."""
    import dataclasses

    from taps import NgramTable, NgramTableDrafter
    from taps.serve.config import DrafterSpec
    from taps.train.table import build_table

    questions = ["What is 12 plus 30?", "Name three colours.", "What is 5 times 6?", "Write a short poem."]
    prompts = [models.encode_chat([{"role": "user", "content": q}]) for q in questions * 2]
    table = build_table(models.target, prompts, new_tokens=16, seed=3, min_count=1, quiet=True)
    table.save(tmp_path / "t.npz")
    cfg = ServeConfig(dtype="fp32", drafters={"t": DrafterSpec("table", str(tmp_path / "t.npz"))})
    drafter = NgramTableDrafter(NgramTable.load(tmp_path / "t.npz"))
    drafter.bind(models.target)
    with BackgroundServer(cfg, models=dataclasses.replace(models, drafters={"t": drafter})) as server:
        client = client_of(server)
        taps = {"strategy": "single", "drafters": ["t"]}
        reply = client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=32, temperature=0,
                                               extra_body={"taps": taps})
        _, text = reference(models, models.encode_chat(QUESTION), "autoregressive", [], None, 32)
        assert reply.choices[0].message.content == text and extra(reply, "taps")["drafters"] == ["t"]
        sampled = [client.chat.completions.create(model="taps-mini", messages=[{"role": "user", "content": q}],
                                                  max_tokens=32, temperature=1.0, seed=7, extra_body={"taps": taps})
                   for q in questions[:2] * 2]
        assert [r.choices[0].message.content for r in sampled[:2]] == [r.choices[0].message.content for r in sampled[2:]]
        assert max(extra(r, "taps")["tau"] for r in sampled) > 1.0, "no draft of the table was accepted"


def test_streaming_gives_the_same_answer(server, models):
    client = client_of(server)
    whole = client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=48, temperature=0)
    chunks = list(client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=48, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finish = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finish) == 1 and finish[0].choices[0].finish_reason == whole.choices[0].finish_reason
    assert extra(finish[0], "taps")["strategy"] == "merged-budget"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == whole.usage.completion_tokens
    assert extra(last, "taps")["tau"] >= 1.0

    # text completions stream too; without include_usage no usage chunk, the taps block on the last chunk
    prompt = models.decode(models.encode_chat(QUESTION))
    whole = client.completions.create(model="taps-mini", prompt=prompt, max_tokens=24, temperature=0)
    chunks = list(client.completions.create(model="taps-mini", prompt=prompt, max_tokens=24, temperature=0,
                                            stream=True))
    assert "".join(c.choices[0].text for c in chunks) == whole.choices[0].text
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason and extra(chunks[-1], "taps")


def test_raw_stream_ends_with_done(server):
    body = {"model": "taps-mini", "prompt": "Once upon a time", "max_tokens": 8, "temperature": 0, "stream": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"
    assert json.loads(lines[-2][6:])["choices"][0]["finish_reason"] in ("stop", "length")


def test_stop_strings(server, models):
    client = client_of(server)
    full = client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=48, temperature=0)
    text = full.choices[0].message.content
    words = text.split()
    assert len(words) > 6, text
    stop = " ".join(words[3:5])  # two words from the middle: spans token boundaries
    want = text[:text.index(stop)]
    for stream in (False, True):
        kw = dict(model="taps-mini", messages=QUESTION, max_tokens=48, temperature=0, stop=[stop, "\u2603"])
        if stream:
            chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
            got = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            reason = next(c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason)
            usage = chunks[-1].usage
        else:
            reply = client.chat.completions.create(**kw)
            got, reason, usage = reply.choices[0].message.content, reply.choices[0].finish_reason, reply.usage
        assert got == want and reason == "stop"
        # the tokens counted end with the one that completed the stop string
        assert usage.completion_tokens < full.usage.completion_tokens
        ids = _greedy_ids(models, usage.completion_tokens)
        assert stop in models.decode(ids) and stop not in models.decode(ids[:-1])
    wait_idle(server)


def _greedy_ids(models, n):
    from taps import SpeculativeDecoder

    dec = SpeculativeDecoder(models.target, [], "autoregressive", tokenizer=models.tokenizer)
    return dec.generate([models.encode_chat(QUESTION)], max_new_tokens=n, eos_token_id=models.eos_token_ids).tokens[0]


def test_seeds_reproduce_whatever_else_runs(server):
    client = client_of(server)

    def ask(seed, question="Write a haiku about rain."):
        reply = client.chat.completions.create(model="taps-mini", messages=[{"role": "user", "content": question}],
                                               max_tokens=24, temperature=1.0, seed=seed)
        return reply.choices[0].message.content

    alone = ask(7)
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        crowd = [pool.submit(ask, s, q) for s, q in ((7, "Write a haiku about rain."), (8, "What is 2 + 2?"),
                                                    (7, "Write a haiku about rain."), (9, "Name a colour."))]
        answers = [f.result() for f in crowd]
    assert answers[0] == answers[2] == alone
    assert len({ask(s) for s in (1, 2, 3, 4)}) > 1  # sampled: other seeds, other answers


PIECES = [b"Hel", b"lo", b" w", b"\xc3", b"\xa9", b"rld", b"!"]  # token i's bytes; \xc3\xa9 is one character


def _decode(ids):
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


@pytest.mark.parametrize("stop, sent, stopped_at", [
    ([], "Hello w\u00e9rld!", None),
    (["lo w"], "Hel", 3),                   # across three tokens
    (["\u00e9r"], "Hello w", 6),            # a character split over two tokens, then the next token
    (["w\u00e9rld!!"], "Hello w\u00e9rld!", None),  # a prefix of a stop string at the end is held, then released
])
def test_text_stream_decodes_incrementally_and_stops(stop, sent, stopped_at):
    from taps.serve.text import TextStream

    stream = TextStream(_decode, stop)
    pieces = [stream.feed([i]) for i in range(len(PIECES))]
    pieces.append(stream.finish())
    assert "".join(pieces) == sent and not any("\ufffd" in p for p in pieces)
    assert stream.stopped == (stopped_at is not None)
    assert stream.num_tokens == (stopped_at or len(PIECES))
    if stop == ["w\u00e9rld!!"]:
        assert pieces[2] == " " and pieces[-1] == "w\u00e9rld!"  # "w..." held back until the answer ended


# (route, body, status, param): each must be refused with OpenAI's error body
BAD_REQUESTS = [
    ("chat", {"model": "taps-mini"}, 400, "messages"),
    ("chat", {"model": "taps-mini", "messages": []}, 400, "messages"),
    ("chat", {"model": "taps-mini", "messages": "hi"}, 400, "messages"),
    ("chat", {"model": "taps-mini", "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ("chat", {"model": "taps-mini", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, 400,
     "messages[0].content"),
    ("chat", {"model": "gpt-9", "messages": QUESTION}, 404, "model"),
    ("chat", {"messages": QUESTION, "n": 2}, 400, "n"),
    ("chat", {"messages": QUESTION, "temperature": 2.5}, 400, "temperature"),
    ("chat", {"messages": QUESTION, "temperature": "hot"}, 400, "temperature"),
    ("chat", {"messages": QUESTION, "top_p": 0}, 400, "top_p"),
    ("chat", {"messages": QUESTION, "top_k": -3}, 400, "top_k"),
    ("chat", {"messages": QUESTION, "max_tokens": 0}, 400, "max_tokens"),
    ("chat", {"messages": QUESTION, "max_completion_tokens": 5000}, 400, "messages"),
    ("chat", {"messages": QUESTION, "max_tokens": True}, 400, "max_tokens"),
    ("chat", {"messages": QUESTION, "seed": 2 ** 70}, 400, "seed"),
    ("chat", {"messages": QUESTION, "stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    ("chat", {"messages": QUESTION, "stop": [""]}, 400, "stop"),
    ("chat", {"messages": QUESTION, "logprobs": True}, 400, "logprobs"),
    ("chat", {"messages": QUESTION, "tools": [{"type": "function"}]}, 400, "tools"),
    ("chat", {"messages": QUESTION, "presence_penalty": 0.5}, 400, "presence_penalty"),
    ("chat", {"messages": QUESTION, "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("chat", {"messages": QUESTION, "taps": {"strategy": "bogus"}}, 400, "taps.strategy"),
    ("chat", {"messages": QUESTION, "taps": {"drafters": ["math", "nope"]}}, 400, "taps.drafters"),
    ("chat", {"messages": QUESTION, "taps": {"drafters": ["math", "math"]}}, 400, "taps.drafters"),
    ("chat", {"messages": QUESTION, "taps": {"strategy": "single", "drafters": ["math", "chat"]}}, 400,
     "taps.drafters"),
    ("chat", {"messages": QUESTION, "taps": {"strategy": "autoregressive", "drafters": ["math"]}}, 400,
     "taps.drafters"),
    ("chat", {"messages": QUESTION, "taps": {"strategy": "average", "drafters": ["math", "lookup"]}}, 400, None),
    ("chat", {"messages": QUESTION, "taps": {"drafters": "all"}}, 400, "taps.drafters"),
    ("chat", [1, 2], 400, None),
    ("completions", {"prompt": ""}, 400, "prompt"),
    ("completions", {"prompt": [1, 2, 99999]}, 400, "prompt"),
    ("completions", {"prompt": ["one", "two"]}, 400, "prompt"),
    ("completions", {"prompt": "hi", "echo": True}, 400, "echo"),
    ("completions", {"prompt": "hi", "best_of": 3}, 400, "best_of"),
    ("completions", {"prompt": "x " * 3000}, 400, "prompt"),
    ("completions", {}, 400, "prompt"),
]


@pytest.mark.parametrize("route, body, status, param", BAD_REQUESTS, ids=[f"{i}-{b[0]}" for i, b in
                                                                           enumerate(BAD_REQUESTS)])
def test_bad_requests_get_openai_error_bodies(server, route, body, status, param):
    r = httpx.post(f"{server.url}/v1/{'chat/completions' if route == 'chat' else 'completions'}", json=body)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == ERROR_KEYS and error["message"], error
    assert error["param"] == param, error
    assert error["type"] == "invalid_request_error"


def test_errors_through_the_openai_client(server):
    client = client_of(server)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-9", messages=QUESTION)
    assert e.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=4000)
    assert e.value.body["code"] == "context_length_exceeded" and "2048" in e.value.body["message"]
    for raw, status in ((b"{not json", 400), (b'{"messages": [], "temperature": NaN}', 400)):
        r = httpx.post(server.url + "/v1/chat/completions", content=raw, headers={"Content-Type": "application/json"})
        assert r.status_code == status and set(r.json()["error"]) == ERROR_KEYS
    r = httpx.get(server.url + "/v1/nowhere")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(server.url + "/v1/chat/completions")
    assert r.status_code == 405 and set(r.json()["error"]) == ERROR_KEYS
    # unknown fields are ignored, as OpenAI does
    reply = httpx.post(server.url + "/v1/chat/completions", json={"messages": QUESTION, "max_tokens": 2,
                                                                   "frobnicate": {"x": 1}, "user": "u1",
                                                                   "taps": {"strategy": "single", "drafters": ["math"],
                                                                            "colour": "blue"}})
    assert reply.status_code == 200, reply.text


# a request of plain decoding no `endless` server finishes while a test waits on it (60,000 tokens: 8 s
# decoded some 6,700 of them on the dev CPU; the tests close or time it out within seconds)
LONG = {"messages": QUESTION, "max_tokens": 60_000, "temperature": 0, "stream": True,
        "taps": {"strategy": "autoregressive"}}


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_a_full_queue_gets_429_and_clients_that_leave_free_their_rows(endless_target, engine):
    with endless(endless_target, engine, max_batch=1, max_queue=1) as server, httpx.Client(timeout=30) as h, \
            concurrent.futures.ThreadPoolExecutor(1) as pool:
        url = server.url + "/v1/chat/completions"
        with h.stream("POST", url, json=LONG) as running:  # its headers come with its first token
            lines = running.iter_lines()  # (kept: a dropped line iterator closes the response)
            first = next(ln for ln in lines if ln.startswith("data: "))
            assert json.loads(first[6:])["choices"][0]["delta"]["role"] == "assistant"
            queued = pool.submit(httpx.post, url, json={**LONG, "stream": False}, timeout=3.0)
            wait_health(server, running=1, waiting=1, outstanding=2)
            with pytest.raises(openai.RateLimitError) as e:
                client_of(server).chat.completions.create(model="target", messages=QUESTION, max_tokens=2)
            assert set(e.value.body) == ERROR_KEYS and e.value.response.headers["retry-after"] == "1"
            # the queued client gives up: its request leaves the queue
            with pytest.raises(httpx.ReadTimeout):
                queued.result()
            wait_health(server, running=1, waiting=0, outstanding=1)
        # the running stream closed mid-answer: the server drops it
        wait_idle(server)
        # a client that stops waiting for a whole answer frees its row too
        with pytest.raises(httpx.ReadTimeout):
            h.post(url, json={**LONG, "stream": False}, timeout=0.5)
        wait_idle(server)
        metrics = h.get(server.url + "/metrics").text
    assert 'taps_requests_total{endpoint="/v1/chat/completions",status="429"} 1.0' in metrics
    assert 'taps_requests_total{endpoint="/v1/chat/completions",status="499"} 2.0' in metrics


@pytest.mark.parametrize("engine", ["thread", "process"])
def test_requests_past_the_timeout_get_408(endless_target, engine):
    with endless(endless_target, engine, timeout=1.0) as server, httpx.Client(timeout=30) as h:
        url = server.url + "/v1/chat/completions"
        h.post(url, json={**LONG, "stream": False, "max_tokens": 2})  # the decoder is made outside the timings
        r = h.post(url, json={**LONG, "stream": False})
        assert r.status_code == 408 and r.json()["error"]["code"] == "timeout", r.text
        with h.stream("POST", url, json=LONG) as r:
            events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
        assert events[-1]["error"]["code"] == "timeout" and len(events) > 2
        wait_idle(server)
        metrics = h.get(server.url + "/metrics").text
    assert 'taps_finished_requests_total{reason="timeout"} 2.0' in metrics


def test_models_health_and_metrics(server):
    from prometheus_client.parser import text_string_to_metric_families

    client = client_of(server)
    listed = client.models.list().data
    assert [m.id for m in listed] == ["taps-mini"]
    info = extra(listed[0], "taps")
    table = models_dir() / "tables" / "sampled" / "table.npz"
    assert info["drafters"] == {"math": "shipped:hass-math", "chat": "shipped:hass-chat", "lookup": "lookup",
                                "table": f"table:{table}"}
    assert info["default_drafters"] == ["table"]
    assert info["default_strategy"] == "merged-budget" and info["context_length"] == 2048
    assert info["engine"] == server.engine and info["dtype"] == "float32" and info["device"] == "cpu"
    assert client.models.retrieve("taps-mini").id == "taps-mini"
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "ok"
    client.chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=8, temperature=0,
                                   extra_body={"taps": {"drafters": ["math", "chat"]}})
    families = {f.name: f for f in text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    for name in ("taps_requests", "taps_finished_requests", "taps_prompt_tokens", "taps_completion_tokens",
                 "taps_generation_tokens_per_second", "taps_request_tau", "taps_target_forwards",
                 "taps_accepted_draft_tokens", "taps_drafter_accepted_tokens", "taps_queue_depth",
                 "taps_running_requests", "taps_step_seconds", "taps_time_to_first_token_seconds",
                 "taps_request_seconds"):
        assert name in families, name
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in families.values() for s in f.samples}
    assert samples[("taps_completion_tokens_total", ())] > 0
    assert samples[("taps_time_to_first_token_seconds_count", ())] > 0
    assert any(name == "taps_drafter_accepted_tokens_total" and dict(labels) == {"drafter": "math"}
               for name, labels in samples)


def _fuzz_bodies():
    """Random JSON bodies: anything at all, and bodies that are valid but for at most one wild field."""
    from hypothesis import strategies as st

    scalars = st.none() | st.booleans() | st.integers(-2 ** 70, 2 ** 70) | st.floats() | st.text(max_size=12)
    values = st.recursive(scalars, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                        max_size=3), max_leaves=8)
    role = st.sampled_from(["user", "system", "assistant", "developer", "tool", "", "x"])
    message = st.fixed_dictionaries({"role": role, "content": st.text(min_size=1, max_size=20)})
    strategy = st.sampled_from(["single", "merged", "merged-budget", "average", "adaptive", "route-confidence-prompt",
                                "autoregressive", "bogus"])
    drafters = st.just("auto") | st.lists(st.sampled_from(["math", "chat", "lookup", "nope"]), max_size=3)
    valid = {
        "model": st.just("taps-mini"), "max_tokens": st.integers(1, 4), "temperature": st.floats(0, 2),
        "top_p": st.floats(0.05, 1), "top_k": st.integers(-1, 50), "seed": st.integers(-2 ** 63, 2 ** 64 - 1),
        "stop": st.text(min_size=1, max_size=2) | st.lists(st.text(min_size=1, max_size=2), max_size=4),
        "stream": st.booleans(), "n": st.just(1),
        "taps": st.fixed_dictionaries({}, optional={"strategy": strategy, "drafters": drafters}),
    }
    wild = {
        "messages": st.lists(st.fixed_dictionaries({"role": role | values, "content": values}), max_size=2) | values,
        "prompt": st.lists(st.integers(-2, 9000), max_size=4) | values,
        "max_tokens": st.integers(-2, 6) | values, "max_completion_tokens": st.integers(-2, 6) | values,
        "temperature": st.floats(-1, 3) | values, "top_p": st.floats(-0.5, 1.5) | values,
        "top_k": st.integers(-3, 50) | values, "seed": st.integers(-2 ** 65, 2 ** 65) | values,
        "stop": st.lists(st.text(max_size=3), max_size=6) | values, "n": st.integers(0, 3) | values,
        "stream": values, "stream_options": st.fixed_dictionaries({}, optional={"include_usage": values}) | values,
        "logprobs": values, "echo": values, "tools": values, "response_format": values, "model": values,
        "taps": st.fixed_dictionaries({}, optional={"strategy": strategy | values, "drafters": drafters | values})
        | values,
    }
    base = st.fixed_dictionaries({"messages": st.lists(message, min_size=1, max_size=2)}) | \
        st.fixed_dictionaries({"prompt": st.text(min_size=1, max_size=20) | st.lists(st.integers(0, 8191), min_size=1,
                                                                                          max_size=4)})
    near_valid = st.tuples(base, st.fixed_dictionaries({}, optional=valid),
                           st.dictionaries(st.sampled_from(sorted(wild)), values, max_size=1)
                           | st.sampled_from(sorted(wild)).flatmap(lambda k: wild[k].map(lambda v: {k: v}))
                           | st.just({}))
    return near_valid.map(lambda parts: {**parts[0], **parts[1], **parts[2]}) | values


def test_fuzz_random_bodies_never_get_a_server_error(models):
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    seen = set()
    with BackgroundServer(ServeConfig(dtype="fp32", max_tokens=4, default_max_tokens=4), models=models) as s, \
            httpx.Client(base_url=s.url, timeout=60) as h:
        @settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True,
                  database=None)
        @given(route=st.sampled_from(["/v1/chat/completions", "/v1/completions"]), body=_fuzz_bodies())
        def post(route, body):
            raw = json.dumps(body, allow_nan=True)  # NaN and Infinity too, as Python clients can send them
            r = h.post(route, content=raw, headers={"Content-Type": "application/json"})
            seen.add(r.status_code)
            assert r.status_code < 500, (body, r.status_code, r.text)
            if r.status_code != 200:
                assert set(r.json()["error"]) == ERROR_KEYS, r.text
            elif r.headers["content-type"].startswith("text/event-stream"):
                assert r.text.rstrip().endswith("data: [DONE]") and '"error"' not in r.text, r.text

        post()
        wait_idle(s)
    assert {200, 400} <= seen, seen


def test_bench_serve_smoke(server, capsys, monkeypatch):
    """bench/bench_serve.py on a tiny load against the test server: it checks nothing was lost and prints
    its table."""
    spec = importlib.util.spec_from_file_location("bench_serve", REPO_ROOT / "bench" / "bench_serve.py")
    bench = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "bench_serve", bench)  # (its dataclasses look their module up)
    spec.loader.exec_module(bench)
    rc = bench.main(["--url", server.url, "--requests", "6", "--concurrency", "3", "--max-tokens", "8",
                     "--cancel-every", "3", "--cancel-after", "1", "--warmup", "1", "--rounds", "2"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "no leaked batch rows" in out and "CPU:" in out
    assert len(out.split("by round: ")[1].splitlines()[0].split(", ")) == 2, out  # a ratio per round
    ratio = out.split("taps / AR")[1].split()[0]
    assert ratio.endswith("x") and float(ratio[:-1]) > 0, out


def _save_hf_target(folder, models, max_positions: int):
    """A random two-layer Llama with the shipped tokenizer (Hugging Face's, with its chat template) saved as
    a Hugging Face folder, as `taps serve --target` loads one; returns its config."""
    import torch
    import transformers

    config = transformers.LlamaConfig(vocab_size=len(models.tokenizer), hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=max_positions, eos_token_id=models.eos_token_ids[0])
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    models.tokenizer.hf.save_pretrained(folder)
    return config


def test_a_hugging_face_target_with_a_small_lm_drafter(tmp_path, models):
    """A target and drafter folder as `taps serve --config` names them: a random Llama with the shipped
    tokenizer (Hugging Face's, with its chat template) and a one-layer Llama as a `model` drafter."""
    import transformers

    from taps import SpeculativeDecoder
    from taps.serve.config import DrafterSpec

    config = _save_hf_target(tmp_path / "target", models, max_positions=256)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(**{**config.to_dict(), "num_hidden_layers": 1})) \
        .save_pretrained(tmp_path / "small")
    cfg = ServeConfig(target=str(tmp_path / "target"), dtype="fp32", strategy="merged", budget=8,
                      drafters={"small": DrafterSpec("model", str(tmp_path / "small")), "lookup": DrafterSpec("lookup")})
    with BackgroundServer(cfg) as server:
        # the engine's process decodes with its own copy of the models; this one never read the weights
        assert server.engine == "process" and next(server.models.target.parameters()).is_meta
        assert all(d is None for d in server.models.drafters.values())  # loaded in the engine's process only
        hf = load_models(cfg)
        assert hf.name == "target" and hf.context_length == 256 and not hf.chat_tokenizer
        client = client_of(server)
        reply = client.chat.completions.create(model="target", messages=QUESTION, max_tokens=12, temperature=0)
        prompt = hf.encode_chat(QUESTION)
        assert prompt == models.encode_chat(QUESTION)  # the same chat template, through Hugging Face's tokenizer
        dec = SpeculativeDecoder(hf.target, [hf.drafters["small"], hf.drafters["lookup"]], "merged", budget=8,
                                 tokenizer=hf.tokenizer)
        tokens = dec.generate([prompt], max_new_tokens=12, eos_token_id=hf.eos_token_ids).tokens[0]
        assert reply.choices[0].message.content == hf.decode(tokens)
        assert extra(reply, "taps")["drafters"] == ["small", "lookup"]
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="target", prompt="hi", max_tokens=300)
        assert e.value.body["code"] == "context_length_exceeded"


def test_facts_only_load_matches_the_full_one(tmp_path, models):
    """load_models(weights=False), what a server whose engine runs in its own process loads: the same name,
    context, vocabulary, eos ids (those of generation_config.json too), dtype, device and tokenizer as the
    full load, the target on the meta device, no drafter loaded; for the shipped target and a Hugging Face
    folder."""
    import transformers

    from taps.serve.config import DrafterSpec

    _save_hf_target(tmp_path / "target", models, max_positions=300)
    # eos ids of the generation config beyond the model config's (as instruction-tuned models ship them)
    transformers.GenerationConfig(eos_token_id=[models.eos_token_ids[0], 7]).save_pretrained(tmp_path / "target")
    for cfg in (ServeConfig(dtype="bf16"),
                ServeConfig(target=str(tmp_path / "target"), dtype="fp32",
                            drafters={"lookup": DrafterSpec("lookup")})):
        full, facts = load_models(cfg), load_models(cfg, weights=False)
        for name in ("name", "context_length", "vocab_size", "eos_token_ids", "dtype", "device"):
            assert getattr(facts, name) == getattr(full, name), name
        assert all(p.is_meta for p in facts.target.parameters())
        assert not any(p.is_meta for p in full.target.parameters())
        assert set(facts.drafters) == set(full.drafters) and all(d is None for d in facts.drafters.values())
        assert facts.encode_chat(QUESTION) == full.encode_chat(QUESTION)
        assert facts.encode_text("two plus two") == full.encode_text("two plus two")
    assert full.eos_token_ids == sorted({models.eos_token_ids[0], 7}) and full.context_length == 300
    assert facts.dtype == "float32" and facts.device == "cpu"


def test_tuner_state_kept_between_runs(models, tmp_path, caplog):
    """--tuner-dir: a server saves each decoder's tuner state (and its batch's window judge) when it stops; the next
    one loads it when it makes that decoder (its tuner goes on from the first's clock, its judge from the first's
    verdict); a state of another setup is skipped with a log line."""
    import logging

    config = ServeConfig(dtype="fp32", tuner_dir=str(tmp_path))
    with BackgroundServer(config, models=models) as s:
        client_of(s).chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=16)
        (decoder,) = s.service.engine._decoders.values()
        (batch,) = s.service.engine._batches.values()
        wait_health(s)
        # (a verdict as a window judge reaches it after windows that lost: 5 plain windows to run)
        batch.judge.track.ratio, batch.judge.track.plain_left = 1.25, 5
    clock = decoder.tuner.clock
    (saved,) = tmp_path.glob("tuner-*.json")
    assert clock > 0
    with BackgroundServer(config, models=models) as s:
        client_of(s).chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=4)
        (decoder,) = s.service.engine._decoders.values()
        (batch,) = s.service.engine._batches.values()
        # the judge went on from its verdict: the request's steps (its first window) one of the 5 plain ones, which
        # the tuner does not plan (its clock the saved one: a new tuner's would be 0)
        assert batch.judge.track.ratio == 1.25 and batch.judge.track.plain_left == 4
        assert decoder.tuner.clock == clock
    import re

    saved.write_text(re.sub(r'"threads": \d+', '"threads": 1000', saved.read_text()))  # measured elsewhere
    with caplog.at_level(logging.WARNING, logger="taps.serve"), BackgroundServer(config, models=models) as s:
        client_of(s).chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=4)
    assert any("not using" in r.getMessage() and "threads: 1000 there" in r.getMessage() for r in caplog.records)


def test_token_rate_is_the_windows_sum():
    """The tokens-per-second gauge's running sum equals the sum over the window's steps (all but the first)
    over its time span, step after step, as steps leave the window."""
    import random

    from taps.serve.engine import _TokenRate

    rng = random.Random(0)
    rate, steps, now = _TokenRate(window=1.0), [], 0.0
    assert rate.per_second() == 0.0
    for _ in range(2000):
        now += rng.choice([0.001, 0.01, 0.05, 0.3, 1.5])
        tokens = rng.randint(0, 16)
        rate.add(now, tokens)
        steps = [(t, n) for t, n in steps + [(now, tokens)] if t >= now - 1.0]
        span = steps[-1][0] - steps[0][0]
        want = sum(n for _, n in steps[1:]) / span if len(steps) > 1 and span > 0 else 0.0
        assert rate.per_second() == pytest.approx(want, rel=1e-12, abs=1e-12)


def test_mailbox_delivers_a_burst_in_one_wake_up():
    """Outputs the engine thread posts before the loop runs arrive with one wake-up of the loop, each
    request's in order; a closed loop drops them without raising (the server is gone)."""
    import asyncio
    import threading

    from taps.serve.app import _Mailbox

    loop = asyncio.new_event_loop()
    try:
        wakes = []
        real = loop.call_soon_threadsafe
        loop.call_soon_threadsafe = lambda *a: (wakes.append(a), real(*a))[1]
        queues = [asyncio.Queue() for _ in range(3)]
        box = _Mailbox.of(loop)
        assert _Mailbox.of(loop) is box

        def engine():
            for i in range(30):
                box.post(queues[i % 3], i)

        thread = threading.Thread(target=engine)
        thread.start()
        thread.join()
        assert len(wakes) == 1
        loop.run_until_complete(asyncio.sleep(0))
        assert [[q.get_nowait() for _ in range(q.qsize())] for q in queues] == [list(range(r, 30, 3)) for r in range(3)]
        box.post(queues[0], "again")  # after the delivery: a new wake-up
        assert len(wakes) == 2
        loop.run_until_complete(asyncio.sleep(0))
        assert queues[0].get_nowait() == "again"
    finally:
        loop.close()
    box.post(queues[0], "late")  # a closed loop
    assert box.items == []


@pytest.mark.parametrize("setting,want", [(None, "default"), ("never", None), (5, 5)])
def test_retire_after_reaches_the_decoders(models, setting, want):
    """ServeConfig.retire_after (--retire-after) sets the tuned decoders' retire_after: RETIRE_AFTER unless
    set, None for "never" (a SpeculativeDecoder made elsewhere retires nothing unless told)."""
    from taps.decoder import RETIRE_AFTER

    config = ServeConfig(dtype="fp32") if setting is None else ServeConfig(dtype="fp32", retire_after=setting)
    with BackgroundServer(config, models=models) as s:
        client_of(s).chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=4)
        (decoder,) = s.service.engine._decoders.values()
    assert decoder.retire_after == (RETIRE_AFTER if want == "default" else want)


@pytest.mark.parametrize("setting,want", [(None, 32), ("never", None), (5, 5)])
def test_judge_window_reaches_the_batches(models, setting, want):
    """ServeConfig.judge_window (--judge-window) gives each tuned batch a WindowJudge of that many steps, none for
    "never"."""
    config = ServeConfig(dtype="fp32") if setting is None else ServeConfig(dtype="fp32", judge_window=setting)
    with BackgroundServer(config, models=models) as s:
        client_of(s).chat.completions.create(model="taps-mini", messages=QUESTION, max_tokens=4)
        (batch,) = s.service.engine._batches.values()
    assert (None if batch.judge is None else batch.judge.window) == want


def test_engine_kind():
    """Where the decoding loop runs: "auto" is a process unless the caller passes loaded models; "process"
    with loaded models is refused (a child process cannot share them)."""
    from taps.serve.server import engine_kind

    assert engine_kind(ServeConfig(), models_given=False) == "process"
    assert engine_kind(ServeConfig(), models_given=True) == "thread"
    assert engine_kind(ServeConfig(engine="thread"), models_given=False) == "thread"
    assert engine_kind(ServeConfig(engine="process"), models_given=False) == "process"
    with pytest.raises(ValueError, match="engine 'process'"):
        engine_kind(ServeConfig(engine="process"), models_given=True)


def test_a_dead_engine_process_fails_its_requests_and_health(endless_target):
    """The engine's process killed mid-answer: the running request ends with an error, /health turns 503
    with the reason, new requests get 503; the server still stops cleanly."""
    import signal

    with endless(endless_target, "process") as server, httpx.Client(timeout=30) as h:
        url = server.url + "/v1/chat/completions"
        engine = server.service.engine
        with h.stream("POST", url, json=LONG) as running:
            lines = running.iter_lines()
            next(ln for ln in lines if ln.startswith("data: "))
            engine._process.send_signal(signal.SIGKILL)
            events = [json.loads(ln[6:]) for ln in lines if ln.startswith("data: {")]
        assert events and "error" in events[-1], events[-3:]
        deadline = time.monotonic() + 10
        while httpx.get(server.url + "/health").status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        health = httpx.get(server.url + "/health").json()
        assert health["status"] == "error" and health["outstanding"] == 0
        assert "exited" in engine.failed
        r = h.post(url, json={**LONG, "stream": False})
        assert r.status_code == 503 and set(r.json()["error"]) == ERROR_KEYS
        # a request handed over after the process ended (past the server's check) is answered at once
        from taps.serve.engine import Submission

        got = []
        engine.submit(Submission("late", None, [1, 2], None, [], time.perf_counter() + 5, got.append))
        assert len(got) == 1 and got[0].error[0] == 503


def test_metrics_recorded_in_the_engine_process_replay_as_made():
    """The engine's process records the metrics' calls (labels included) and the server's process replays
    them on its ServerMetrics: the same samples as the calls made directly."""
    from prometheus_client import CollectorRegistry

    from taps.serve.engine import _Recorder, _replay
    from taps.serve.metrics import ServerMetrics

    class Stats:
        target_forwards, tau, accepted, drafter_accepted = 5, 2.4, [3, 4], [5, 2]

    report = {"strategy": "merged", "drafter_share": {"math": 0.7, "chat": 0.3}}

    def calls(m):
        m.finished.labels("timeout").inc()
        m.step_seconds.observe(0.002)
        m.time_to_first_token.observe(0.01)
        m.request_done(12, 7, "stop", Stats(), 0.3, report)
        m.running.set(3)
        m.queue_depth.set(1)
        m.tokens_per_second.set(123.0)

    direct, replayed = ServerMetrics(CollectorRegistry()), ServerMetrics(CollectorRegistry())
    calls(direct)
    recorder = _Recorder()
    calls(recorder)
    _replay(replayed, recorder.take())
    assert recorder.take() == []

    def samples(m):
        return sorted((s.name, tuple(sorted(s.labels.items())), s.value) for f in m.registry.collect()
                      for s in f.samples if not s.name.endswith("_created"))

    assert samples(replayed) == samples(direct)
    assert ("taps_drafter_accepted_tokens_total", (("drafter", "math"),), 5.0) in samples(replayed)


def test_an_engine_process_that_cannot_load_its_models_says_why(tmp_path):
    """The engine's process loads the models of the config itself: when that fails, start() raises with the
    child's error, and no process is left behind."""
    from taps.serve.engine import ProcessEngine

    engine = ProcessEngine(None, ServeConfig(target=str(tmp_path / "missing"), dtype="fp32"))
    with pytest.raises(RuntimeError, match="could not start(.|\n)*missing"):
        engine.start()
    assert not engine.alive and engine._process is None


def test_an_engine_process_outlives_ctrl_c_but_not_its_server():
    """Ctrl-C reaches a terminal's whole process group: the engine's process ignores SIGINT (the server's
    process stops it); and it ends by itself when the server's process is gone (its pipe closes)."""
    import os
    import signal
    import socket

    from taps.serve.engine import ProcessEngine

    engine = ProcessEngine(None, ServeConfig(dtype="fp32"))
    engine.start()
    child = engine._process
    child.send_signal(signal.SIGINT)
    time.sleep(0.5)
    assert child.poll() is None
    # as when the server's process dies: its end of the socket pair goes (a shutdown, which also wakes the
    # reader thread here, blocked in a read of it)
    end = socket.socket(fileno=os.dup(engine._conn.fileno()))
    end.shutdown(socket.SHUT_RDWR)
    end.close()
    assert child.wait(timeout=30) == 0
    engine._reader.join(10)
    assert not engine.alive and engine.failed is not None
