"""Data-parallel training under torchrun (gloo on the CPU, 2 processes of 1 thread each).

- a 2-process drafter run (HASS, mixed data, sharded feature extraction and held-out evaluation) ends
  with the weights, losses and held-out metrics of the 1-process run of the same flags;
- its feature cache, written by both ranks into the same memory-mapped files, equals the 1-process
  cache byte for byte;
- a run stopped by 2 processes (in micro-batches of one sequence) and finished by 1, and the reverse
  (finished under FSDP), match the uninterrupted run;
- ``taps train target`` under torchrun with FSDP (a unit per decoder layer, tied embeddings, two
  micro-batches per rank) matches the 1-process run;
- a killed rank ends the job with an error at once, a stalled rank after the collective timeout.

The torchrun jobs start ``python -m taps.train`` (with the feature cache already built) or
``tests/tiny_training.py`` (the same command with random token blocks in place of the real data).
"""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("safetensors")
dist = pytest.importorskip("torch.distributed")
if not (dist.is_available() and dist.is_gloo_available()):
    pytest.skip("torch.distributed with gloo is not available", allow_module_level=True)

from taps.train import drafter as TD  # noqa: E402
from taps.train import eagle3 as TE  # noqa: E402
from taps.train.data import REPO_ROOT  # noqa: E402
from tiny_training import fake_blocks, tiny_target_dir  # noqa: E402

TESTS = Path(__file__).resolve().parent
WORKER = str(TESTS / "tiny_training.py")
# 16 steps of 4 blocks of 64 tokens, half math half chat; held-out metrics every 8 steps
DRAFTER = dict(family="hass", data="mixed", tokens=4096, heldout_tokens=256, seq_len=64, batch_size=4,
               warmup_steps=2, eval_every=8, threads=1, device="cpu", quiet=True)
STEPS = 16


def cli_args(command: str, **kw) -> list:
    out = [command]
    for k, v in kw.items():
        if v is True:
            out.append("--" + k.replace("_", "-"))
        elif v is not False and v is not None:
            out += ["--" + k.replace("_", "-"), str(v)]
    return out


def torchrun(*args, nproc=2, timeout=300, check=True) -> subprocess.CompletedProcess:
    """Run ``torchrun --standalone --nproc_per_node nproc *args`` to the end."""
    r = subprocess.run(torchrun_command(nproc, *args), env=job_env(), capture_output=True, text=True, timeout=timeout)
    if check and r.returncode != 0:
        raise AssertionError(f"torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}\n{r.stderr[-6000:]}")
    return r


def torchrun_command(nproc, *args) -> list:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), *args]


def job_env() -> dict:
    env = dict(os.environ)
    path = [str(REPO_ROOT / "python"), str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
    env.update(PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1", MKL_NUM_THREADS="1",
               TOKENIZERS_PARALLELISM="false")
    return env


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A tiny target, and the uninterrupted 1-process reference run (which builds the feature cache)."""
    root = tmp_path_factory.mktemp("dist")
    tdir = tiny_target_dir(root / "target")

    def paths(name, features="features"):
        return dict(target=tdir, feature_dir=root / features, run_dir=root / "runs" / name, out=root / "out" / name)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TD, "domain_blocks", fake_blocks)
        TD.train_drafter(TD.DrafterTrainConfig(**DRAFTER, **paths("ref")))
    return root, paths


def run_in_process(paths, name, **kw) -> dict:
    """The 1-process run (what the same command does without torchrun), feature cache already built."""
    return TD.train_drafter(TD.DrafterTrainConfig(**{**DRAFTER, **kw}, **paths(name)))


def exported(out: Path) -> dict:
    from safetensors.torch import load_file

    return {k: v.float() for k, v in load_file(str(out / "model.safetensors")).items()}


def assert_same_weights(root: Path, a: str, b: str) -> None:
    """The runs' final fp32 weights (checkpoints) within 1e-3 of each other, and their bf16 exports
    within 1e-3 too, or one bf16 rounding step apart (a value near a rounding boundary may round
    either way after float-order differences of 1e-7)."""
    sa = torch.load(root / "runs" / a / "checkpoint.pt", weights_only=True)["model"]
    sb = torch.load(root / "runs" / b / "checkpoint.pt", weights_only=True)["model"]
    assert sa.keys() == sb.keys()
    for k in sa:
        if not sa[k].is_floating_point():  # an integer / bool map (EAGLE-3's d2t, t2d)
            assert torch.equal(sa[k], sb[k]), k
    worst = max(float((sa[k] - sb[k]).abs().max()) for k in sa if sa[k].is_floating_point())
    assert worst <= 1e-3, worst
    ea, eb = exported(root / "out" / a), exported(root / "out" / b)
    assert ea.keys() == eb.keys() == sa.keys()
    for k in ea:
        if not sa[k].is_floating_point():
            assert torch.equal(ea[k].to(sa[k].dtype), sa[k]) and torch.equal(eb[k].to(sb[k].dtype), sb[k]), k
            continue
        step = torch.maximum(ea[k].abs(), eb[k].abs()) * 2.0 ** -8
        assert ((ea[k] - eb[k]).abs() <= torch.clamp(step, min=1e-3)).all(), k


def train_log(root: Path, name: str) -> list:
    return [json.loads(x) for x in (root / "runs" / name / "log.jsonl").read_text().splitlines()]


def assert_same_log(root: Path, a: str, b: str) -> None:
    """Same steps, losses and metrics (to float reduction order), same held-out metrics."""
    la, lb = train_log(root, a), train_log(root, b)
    assert [r["step"] for r in la] == [r["step"] for r in lb]
    for ra, rb in zip(la, lb):
        if "heldout" in ra:
            for d in ra["heldout"]:
                assert ra["heldout"][d] == pytest.approx(rb["heldout"][d], abs=1e-4)
        else:
            assert ra["blocks"] == rb["blocks"] and ra["tokens"] == rb["tokens"]
            for k in ("loss", "grad_norm", "reg@1", "cls@3", "acc@2"):
                assert ra[k] == pytest.approx(rb[k], abs=1e-4), (ra["step"], k)


@pytest.fixture(scope="module")
def two_process_run(setup):
    """The reference flags on 2 processes, extracting its own features (random blocks)."""
    root, paths = setup
    p = paths("two", features="features-two")
    r = torchrun(WORKER, *cli_args("drafter", **{**DRAFTER, **p, "dist_timeout": 60}))
    return root, r


def test_two_processes_reach_the_weights_of_one(two_process_run):
    root, r = two_process_run
    assert_same_weights(root, "ref", "two")
    assert_same_log(root, "ref", "two")
    m1 = json.loads((root / "out" / "ref" / "manifest.json").read_text())
    m2 = json.loads((root / "out" / "two" / "manifest.json").read_text())
    assert m1["training"]["world_size"] == 1 and m1["training"]["backend"] is None
    assert m2["training"]["world_size"] == 2 and m2["training"]["backend"] == "gloo"
    assert m2["training"]["parallel"] == "ddp" and m2["training"]["segments"] == [
        {"steps": [0, STEPS], "world_size": 2, "backend": "gloo", "parallel": "ddp"}]
    for d in ("math", "chat"):
        assert m2["final_heldout"][d] == pytest.approx(m1["final_heldout"][d], abs=1e-4)
    assert m2["tokens_seen"] == m1["tokens_seen"] == STEPS * 4 * 64
    # rank 0 alone reports: one "finished" line, one progress line per domain's features
    assert r.stdout.count("finished in") == 1 and r.stdout.count("target features") == 2


def test_sharded_feature_cache_equals_single_process(two_process_run):
    root, _ = two_process_run
    for d in ("math", "chat"):
        one, two = root / "features" / d, root / "features-two" / d
        i1, i2 = (json.loads((f / "index.json").read_text()) for f in (one, two))
        assert (i1.pop("world_size"), i2.pop("world_size")) == (1, 2)
        assert i1 == i2 and i1["blocks"]["train"] == 32
        b1, b2 = (torch.load(f / "blocks.pt", weights_only=True) for f in (one, two))
        assert torch.equal(b1["train"], b2["train"]) and torch.equal(b1["heldout"], b2["heldout"])
        for part in ("train", "heldout"):
            f1, f2 = (f / f"{part}.bf16" for f in (one, two))
            assert f1.stat().st_size == i1["blocks"][part] * 64 * 32 * 2
            assert f1.read_bytes() == f2.read_bytes(), (d, part)
        feats = TD._cached_features(two, i2["key"], 32)
        assert feats.train_feat.abs().sum() > 0 and feats.heldout_feat.shape == (4, 64, 32)


def test_resume_across_process_counts(setup):
    """Stopped after 5 steps by 2 processes (gradient accumulation over micro-batches of one sequence)
    and finished by 1; stopped by 1 and finished by 2 under FSDP (sharded parameters, gradients and
    optimizer state): both equal the uninterrupted run."""
    root, paths = setup
    torchrun("-m", "taps.train", *cli_args("drafter", **{**DRAFTER, **paths("2to1"), "max_steps": 5,
                                                          "micro_batch": 1}))
    assert not (root / "out" / "2to1").exists()
    assert run_in_process(paths, "2to1")["finished"]

    assert not run_in_process(paths, "1to2", max_steps=5)["finished"]
    torchrun("-m", "taps.train", *cli_args("drafter", **{**DRAFTER, **paths("1to2"), "fsdp": True}))
    for name in ("2to1", "1to2"):
        assert_same_weights(root, "ref", name)
        assert_same_log(root, "ref", name)
    seg = {n: json.loads((root / "out" / n / "manifest.json").read_text())["training"]["segments"]
           for n in ("2to1", "1to2")}
    assert seg["2to1"] == [{"steps": [0, 5], "world_size": 2, "backend": "gloo", "parallel": "ddp"},
                           {"steps": [5, STEPS], "world_size": 1, "backend": None, "parallel": "none"}]
    assert seg["1to2"] == [{"steps": [0, 5], "world_size": 1, "backend": None, "parallel": "none"},
                           {"steps": [5, STEPS], "world_size": 2, "backend": "gloo", "parallel": "fsdp"}]


def test_eagle3_two_processes_reach_the_weights_of_one(setup):
    """``--family eagle3`` under torchrun: the layer-feature cache built from both ranks' shares equals
    the 1-process cache, and the 2-process run ends with the 1-process run's weights and losses."""
    root, paths = setup
    e3 = dict(DRAFTER, family="eagle3", draft_vocab=64, ttt_steps=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(TD, "domain_blocks", fake_blocks)
        TE.train_eagle3(TD.DrafterTrainConfig(**e3, **paths("e3-one", features="features-e3-one")))
    torchrun(WORKER, *cli_args("drafter", **{**e3, **paths("e3-two", features="features-e3-two"),
                                            "dist_timeout": 60}))
    assert_same_weights(root, "e3-one", "e3-two")
    la, lb = train_log(root, "e3-one"), train_log(root, "e3-two")
    assert [r["step"] for r in la] == [r["step"] for r in lb] and len(la) > STEPS
    for ra, rb in zip(la, lb):
        if "heldout" in ra:
            for d in ra["heldout"]:
                assert ra["heldout"][d] == pytest.approx(rb["heldout"][d], abs=1e-4)
        else:
            assert ra["blocks"] == rb["blocks"]
            for k in ("loss", "grad_norm", "ce@1", "acc@3"):
                assert ra[k] == pytest.approx(rb[k], abs=1e-4), (ra["step"], k)
    for d in ("math", "chat"):
        one, two = (torch.load(root / f / f"{d}-layers-0-1.pt", weights_only=True)
                    for f in ("features-e3-one", "features-e3-two"))
        assert one["layers"] == two["layers"] == [0, 1]
        for k in ("train", "heldout", "train_layers", "heldout_layers"):
            assert torch.equal(one[k], two[k]), (d, k)
        assert not list((root / "features-e3-two").glob("*.tmp"))  # the ranks' shares are removed
    m = json.loads((root / "out" / "e3-two" / "manifest.json").read_text())
    assert m["training"]["world_size"] == 2 and m["family"] == "eagle3"


def test_target_training_two_processes(tmp_path):
    """``taps train target`` on 2 processes under FSDP (micro-batches of 1 sequence, two per rank)
    matches 1 process."""
    from test_train_target import CHAT, MATH, conv

    from taps.train.target import TargetTrainConfig, token_data_from_examples, train_target
    from taps.files import sha256_file
    from taps.train.tokenizer import train_tokenizer

    tdir = tmp_path / "tok"
    tok = train_tokenizer((CHAT + MATH) * 20, tdir, vocab_size=300)
    examples = {"chat": [conv(i, CHAT, "chat") for i in range(60)], "math": [conv(i, MATH, "math") for i in range(60)]}
    flags = dict(tokenizer=tdir, preset="tiny", tokens=4 * 32 * 6, heldout_tokens=64, seq_len=32, batch_size=4,
                 grad_accum=4, lr=1e-2, min_lr=1e-3, warmup_steps=2, eval_every=3, threads=1, device="cpu",
                 quiet=True)
    cfg = TargetTrainConfig(**flags, run_dir=tmp_path / "one", out=tmp_path / "one-out")
    data = token_data_from_examples(examples, tok, tokens=cfg.tokens, math_fraction=0.5,
                                    heldout_tokens=cfg.heldout_tokens, seq_len=cfg.seq_len, seed=cfg.seed)
    train_target(cfg, data=data, tok=tok)
    # the 2-process run finds the same tokenized blocks in its run_dir's cache (data.pt)
    (tmp_path / "two").mkdir()
    data.info["key"] = {**cfg.data_key(), "tokenizer_sha256": sha256_file(tdir / "tokenizer.json")}
    torch.save(data.state(), tmp_path / "two" / "data.pt")
    torchrun("-m", "taps.train", *cli_args("target", **flags, run_dir=tmp_path / "two", out=tmp_path / "two-out",
                                           fsdp=True))
    one = torch.load(tmp_path / "one" / "checkpoint.pt", weights_only=True)["model"]
    two = torch.load(tmp_path / "two" / "checkpoint.pt", weights_only=True)["model"]
    assert max(float((one[k] - two[k]).abs().max()) for k in one) <= 1e-3
    m1, m2 = (json.loads((tmp_path / f / "manifest.json").read_text()) for f in ("one-out", "two-out"))
    assert m2["training"]["world_size"] == 2 and m2["training"]["backend"] == "gloo"
    assert m2["training"]["parallel"] == "fsdp" and m2["training"]["grad_accum"] == 4
    assert m2["final_heldout_loss"] == pytest.approx(m1["final_heldout_loss"], abs=1e-4)
    assert m2["final_train_loss"] == pytest.approx(m1["final_train_loss"], abs=1e-4)


def _worker_pid(agent: int, rank: int) -> int:
    """The pid of the torchrun worker of ``rank`` (a child of the agent process)."""
    kids = []
    for task in Path(f"/proc/{agent}/task").iterdir():
        kids += (task / "children").read_text().split()
    for pid in kids:
        env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        if f"RANK={rank}".encode() in env:
            return int(pid)
    raise AssertionError(f"no worker of rank {rank} among {kids}")


def _start_long_run(setup, name: str, timeout_s: float):
    """A 2-process EAGLE-2 run of 300 steps; returns (process, stderr file) once step 1 is logged."""
    root, paths = setup
    p = paths(name, features=f"features-{name}")
    args = cli_args("drafter", **{**DRAFTER, **p, "family": "eagle2", "tokens": 64 * 4 * 300, "eval_every": 0,
                                   "ckpt_minutes": 60, "dist_timeout": timeout_s})
    err = open(root / f"{name}.stderr", "w+")
    proc = subprocess.Popen(torchrun_command(2, WORKER, *args), env=job_env(), stdout=subprocess.DEVNULL, stderr=err)
    log = p["run_dir"] / "log.jsonl"
    t0 = time.time()
    while not (log.exists() and log.read_text().strip()):
        if proc.poll() is not None or time.time() - t0 > 240:
            proc.kill()
            err.seek(0)
            raise AssertionError(f"the run did not start training:\n{err.read()[-4000:]}")
        time.sleep(0.2)
    return proc, err, p


def _finish(proc, err, limit: float):
    t0 = time.time()
    try:
        code = proc.wait(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the job was still running {limit:.0f} s after the rank failed") from None
    err.seek(0)
    return code, time.time() - t0, err.read()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_killed_rank_ends_the_run(setup):
    """SIGKILL of rank 1 in the middle of training: the job exits with an error naming it within
    seconds, without exporting anything."""
    proc, err, p = _start_long_run(setup, "killed", 60)
    os.kill(_worker_pid(proc.pid, 1), signal.SIGKILL)
    code, waited, text = _finish(proc, err, 60)
    assert code != 0 and waited < 60
    assert re.search(r"rank\s*:\s*1\b.*\n\s*exitcode\s*:\s*-9\b.*SIGKILL", text), text[-3000:]
    assert not p["out"].exists()


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="finds the worker processes through /proc")
def test_stalled_rank_times_out(setup):
    """A rank that stops answering (SIGSTOP) fails the other rank's next collective after the
    --dist-timeout (5 s here) with an error that says so; the job then ends."""
    proc, err, p = _start_long_run(setup, "stalled", 5)
    stalled = _worker_pid(proc.pid, 1)
    os.kill(stalled, signal.SIGSTOP)
    t0 = time.time()
    try:
        while "another rank died or stalled" not in Path(err.name).read_text():
            assert proc.poll() is None and time.time() - t0 < 60, "no timeout error from rank 0"
            time.sleep(0.2)
        waited = time.time() - t0
    finally:
        os.kill(stalled, signal.SIGCONT)  # let torchrun's SIGTERM reach it
    code, _, text = _finish(proc, err, 60)
    assert code != 0 and 3 <= waited < 60, waited
    assert "CollectiveError: rank 0 of 2: a collective failed" in text and "Timed out" in text
    assert not p["out"].exists()
