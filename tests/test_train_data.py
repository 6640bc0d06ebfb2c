"""Data loaders of taps.data and taps.train.data: well-formed files load, malformed records are rejected with a
message naming the file, the record and the problem; the shipped evaluation files are intact."""

import json

import pytest

from taps import data as R
from taps.train import data as D


def write_lines(path, records):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in records))
    return path


GOOD_GSM = {"question": "Tom has 3 apples and buys 2. How many?", "answer": "3+2=<<3+2=5>>5\n#### 5"}
GOOD_MATH = {"problem": "What is $1+1$?", "solution": "It is $\\boxed{2}$.", "unique_id": "train/algebra/1.json"}


def test_gsm8k_loads_and_strips_calculator_annotations(tmp_path):
    exs = R.load_gsm8k(write_lines(tmp_path / "g.jsonl", [GOOD_GSM]))
    assert exs[0].messages == [{"role": "user", "content": GOOD_GSM["question"]},
                               {"role": "assistant", "content": "3+2=5\n#### 5"}]
    assert exs[0].reference == "5" and exs[0].domain == "math"
    prompt = R.load_gsm8k(tmp_path / "g.jsonl", as_prompts=True)[0]
    assert [m["role"] for m in prompt.messages] == ["user"]


@pytest.mark.parametrize("bad, msg", [
    ('{"question": "x", "answer": ', "invalid JSON"),
    ({"answer": "1\n#### 1"}, "missing field 'question'"),
    ({"question": 3, "answer": "1\n#### 1"}, "field 'question' must be str"),
    ({"question": "  ", "answer": "1\n#### 1"}, "field 'question' is empty"),
    ({"question": "q", "answer": "no final line"}, "#### <number>"),
    ([1, 2], "expected a JSON object"),
    ({"question": "hi <|end|> there", "answer": "1\n#### 1"}, "special token"),
])
def test_gsm8k_rejects_malformed(tmp_path, bad, msg):
    path = write_lines(tmp_path / "g.jsonl", [GOOD_GSM, bad])
    with pytest.raises(R.DataError, match="g.jsonl:2") as e:
        R.load_gsm8k(path)
    assert msg in str(e.value)
    stats = R.LoadStats()
    assert len(R.load_gsm8k(path, errors="skip", stats=stats)) == 1
    assert stats.kept == 1 and sum(stats.skipped.values()) == 1


def test_math_rejects_missing_solution_and_prompt_without_answer(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [GOOD_MATH, {"problem": "p", "unique_id": "u"}])
    with pytest.raises(R.DataError, match=r"m.jsonl:2: missing field 'solution'"):
        R.load_math(path)
    path = write_lines(tmp_path / "t.jsonl", [GOOD_MATH])
    with pytest.raises(R.DataError, match="answer"):
        R.load_math(path, as_prompts=True)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(R.DataError, match="not found"):
        D.math_training_examples(tmp_path / "nowhere")


def test_mt_bench_and_svamp_reject_malformed(tmp_path):
    good = {"question_id": 81, "category": "writing", "turns": ["Write a poem.", "Shorter."]}
    assert R.load_mt_bench(write_lines(tmp_path / "q.jsonl", [good]))[0].messages[0]["content"] == "Write a poem."
    with pytest.raises(R.DataError, match="q.jsonl:2: field 'turns'"):
        R.load_mt_bench(write_lines(tmp_path / "q.jsonl", [good, {**good, "turns": []}]))
    with pytest.raises(R.DataError, match="question_id"):
        R.load_mt_bench(write_lines(tmp_path / "q.jsonl", [{**good, "question_id": "81"}]))
    rec = {"ID": "chal-1", "Body": "A has 3.", "Question": "How many?", "Answer": 3.0}
    p = tmp_path / "s.json"
    p.write_text(json.dumps([rec]))
    ex = R.load_svamp(p)[0]
    assert ex.messages[0]["content"] == "A has 3. How many?" and ex.reference == "3"
    p.write_text(json.dumps([rec, {**rec, "Answer": "3"}]))
    with pytest.raises(R.DataError, match=r"s.json\[1\]: field 'Answer'"):
        R.load_svamp(p)
    p.write_text(json.dumps({"not": "a list"}))
    with pytest.raises(R.DataError, match="JSON array"):
        R.load_svamp(p)


def sharegpt_record(rid, *turns):
    return {"id": rid, "conversations": [{"from": f, "value": v} for f, v in turns]}


def test_sharegpt_roles_malformed_and_truncated_tail(tmp_path):
    recs = [
        sharegpt_record("a_0", ("human", "Hi"), ("gpt", "Hello!")),
        sharegpt_record("b_1", ("gpt", "...continued"), ("human", "More?"), ("gpt", "Sure."), ("human", "x")),
        sharegpt_record("c_0", ("human", "Q"), ("bing", "A")),                # unknown speaker
        sharegpt_record("d_0", ("human", "Q"), ("human", "Q2"), ("gpt", "A")),  # not alternating
        sharegpt_record("e_0", ("human", "Q"), ("gpt", "")),                   # empty turn
        {"id": "f_0"},                                                         # no conversations
    ]
    text = json.dumps(recs, indent=1)
    p = tmp_path / "sg.json"
    p.write_text(text)
    stats = R.LoadStats()
    exs = D.load_sharegpt(p, stats=stats)
    assert [e.id for e in exs] == ["sharegpt/a_0", "sharegpt/b_1"]
    # dangling turns of a split conversation are dropped: b_1 starts at the user and ends at the assistant
    assert [m["role"] for m in exs[1].messages] == ["user", "assistant"]
    assert stats.skipped == {"unknown-speaker": 1, "bad-conversation": 2, "missing-conversations": 1}
    assert not stats.truncated_tail
    with pytest.raises(R.DataError, match=r"sg.json\[2\] \(id c_0, turn 1\): unknown speaker 'bing'"):
        D.load_sharegpt(p, errors="raise")
    # the packaged file stops inside a record: everything before it is kept
    p.write_text(text[: text.index('"id": "c_0"') + 20])
    stats = R.LoadStats()
    assert len(D.load_sharegpt(p, stats=stats)) == 2 and stats.truncated_tail


def test_decontaminate_drops_eval_prompts():
    keys = {D.normalize_prompt("What is  2+2?")}
    exs = [R.Example("a", "math", [{"role": "user", "content": "what is 2+2?"}, {"role": "assistant", "content": "4"}]),
           R.Example("b", "math", [{"role": "user", "content": "What is 3+3?"}, {"role": "assistant", "content": "6"}])]
    kept, dropped = D.decontaminate(exs, keys)
    assert [e.id for e in kept] == ["b"] and dropped == 1


def test_shipped_eval_sets_load():
    sizes = {name: len(R.load_eval_prompts(name)) for name in R.EVAL_SETS}
    assert sizes == {"mt_bench": 80, "gsm8k": 1319, "math500": 500, "svamp": 1000}
    for name in ("mt_bench", "gsm8k", "math500", "svamp"):
        folder = R.data_dir() / name
        assert (folder / "LICENSE").is_file(), f"{folder} lacks its LICENSE"
