"""The CPU kernels' instruction-set levels (csrc/cpu/cpu_isa.h): the level switch, and every op under every
level this CPU runs.

- cpu_info / set_cpu_isa / TAPS_CPU_ISA: fields, round trips, clear errors (unknown level, a level above the
  CPU's), in this process and at import in a child process.
- The same inputs through every level in one process (set_cpu_isa): rms_norm, rope_ and expand_level give
  the same bits at every level (their contract pins the bits), tree_attention agrees with the reference in
  fp32 / bf16 / fp16 at head dims that take each level's fast path and its Vec kernel, verify_tree's greedy
  walk gives the same tokens and its sampled walk with fixed coins matches the reference.
- The op suites run again in a child process under each lower level (TAPS_CPU_ISA), so every test of
  those files covers every path (the main run covers the CPU's own level; at the scalar level the suites of
  tree_attention, verify_tree and decoder_layer). On AMX hosts the AVX-512 level runs the tree_attention suite
  only: the two levels run the same code but for tree_attention's bf16 AMX path.
"""

import os
import subprocess
import sys

import pytest
import torch

import taps_ops
from sampling_checks import assert_matches_reference
from taps_ops.reference import (expand_level_ref, rms_norm_ref, rope_ref, tree_attention_dense_mask,
                                tree_attention_ref)

LEVELS = taps_ops.CPU_ISA_LEVELS
HOST = taps_ops.cpu_info()["host_isa"]
RUNNABLE = LEVELS[: LEVELS.index(HOST) + 1]
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def at_level():
    """set_cpu_isa for the test's duration, the level before it restored after."""
    before = taps_ops.cpu_info()["isa"]
    yield taps_ops.set_cpu_isa
    taps_ops.set_cpu_isa(before)


def test_cpu_info_fields():
    info = taps_ops.cpu_info()
    assert info["isa"] in LEVELS and info["host_isa"] in LEVELS
    assert LEVELS.index(info["isa"]) <= LEVELS.index(info["host_isa"])
    assert isinstance(info["native_bf16"], bool) and isinstance(info["cpu"], str) and info["cpu"]
    assert info["native_bf16"] == ("avx512_bf16" in info["features"] or "amx_bf16" in info["features"])
    assert set(info["ops"]) >= {"verify_tree", "tree_attention", "rms_norm", "rope_", "expand_level"}
    for level in info["ops"].values():
        assert LEVELS.index(level) <= LEVELS.index(info["isa"])
    if info["host_isa"] != "scalar":  # x86: the host level follows from the features
        assert "avx2" in info["features"] and "fma" in info["features"]
    if LEVELS.index(info["host_isa"]) >= LEVELS.index("avx512"):
        assert {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= set(info["features"])
    assert info["isa"] in info["summary"] and info["cpu"] in info["summary"]
    assert info["mkl_instructions"] == (os.environ.get("MKL_ENABLE_INSTRUCTIONS") or None)
    assert f"MKL: {info['mkl_instructions'] or 'host'}" in info["summary"]


def test_cpu_info_reports_mkls_limit(monkeypatch):
    """``MKL_ENABLE_INSTRUCTIONS`` (the limit of torch's float32 GEMMs, which the ATen and oneDNN switches leave
    alone) is in cpu_info and its summary, so a benchmark run as an AVX2-only CPU shows whether MKL was limited too."""
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    info = taps_ops.cpu_info()
    assert info["mkl_instructions"] == "AVX2" and "MKL: AVX2" in info["summary"]
    monkeypatch.delenv("MKL_ENABLE_INSTRUCTIONS")
    assert taps_ops.cpu_info()["mkl_instructions"] is None and "MKL: host" in taps_ops.cpu_info()["summary"]


@pytest.mark.parametrize("level", RUNNABLE)
def test_set_cpu_isa_round_trip(at_level, level):
    before = taps_ops.cpu_info()["isa"]
    assert at_level(level) == before
    info = taps_ops.cpu_info()
    assert info["isa"] == level
    assert info["ops"]["tree_attention"] == level
    assert info["ops"]["rms_norm"] == {"scalar": "scalar", "avx2": "avx2"}.get(level, "avx512")
    assert info["ops"]["expand_level"] == ("scalar" if level == "scalar" else "avx2")


def test_set_cpu_isa_errors(at_level):
    with pytest.raises(ValueError, match="must be one of"):
        at_level("avx1024")
    if HOST != LEVELS[-1]:
        above = LEVELS[LEVELS.index(HOST) + 1]
        with pytest.raises(ValueError, match="runs at most"):
            at_level(above)
    assert taps_ops.cpu_info()["isa"] in RUNNABLE


def test_peak_flops_measured_at_each_level():
    """The benchmarks' measured peak: one core's fp32 multiply-add rate, wider vectors at least as fast
    (within the noise of a shared machine), levels above the host's and unknown ones refused."""
    rates = {lv: torch.ops.taps_ops._cpu_peak_flops(lv) for lv in RUNNABLE}
    assert all(r > 1e8 for r in rates.values()), rates
    if "avx2" in rates:
        assert rates["avx2"] > 0.5 * rates["scalar"], rates
    with pytest.raises(ValueError, match="must be one of|not an instruction-set level"):
        torch.ops.taps_ops._cpu_peak_flops("avx1024")
    if HOST != LEVELS[-1]:
        with pytest.raises(ValueError, match="runs at most"):
            torch.ops.taps_ops._cpu_peak_flops(LEVELS[LEVELS.index(HOST) + 1])


def _import_with(level: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, TAPS_CPU_ISA=level)
    return subprocess.run([sys.executable, "-c", "import taps_ops; print(taps_ops.cpu_info()['isa'])"],
                          env=env, capture_output=True, text=True, timeout=120)


def test_env_level_chosen_at_load():
    out = _import_with("scalar")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "scalar"


def test_env_bad_level_fails_at_import_with_one_clear_error():
    out = _import_with("sse9")
    assert out.returncode != 0
    assert "ValueError: taps_ops: TAPS_CPU_ISA = 'sse9' is not an instruction-set level" in out.stderr
    if HOST != LEVELS[-1]:
        out = _import_with(LEVELS[LEVELS.index(HOST) + 1])
        assert out.returncode != 0 and "runs at most" in out.stderr


# ---- the same inputs through every level ------------------------------------------------------------------

def _per_level(at_level, fn):
    """fn() at every runnable level -> {level: result}."""
    out = {}
    for level in RUNNABLE:
        at_level(level)
        out[level] = fn()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_elementwise_ops_same_bits_at_every_level(at_level, dtype):
    x = torch.randn(37, 203, dtype=dtype)
    w = torch.randn(203, dtype=dtype)
    norms = _per_level(at_level, lambda: taps_ops.rms_norm(x, w, 1e-6))
    rot = torch.randn(3, 5, 4, 38, dtype=dtype)
    cos, sin = torch.randn(3, 5, 1, 38, dtype=dtype), torch.randn(3, 5, 1, 38, dtype=dtype)

    def rope():
        y = rot.clone()
        taps_ops.rope_(y, cos, sin)
        return y
    ropes = _per_level(at_level, rope)
    logits = torch.randn(3, 5, 1001, dtype=dtype)
    scores, cands = torch.randn(3, 5), torch.randint(-1, 9, (3, 5))
    levels = _per_level(at_level, lambda: taps_ops.expand_level(logits, scores, cands, 4, next_k=7,
                                                                with_entropy=True))
    first = RUNNABLE[0]
    for level in RUNNABLE[1:]:
        assert torch.equal(norms[level], norms[first]), level
        assert torch.equal(ropes[level], ropes[first]), level
        for a, b in zip(levels[level], levels[first]):
            assert torch.equal(a, b), level
    # and the values are the references' (their bit-level agreement is tested in the ops' own suites)
    torch.testing.assert_close(norms[first], rms_norm_ref(x, w, 1e-6))
    torch.testing.assert_close(ropes[first], rope_ref(rot, cos, sin))
    ref = expand_level_ref(logits, scores, cands, 4, next_k=7, with_entropy=True)
    assert torch.equal(levels[first].tokens, ref.tokens) and torch.equal(levels[first].next_cands, ref.next_cands)


def _random_tree_mask(batch, nodes):
    words = (nodes + 63) // 64
    mask = torch.zeros(batch, nodes, words, dtype=torch.int64)
    for b in range(batch):
        rows = [1]
        for i in range(1, nodes):
            rows.append(rows[int(torch.randint(0, i, ()))] | (1 << i))
        for i, r in enumerate(rows):
            for w in range(words):
                word = (r >> (64 * w)) & ((1 << 64) - 1)
                mask[b, i, w] = word - (1 << 64) if word >= (1 << 63) else word
    return mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("head_dim", [8, 24, 36, 64, 80])  # 8, 24: AVX2 fast path only; 36: Vec kernels
# rows a KV head (G N): 10, 210, 2, 64 (AVX2: the last that takes attend_keys, the tree across two tiles), 66
@pytest.mark.parametrize("shape", [(2, 4, 2, 5, 131), (1, 3, 1, 70, 300), (3, 6, 3, 1, 65), (2, 2, 2, 64, 200),
                                   (1, 2, 1, 33, 150)])
def test_tree_attention_matches_reference_at_every_level(at_level, dtype, head_dim, shape):
    batch, hq, hkv, nodes, cache = shape
    q = torch.randn(batch, hq, nodes, head_dim, dtype=dtype)
    k = torch.randn(batch, hkv, cache, head_dim, dtype=dtype)
    v = torch.randn(batch, hkv, cache, head_dim, dtype=dtype)
    mask = _random_tree_mask(batch, nodes)
    kv_lens = torch.randint(nodes, cache + 1, (batch,))
    kv_lens[0] = cache
    scale = head_dim ** -0.5
    exact = tree_attention_ref(q.double(), k.double(), v.double(), mask, kv_lens, scale)
    plain = tree_attention_ref(q, k, v, mask, kv_lens, scale)  # the plain-PyTorch error in this dtype
    # twice the plain error, plus one rounding of the output to the dtype and fp32 accumulation
    bound = (2 * (plain.double() - exact).abs().max().item() + torch.finfo(dtype).eps * exact.abs().max().item()
             + 1e-5)
    outs = _per_level(at_level, lambda: taps_ops.tree_attention(q, k, v, mask, kv_lens, scale))
    for level, out in outs.items():
        assert out.dtype == dtype and out.shape == q.shape
        err = (out.double() - exact).abs().max().item()
        assert err <= bound, f"{level}: error {err:.3g} > {bound:.3g}"


def test_tree_attention_long_split_keys_at_every_level(at_level):
    # one request, few heads: the keys are split across threads and merged by log-sum-exp
    q = torch.randn(1, 2, 3, 64)
    k, v = torch.randn(1, 1, 3000, 64), torch.randn(1, 1, 3000, 64)
    mask = _random_tree_mask(1, 3)
    kv_lens = torch.tensor([2999])
    dense = tree_attention_dense_mask(mask, kv_lens, 3000)[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(q, k.expand(1, 2, 3000, 64), v.expand(1, 2, 3000, 64),
                                                                attn_mask=dense)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        outs = _per_level(at_level, lambda: taps_ops.tree_attention(q, k, v, mask, kv_lens))
    finally:
        torch.set_num_threads(before)
    for level, out in outs.items():
        torch.testing.assert_close(out, expected, atol=2e-5, rtol=2e-5, msg=level)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_verify_tree_agrees_at_every_level(at_level, dtype):
    batch, nodes, vocab = 4, 9, 3001  # odd vocabulary: every vector tail
    logits = (torch.randn(batch, nodes, vocab) * 3).to(dtype)
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2, 3, 3, 6]] * batch)
    tokens = torch.randint(0, vocab, (batch, nodes))
    tokens[:, 1] = logits[:, 0].float().argmax(-1)  # the greedy walk goes at least one level deep
    greedy = _per_level(at_level, lambda: taps_ops.verify_tree(logits, tokens, parents))
    coins = torch.rand(batch, nodes)
    sampled = _per_level(at_level, lambda: taps_ops.verify_tree(logits, tokens, parents, temperature=0.8, top_k=50,
                                                                top_p=0.9, uniforms=coins))
    ref = taps_ops.reference.verify_tree_ref(logits, tokens, parents, temperature=0.8, top_k=50, top_p=0.9,
                                            uniforms=coins)
    first = RUNNABLE[0]
    for level in RUNNABLE:
        for a, b in zip(greedy[level], greedy[first]):
            assert torch.equal(a, b), level
        assert torch.equal(sampled[level].tokens, ref[0]), level
        assert torch.equal(sampled[level].num_accepted, ref[1]), level


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_verify_tree_drawn_children_agree_at_every_level(at_level, dtype):
    """Drawn children (draft_probs): the residual passes after a rejection (vectorised per level, the block skip
    of the draw past the children across a 2,048-token block edge) give the reference's tokens at every level,
    chains of one child and siblings of three, requests with no child accepted, some, and all."""
    gen = torch.Generator().manual_seed(5)
    batch, vocab = 24, 4999
    parents = torch.tensor([[-1, 0, 1, 2, 0, 0, 4, 5]] * batch)
    logits = torch.randn(batch, 8, vocab, generator=gen) * 2
    tokens = torch.randint(0, vocab, (batch, 8), generator=gen)
    for b in range(0, batch, 2):  # half the requests: the draft's tokens likely under the target
        for i in range(1, 8):
            logits[b, parents[0, i], tokens[b, i]] += 6.0
    logits = logits.to(dtype)
    draft = torch.softmax(torch.randn(batch, 8, vocab, generator=gen) * 3, -1)
    draft.scatter_add_(2, tokens.roll(-1, 1).unsqueeze(-1), torch.full((batch, 8, 1), 0.4))
    draft = draft / draft.sum(-1, keepdim=True)
    coins = torch.rand(batch, 8, generator=gen)
    outs = _per_level(at_level, lambda: taps_ops.verify_tree(logits, tokens, parents, temperature=0.9,
                                                             draft_probs=draft, uniforms=coins))
    args, kwargs = (logits, tokens, parents), dict(temperature=0.9, draft_probs=draft, uniforms=coins)
    accepted = set()
    for level in RUNNABLE:
        accepted |= set(assert_matches_reference(outs[level], args, kwargs).tolist())
    assert {0, 1} <= accepted and max(accepted) >= 2, accepted


# ---- the op suites under each lower level ---------------------------------------------------------------

OP_SUITES = ["test_tree_attention.py", "test_verify_tree.py", "test_rms_norm.py", "test_rope.py",
             "test_expand_level.py", "test_decoder_layer.py", "test_lean.py", "test_panel_linear.py"]
# the scalar level: the suites of the ops whose scalar code differs in more than vector width (the
# elementwise ops' bits are compared across every level above)
SCALAR_SUITES = ["test_tree_attention.py", "test_verify_tree.py", "test_decoder_layer.py"]
# on an AMX host the avx512 level runs the same code as amx but for tree_attention's bf16 calls that take AMX
# (head dims >= 64 with >= 16 query rows per KV head): only that suite runs there
AMX_HOST_AVX512_SUITES = ["test_tree_attention.py"]
LOWER = RUNNABLE[:-1]


@pytest.mark.parametrize("level", LOWER)
def test_op_suites_pass_under_lower_level(level):
    env = dict(os.environ, TAPS_CPU_ISA=level)
    suites = (SCALAR_SUITES if level == "scalar" else AMX_HOST_AVX512_SUITES if level == "avx512" and HOST == "amx"
              else OP_SUITES)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider",
                          *[os.path.join(TESTS, f) for f in suites]],
                         env=env, capture_output=True, text=True, timeout=900, cwd=TESTS)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout
