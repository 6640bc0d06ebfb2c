"""taps_ops.pack_head_screen / head_argmax: the argmax of panel_linear(x, panels) from an int8 screen (CPU).

- The same ids as ``panel_linear(x, panels).argmax(-1)`` (ties to the lowest id) at every ISA level this CPU
  runs, for float32 panels, bfloat16 panels with float32 x and with bfloat16 x (bf16 logits, whose rounding
  makes near ties exact ties), on random inputs of odd sizes with planted exact and near ties, peaked rows,
  rows the screen cannot take (all zero, not finite) and flat heads (too many candidates: the full product).
- The screen's layout and meta by their definition; x of any leading shape; the empty case.
- Bad inputs raise ValueError starting "taps_ops: head_argmax:" / "taps_ops: pack_head_screen:", fuzzed.
- Greedy verification through it (``TargetForward.verify``) equals the full logits' (lazy, full and packed).
"""

import random

import pytest
import torch

import taps_ops

LEVELS = taps_ops.CPU_ISA_LEVELS
RUNNABLE = LEVELS[: LEVELS.index(taps_ops.cpu_info()["host_isa"]) + 1]
PAIRS = [(torch.float32, torch.float32), (torch.bfloat16, torch.float32), (torch.bfloat16, torch.bfloat16)]


@pytest.fixture
def restore_level():
    before = taps_ops.cpu_info()["isa"]
    yield
    taps_ops.set_cpu_isa(before)


def _head(out, inner, gen, wdtype):
    w = torch.randn(out, inner, generator=gen) * 0.05
    w[3] = 0                                              # a zero row: logit exactly 0
    for _ in range(3):                                    # exact ties (later id copies an earlier one) ...
        a, b = sorted(torch.randint(0, out, (2,), generator=gen).tolist())
        w[b] = w[a]
        c = int(torch.randint(0, out, (1,), generator=gen))  # ... and near ties
        w[c] = w[a] * (1 + 2 ** -20)
    return w.to(wdtype)


def _check(x, w):
    panels = taps_ops.pack_panels(w)
    screen, meta = taps_ops.pack_head_screen(w)
    want = taps_ops.panel_linear(x, panels).argmax(-1)
    got = taps_ops.head_argmax(x, screen, meta, panels)
    assert got.dtype == torch.int64 and got.shape == x.shape[:-1]
    assert torch.equal(got, want), (got, want)


@pytest.mark.parametrize("level", RUNNABLE)
@pytest.mark.parametrize("wdtype,xdtype", PAIRS)
def test_equals_the_full_products_argmax(level, wdtype, xdtype, restore_level):
    taps_ops.set_cpu_isa(level)
    gen = torch.Generator().manual_seed(LEVELS.index(level) * 10 + PAIRS.index((wdtype, xdtype)))
    for trial in range(12):
        out = 16 * int(torch.randint(20, 70, (1,), generator=gen))
        inner = int(torch.randint(1, 300, (1,), generator=gen))
        w = _head(out, inner, gen, wdtype)
        x = torch.randn(9, inner, generator=gen) * 2
        x[0] = w[int(torch.randint(0, out, (1,), generator=gen))].float() * 20   # a peaked row
        x[1] = 0                                                                 # not screened: full product
        x[2, 0] = float("nan")
        x[3, -1] = float("inf")
        x[4] = 1e-3
        x[5] *= 1e4
        x[6] = 0
        x[6, 0] = 1.0                                                            # one input
        _check(x.to(xdtype), w)


@pytest.mark.parametrize("level", RUNNABLE)
def test_exact_ties_go_to_the_lowest_id_and_flat_heads_fall_back(level, restore_level):
    taps_ops.set_cpu_isa(level)
    gen = torch.Generator().manual_seed(7)
    w = torch.randn(64, 24, generator=gen)
    w[40] = w[9]
    w[9 + 16] = w[9]
    x = (w[9] * 3).unsqueeze(0)
    for wdtype, xdtype in PAIRS:
        panels = taps_ops.pack_panels(w.to(wdtype))
        screen, meta = taps_ops.pack_head_screen(w.to(wdtype))
        assert taps_ops.head_argmax(x.to(xdtype), screen, meta, panels).tolist() == [9]
    # every output within the bound of the best (more than 256 candidates): the full product's argmax
    flat = (torch.full((1024, 40), 0.01) + torch.randn(1024, 40, generator=gen) * 1e-7)
    for wdtype, xdtype in PAIRS:
        _check(torch.randn(3, 40, generator=gen).to(xdtype), flat.to(wdtype))


def test_agrees_with_the_float64_reference_where_the_top_two_are_apart():
    from taps_ops.reference import head_argmax_ref

    gen = torch.Generator().manual_seed(11)
    w = torch.randn(320, 45, generator=gen)
    screen, meta = taps_ops.pack_head_screen(w)
    panels = taps_ops.pack_panels(w)
    x = torch.randn(64, 45, generator=gen)
    exact = x.double() @ w.double().t()
    top2 = exact.topk(2, -1).values
    apart = (top2[:, 0] - top2[:, 1]) > 1e-4
    assert int(apart.sum()) > 50
    got = taps_ops.head_argmax(x, screen, meta, panels)
    assert torch.equal(got[apart], head_argmax_ref(x, screen, meta, panels)[apart])


def test_shapes_and_the_empty_case():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(48, 10, generator=gen)
    for shape in [(10,), (2, 3, 10), (0, 10)]:
        _check(torch.randn(*shape, generator=gen), w)
    # bfloat16 panels take an x one input narrower than an even-width weight (its last pair's low half only):
    # the screen's column past x counts as x = 0 (found by the fuzz below)
    wide = torch.randn(48, 30, generator=gen).bfloat16() * 4
    for xdtype in (torch.float32, torch.bfloat16):
        for _ in range(20):
            _check(torch.randn(4, 29, generator=gen).to(xdtype), wide)


@pytest.mark.parametrize("inner", [1, 4, 5, 13])
def test_the_screen_holds_what_it_says(inner):
    gen = torch.Generator().manual_seed(inner)
    w = torch.randn(32, inner, generator=gen)
    w[5] = 0
    screen, meta = taps_ops.pack_head_screen(w)
    groups = (inner + 3) // 4
    assert screen.dtype == torch.int8 and screen.shape == (2, groups, 16, 4) and screen.is_contiguous()
    scale = w.abs().amax(1) / 127
    q = torch.where(scale.unsqueeze(1) > 0, torch.round(w.double() / scale.double().unsqueeze(1)), 0).to(torch.int8)
    for p in range(2):
        for g in range(groups):
            for o in range(16):
                for k in range(4):
                    want = int(q[16 * p + o, 4 * g + k]) if 4 * g + k < inner else 0
                    assert int(screen[p, g, o, k]) == want
    torch.testing.assert_close(meta[0], scale)
    assert torch.equal(meta[1], q.sum(1).float()) and torch.equal(meta[2], q.abs().sum(1).float())
    assert int(q.abs().max()) == 127


def _valid():
    w = torch.randn(32, 12)
    screen, meta = taps_ops.pack_head_screen(w)
    return dict(x=torch.randn(3, 12), screen=screen, meta=meta, panels=taps_ops.pack_panels(w))


BAD = {
    "x dtype": (lambda a: a.update(x=a["x"].double()), "x must be float32 or bfloat16"),
    "x dtype bf16 panels": (lambda a: a.update(x=a["x"].double(), panels=taps_ops.pack_panels(torch.randn(32, 12),
                                                                                             torch.bfloat16)),
                            "x must be float32 or bfloat16"),
    "x bf16 over fp32 panels": (lambda a: a.update(x=a["x"].bfloat16()),
                                "float32 panels must be \\[out / 16, in, 16\\] .* over float32 x"),
    "x width": (lambda a: a.update(x=torch.randn(3, 17)), "does not match the screen's ceil"),
    "x scalar": (lambda a: a.update(x=torch.tensor(1.0)), "at least 1 dimension"),
    "screen dtype": (lambda a: a.update(screen=a["screen"].to(torch.uint8)), "screen must be a contiguous int8"),
    "screen shape": (lambda a: a.update(screen=a["screen"][:, :, :8]), "screen must be a contiguous int8"),
    "screen strides": (lambda a: a.update(screen=a["screen"].transpose(0, 1)), "screen must be a contiguous int8"),
    "meta shape": (lambda a: a.update(meta=a["meta"][:2]), "meta must be float32 \\[3, out\\]"),
    "meta width": (lambda a: a.update(meta=a["meta"][:, :16]), "meta must be float32 \\[3, out\\]"),
    "meta dtype": (lambda a: a.update(meta=a["meta"].double()), "meta must be float32 \\[3, out\\]"),
    "panels count": (lambda a: a.update(panels=taps_ops.pack_panels(torch.randn(48, 12))), "panels must hold"),
    "panels dtype": (lambda a: a.update(panels=a["panels"].double()), "panels must be float32"),
    "x not a tensor": (lambda a: a.update(x=[1.0] * 12), "x must be a tensor"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_inputs_raise_clear_errors(case):
    args = _valid()
    taps_ops.head_argmax(**args)
    mutate, message = BAD[case]
    mutate(args)
    with pytest.raises(ValueError, match="taps_ops: head_argmax: .*" + message):
        taps_ops.head_argmax(**args)


def test_fuzzed_bad_inputs_raise_value_errors_never_crash():
    """Random mutations of a valid call: each works (and equals the full product's argmax) or raises a clear
    ValueError; none crashes or reads out of bounds."""
    rng = random.Random(0)
    for _ in range(300):
        out, inner, rows = 16 * rng.randint(1, 5), rng.randint(1, 40), rng.randint(0, 5)
        w = torch.randn(out, inner).to(rng.choice([torch.float32, torch.bfloat16]))
        screen, meta = taps_ops.pack_head_screen(w)
        panels = taps_ops.pack_panels(w)
        x = torch.randn(rows, inner + rng.choice([0, 0, 0, 1, -1, 4]))
        if rng.random() < 0.3:
            x = x.to(rng.choice([torch.bfloat16, torch.float16, torch.float64]))
        if rng.random() < 0.15:
            screen = screen[: rng.randint(0, screen.shape[0])]
        if rng.random() < 0.1:
            screen = screen.view(-1)
        if rng.random() < 0.15:
            meta = meta[:, : rng.randint(0, meta.shape[1])]
        own = True
        if rng.random() < 0.1:  # another weight's panels: the result is only checked for its shape
            panels, own = taps_ops.pack_panels(torch.randn(16 * rng.randint(1, 5), inner)), False
        try:
            got = taps_ops.head_argmax(x, screen, meta, panels)
        except ValueError as e:
            assert str(e).startswith("taps_ops: head_argmax:"), str(e)
            continue
        want = taps_ops.panel_linear(x, panels).argmax(-1)
        assert got.shape == want.shape and (not own or torch.equal(got, want))


def test_other_devices_raise_a_clear_error():
    args = _valid()
    for name in ("x", "screen", "meta", "panels"):
        moved = dict(args, **{name: args[name].to("meta")})
        with pytest.raises(ValueError, match=f"taps_ops: head_argmax: a CPU op, got {name} on meta"):
            taps_ops.head_argmax(**moved)


@pytest.mark.parametrize("case", ["2-D", "out", "dtype", "nan"])
def test_pack_head_screen_rejects_what_it_cannot_lay_out(case):
    weight = {"2-D": torch.randn(2, 16, 4), "out": torch.randn(40, 8), "dtype": torch.randn(32, 8).double(),
              "nan": torch.full((32, 8), float("nan"))}[case]
    with pytest.raises(ValueError, match="taps_ops: pack_head_screen:"):
        taps_ops.pack_head_screen(weight)


def test_fake_tensor_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode
    args = _valid()
    with FakeTensorMode(allow_non_fake_inputs=True):
        y = torch.ops.taps_ops.head_argmax(torch.empty(2, 7, 12), args["screen"], args["meta"], args["panels"])
    assert y.shape == (2, 7) and y.dtype == torch.int64


@pytest.mark.parametrize("sample", [dict(temperature=0.0), dict(temperature=torch.zeros(5))])
@torch.no_grad()
def test_greedy_verification_through_the_screen_equals_the_full_logits(sample, monkeypatch):
    """TargetForward.verify at temperature 0 with a float32 head kept as panels takes its argmax from the
    screen (lazy, full and packed); the result equals the full logits' walk (the screen switched off)."""
    import transformers

    from taps import hf, lean
    from taps.forward import TargetForward

    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    torch.manual_seed(0)
    fwd = TargetForward(hf.use_taps_attention(transformers.LlamaForCausalLM(cfg).eval()))
    fwd.new_cache(1, 8)
    fwd.head.panels = taps_ops.pack_panels(fwd.head.weight.detach().float())
    calls = []
    real = lean.Linear.argmax
    monkeypatch.setattr(lean.Linear, "argmax", lambda self, x: calls.append(x.shape[0]) or real(self, x))
    gen = torch.Generator().manual_seed(4)
    batch, num = 5, 20
    hidden = torch.randn(batch, num, 32, generator=gen) * 4
    logits = fwd.logits(hidden)
    parents = torch.full((batch, num), -1)
    tokens = torch.full((batch, num), -1)
    for b in range(batch):  # children on the target's most likely tokens, so that walks go deep and off chains
        tokens[b, 0] = 1
        for i in range(1, num - b):
            parents[b, i] = int(torch.randint(max(0, i - 3), i, (1,), generator=gen))
        for p in range(num - b):
            kids = [i for i in range(1, num - b) if parents[b, i] == p]
            ranked = logits[b, p].argsort(descending=True).tolist()
            for rank, i in zip(torch.randperm(len(kids), generator=gen).tolist(), kids):
                tokens[b, i] = ranked[rank]
    slots = torch.nonzero((tokens >= 0).view(-1)).view(-1)
    packed = (slots, hidden.view(batch * num, -1).index_select(0, slots))
    deep = 0
    for lazy, pack in ((False, None), (True, None), (False, packed), (None, None)):
        uniforms = torch.rand(batch, num, generator=gen)
        monkeypatch.setattr(lean, "HEAD_SCREEN", False)
        want = fwd.verify(hidden, tokens, parents, lazy=lazy, uniforms=uniforms, packed=pack, **sample)
        monkeypatch.setattr(lean, "HEAD_SCREEN", True)
        calls.clear()
        got = fwd.verify(hidden, tokens, parents, lazy=lazy, uniforms=uniforms, packed=pack, **sample)
        assert calls, "the screen was not used"
        for a, b in zip(want, got):
            assert torch.equal(a, b)
        deep = max(deep, int(want.num_accepted.max()))
    assert deep >= 3
    # the one-hot grid is left zeroed for the next call
    assert fwd._onehot is not None and not bool(fwd._onehot.any())
    # sampling (temperature > 0) never uses the screen
    calls.clear()
    fwd.verify(hidden, tokens, parents, uniforms=torch.rand(batch, num, generator=gen), temperature=1.0)
    assert not calls


@torch.no_grad()
def test_greedy_decoding_of_the_shipped_target_is_the_same_through_the_screen(monkeypatch):
    """fp32 shipped target, its head kept as panels: autoregressive and token-store decoding at temperature 0
    give the same tokens with the screen as without, and the screen ran."""
    from taps import PromptLookupDrafter, SpeculativeDecoder, lean, models
    from taps.data import load_eval_prompts

    target, tok = models.load_target(dtype=torch.float32)
    prompts = [tok.encode_chat(ex.messages, add_generation_prompt=True)
               for b in ("gsm8k", "mt_bench") for ex in load_eval_prompts(b)[:1]]
    calls = []
    real = lean.Linear.argmax
    monkeypatch.setattr(lean.Linear, "argmax", lambda self, x: calls.append(1) or real(self, x))
    for drafters, strategy in (([], "autoregressive"), ([PromptLookupDrafter(store=models.load_store())], "single")):
        dec = SpeculativeDecoder(target, drafters, strategy=strategy)
        dec.generate([prompts[0]], max_new_tokens=2)
        if dec.forward.head.panels is None:   # (the layout is timed per machine: give it panels)
            dec.forward.head.panels = taps_ops.pack_panels(dec.forward.head.weight)
        outs = {}
        for screen in (False, True):
            monkeypatch.setattr(lean, "HEAD_SCREEN", screen)
            calls.clear()
            outs[screen] = [dec.generate([p], max_new_tokens=40, eos_token_id=tok.eos_id).tokens[0] for p in prompts]
            assert bool(calls) == screen
        assert outs[False] == outs[True]


@torch.no_grad()
def test_bf16_heads_use_the_screen_only_without_bf16_dot_products(monkeypatch, restore_level):
    """A widened bf16 head over bf16 panels (bf16 logits): greedy verification takes the screen's argmax at the
    avx2 level (no AVX512-BF16 dot products there), with the full logits' result; float32 x always can."""
    from taps import lean

    gen = torch.Generator().manual_seed(8)
    head = lean.Linear(torch.randn(96, 32, generator=gen).bfloat16().float())
    head.widened, head.half = True, torch.bfloat16
    head.panels = taps_ops.pack_panels(head.weight, torch.bfloat16)
    x = torch.randn(6, 32, generator=gen).bfloat16()
    assert head.screens(x.float())
    taps_ops.set_cpu_isa("avx2")
    assert head.screens(x)
    assert torch.equal(head.argmax(x), head(x).argmax(-1))
    taps_ops.set_cpu_isa("scalar")
    assert not head.screens(x) and not head.screens(x.float())
    monkeypatch.setattr(lean, "_BF16_DOT", True)
    for level in RUNNABLE:
        taps_ops.set_cpu_isa(level)
        assert head.screens(x) == (level == "avx2")
