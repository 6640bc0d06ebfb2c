"""Lean forward passes over the weights of Llama-family decoders: the decoding engine's hot path.

A Hugging Face module call costs far more host time than a small model's arithmetic: one forward of the
shipped 4-layer target takes about 4 ms through ``model(...)`` whatever the token count, while its layers'
own operations take a fraction of that. Speculative decoding runs a target forward, a drafter cache update
and ``depth - 1`` drafter expansions per step, so that overhead decides its speed. This module runs the
same arithmetic with a minimum of operations:

- :class:`LayerWeights` / :func:`decoder_layer`: one Llama decoder layer (RMSNorm, q/k/v projections with
  optional biases and Qwen3's per-head q/k norms, rotary embedding, attention through a callback, o
  projection, SiLU MLP), written once and shared by the target, the small-LM drafters and the EAGLE heads;
  :func:`eagle3_layer`: the EAGLE-3 head's layer (attention over [normed embedding, normed hidden]), the
  same body, run by the EAGLE-3 drafter's inference and its training alike (:mod:`taps.drafters.eagle3`).
- :class:`Linear` and :class:`Norm` hold either one weight set (the module's own parameters, no copy) or
  ``G`` weight sets of the same shape stacked into one tensor, so that ``G`` drafters run as one batched
  forward (``torch.bmm``): activations are then ``[G, R, features]`` with the drafters' rows group-major.
- :class:`RopeTable`: cos/sin rows computed once by the model's own rotary module for positions
  ``0 .. P-1`` and indexed per call, so positions cost one gather instead of a trigonometric evaluation.
- With autograd off, the norms and the rotary embedding run as one-pass ops (``taps_ops.rms_norm``,
  ``taps_ops.rope_``: Hugging Face's arithmetic, rope_ bit for bit, rms_norm up to the order of its sum)
  instead of the five to eight torch operators of their composite forms.
- :class:`LeanCausalLM`: a whole causal LM (embedding, layers, final norm, lm_head) over a Hugging Face
  model's parameters, for the target and for :class:`taps.drafters.ModelDrafter`.

The Hugging Face model stays the source of truth: the weights are the module's own parameters (a change
to them is seen at once; stacked copies are rebuilt when a source parameter changes, see
:func:`stack_key`), the rotary values come from its rotary module, and the arithmetic follows its forward
step for step (RMSNorm in float32 then cast, as Hugging Face does), so the lean path's logits equal the
module's up to the attention kernel's rounding (tested in tests/test_lean.py). :func:`lean_support`
says why a model cannot take the lean path; the engine then uses :mod:`taps.hf` instead.
"""

from __future__ import annotations

import os
import time
from typing import Callable, List, Optional, Sequence, Tuple, Union

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import taps_ops

__all__ = ["Linear", "Norm", "LayerWeights", "RopeTable", "decoder_layer", "eagle3_layer", "LeanCausalLM",
           "lean_support", "stack_key", "pack_weight", "SUPPORTED_ARCHITECTURES"]

#: Hugging Face causal-LM classes whose forward the lean path reproduces.
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
#: activation dtypes whose RMSNorm runs as one taps_ops.rms_norm call (its float16 path is correct but
#: slow on the CPU, and float16 decoding on the CPU is rare)
_FUSED_NORM_DTYPES = (torch.float32, torch.bfloat16)
#: widest q + k row (heads x head dim) whose bfloat16 / float16 rotary embedding runs as one taps_ops.rope_
#: call: the op's half-precision rounding is scalar-heavy on the CPU, faster than the five-operator torch
#: form at decoding's sizes (12 x 32: 8.8 vs 15.4 us) but slower on wide rows (40 x 128, 32 tokens: 147 vs
#: 117 us; bench/bench_rope.py); float32 always takes the op (20 vs 89 us there)
_FUSED_ROPE_HALF_WIDTH = 1024
_RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")


def as_dtype(t: Tensor, dtype: torch.dtype) -> Tensor:
    """``t.to(dtype)``, skipping the call (about 1 us in a decoding step) when t already has that dtype."""
    return t if t.dtype == dtype else t.to(dtype)


def stack_key(params: Sequence[Tensor]) -> Tuple:
    """Identity of a set of parameters' current values: (data pointer, version counter) of each. Changes
    when a parameter is moved, cast or updated in place (an optimizer step), so stacked copies built from
    them can be rebuilt exactly when needed."""
    return tuple((p.data_ptr(), p._version) for p in params)


class Linear:
    """``y = x W^T + b`` for one weight set, or for G stacked sets (then x is [G, R, in] and each group
    uses its own weights).

    Args:
        weights: one [out, in] weight (used as it is) or a list of G of them (stacked into [G, in, out]).
        biases: matching bias(es) or None.
    """

    __slots__ = ("weight", "bias", "stacked", "packed", "widened", "half", "transposed", "panels", "screen")

    def __init__(self, weights, biases=None):
        self.packed = None
        self.widened = False
        self.half: Optional[torch.dtype] = None   # a widened weight's own dtype (its values are exact in it)
        self.transposed: Optional[Tensor] = None  # [in, out] contiguous: products as x @ W^T laid out NN
        self.panels: Optional[Tensor] = None      # taps_ops.pack_panels copy: products by taps_ops.panel_linear
        self.screen: Optional[Tuple[Tensor, Tensor]] = None  # taps_ops.pack_head_screen, built by argmax()
        if isinstance(weights, (list, tuple)):
            if len(weights) == 1:
                weights, biases = weights[0], (biases[0] if biases is not None else None)
            else:
                self.stacked = True
                self.weight = torch.stack([w.detach().t() for w in weights]).contiguous()  # [G, in, out]
                self.bias = None
                if biases is not None and biases[0] is not None:
                    self.bias = torch.stack([b.detach() for b in biases]).unsqueeze(1).contiguous()  # [G, 1, out]
                return
        self.stacked = False
        self.weight = weights
        self.bias = biases

    @staticmethod
    def concat(parts: Sequence["Linear"]) -> "Linear":
        """One Linear computing ``cat([p(x) for p in parts], -1)`` (weights concatenated along the output
        features: a copy; bias zeros where a part has none)."""
        stacked = parts[0].stacked
        out_dim = -1 if stacked else 0
        weight = torch.cat([p.weight.detach() for p in parts], dim=out_dim).contiguous()
        fused = Linear(weight)
        fused.stacked = stacked
        if any(p.bias is not None for p in parts):
            biases = [p.bias.detach() if p.bias is not None else
                      p.weight.new_zeros((*p.weight.shape[:-2], 1, p.weight.shape[-1]) if stacked else p.weight.shape[0])
                      for p in parts]
            fused.bias = torch.cat(biases, dim=-1).contiguous()
        return fused

    def pack(self, choose_layout: bool = False) -> "Linear":
        """On the CPU, keep a copy of the weight in oneDNN's blocked layout (:func:`pack_weight`), so that
        calls skip re-laying it out (inference only: the packed path is used with autograd off).

        On a CPU without hardware bf16 / fp16 matrix products (``taps_ops.native_half_matmul``), a weight of
        that dtype is widened to float32 (exact) and kept so: each call then widens x, multiplies in float32
        and rounds the result to x's dtype, as the emulated half-precision kernels would (they accumulate
        in float32 too) at the float32 kernels' speed instead of several times slower. On a CPU with them, a
        bfloat16 weight is widened so too, and kept as bfloat16 panels, where those are faster there than
        oneDNN's bf16 kernel (:meth:`_native_half_panels_pay`): one layout for every row count, so that a tree's
        products give the bits of a plain step's.

        ``choose_layout`` (a large float32 head called from Python: a tree's rows at once): the weight's
        layouts are timed on this machine at 1 and 8 rows (the packed copy, the [out, in] weight as it is,
        an [in, out] transposed copy and taps' own panels, :func:`taps_ops.panel_linear`) and the fastest
        kept (:func:`fastest_layout`): which BLAS kernel a few rows get differs between CPUs and instruction
        sets by up to 2x."""
        half_panels = False
        if self.weight.device.type == "cpu" and self.weight.dtype in (torch.bfloat16, torch.float16):
            native = taps_ops.native_half_matmul(self.weight.dtype)
            half_panels = native and self._native_half_panels_pay()
            if not native or half_panels:
                self.half = self.weight.dtype
                self.weight = self.weight.detach().float()
                self.bias = None if self.bias is None else self.bias.detach().float()
                self.widened = True
        if half_panels:
            self.panels = (_stacked_panels(self.weight, self.bias, torch.bfloat16) if self.stacked
                           else _panels(self.weight, self.bias, torch.bfloat16))
        elif not self.stacked:
            if choose_layout and self.weight.device.type == "cpu" and self.weight.dtype == torch.float32 \
                    and self.weight.shape[0] >= LAYOUT_MIN_ROWS:
                layout, copies = self._timed_layout()
                if layout == "packed":
                    self.packed = copies["packed"] if copies else pack_weight(self.weight)
                if layout == "transposed":
                    self.transposed = copies["transposed"] if copies else self.weight.detach().t().contiguous()
                if layout in ("panels", "panels_bf16"):
                    self.panels = copies[layout] if copies else _panels(
                        self.weight, self.bias, torch.bfloat16 if layout == "panels_bf16" else None)
            else:
                self.packed = pack_weight(self.weight)
        return self

    def _native_half_panels_pay(self) -> bool:
        """On a CPU with hardware bf16 products: whether this bfloat16 weight multiplies faster as bfloat16
        panels (:func:`taps_ops.panel_linear` over bf16 x: AVX512-BF16's dot products, or AMX tiles at the amx
        level where `in` is a multiple of 32) than in oneDNN's bf16 kernel (:func:`native_half_layout`, timed once
        per shape and thread count). On a CPU with AVX512-BF16 and no AMX, oneDNN's kernel costs ~20 us more a
        call at a decoding step's few rows than the panels, which read the same bytes; on an AMX Xeon oneDNN's
        AMX kernel 40-83 us a call at 1-16 rows against the tiles' 9-46 us (the shipped target's projections,
        weights read from L3; bench/RESULTS.md). G > 1 stacked weights
        (a drafter group's, else multiplied by ``bmm``, slower at a step's rows than both) follow one group's
        weight: kept as each group's panels where that weight would be."""
        w = self.weight
        if self.stacked:  # G > 1 drafters' [G, in, out] (bmm): as one group's [out, in] would be kept
            if w.dim() != 3 or w.shape[0] < 2:
                return False
            w = w[0].t()
        if (w.dtype != torch.bfloat16 or not PANELS_BF16 or not panel_shape_fits(w, None if self.stacked else self.bias)
                or w.shape[1] % 2):
            return False
        return native_half_layout(tuple(w.shape)) == "panels_bf16"

    def _timed_layout(self) -> Tuple[str, Optional[dict]]:
        """:func:`fastest_layout` of this float32 head, timed on its first rows (all of them up to
        ``LAYOUT_PROBE_BYTES``: a 128,256 x 4,096 head would otherwise hold four 2 GB copies at once while
        the layouts are timed); only the chosen layout is then built for the whole weight. Returns the
        layout and, when the rows timed were all of them, the copies timed (by layout name), which the
        caller keeps instead of building them again."""
        out, inner = self.weight.shape
        rows = min(out, max(LAYOUT_MIN_ROWS, LAYOUT_PROBE_BYTES // (4 * max(inner, 1))))
        if rows < out:
            rows -= rows % taps_ops.PANEL_WIDTH      # whole panels (LAYOUT_MIN_ROWS is a multiple of 16)
        weight = self.weight.detach()[:rows]
        bias = None if self.bias is None else self.bias.detach()[:rows]
        copies = dict(packed=pack_weight(weight), transposed=weight.t().contiguous(), panels=_panels(weight, bias),
                      panels_bf16=_panels(weight, bias, torch.bfloat16) if self._offers_bf16_panels() else None)
        layout = fastest_layout(weight, bias, copies["packed"], copies["transposed"], copies["panels"],
                                panels_bf16=copies["panels_bf16"])
        return layout, (copies if rows == out else None)

    def choose_small_layout(self, stacked: bool = True, packed: bool = False) -> "Linear":
        """A plain float32 CPU weight [out, in] (not oneDNN-packed: decoder layers' projections, drafters'
        input projections and heads) kept in the layout that multiplies fastest on this machine
        (:func:`small_layout`, timed once per shape and thread count): as it is (``mm`` over the rows and the
        weight transposed, what ``F.linear`` and ``taps_ops.decoder_layer`` run for it), where `stacked`
        allows (inputs always [1, R, in]) stacked as one group [1, in, out] (x then multiplies it by ``bmm``),
        or as taps' panels (``taps_ops.panel_linear``, in the Python body and in ``taps_ops.decoder_layer``
        alike); a widened bfloat16 weight (:meth:`pack`) also as bfloat16 panels, which hold its values
        exactly in half the bytes (the same products as float32 panels, bit for bit). With `packed`, a weight
        that :meth:`pack` gave a oneDNN-packed copy (float32, >= 4096 rows: a large decoder layer's MLP
        projections) has that copy timed beside the others and dropped unless it is the fastest (without, such
        a weight keeps it untimed, as heads do)."""
        if (self.stacked and self.panels is None and self.weight.device.type == "cpu" and self.weight.dim() == 3
                and self.weight.shape[0] > 1 and self.weight.dtype == torch.float32):
            # G > 1 drafters' weights [G, in, out] (bmm): as each group's panels, where panels are what a single
            # weight of that shape would keep (at a decoding step's rows bmm cost 1.2-2.5x two panel products)
            one = self.weight[0].t()
            fit = panels_fit(one, None if self.bias is None else self.bias[0, 0])
            if fit:
                layout = small_layout(tuple(one.shape), fit, stacked=True, bf16=self._offers_bf16_panels())
                if layout in ("panels", "panels_bf16"):
                    self.panels = _stacked_panels(self.weight, self.bias,
                                                  torch.bfloat16 if layout == "panels_bf16" else None)
            return self
        if (not self.stacked and self.panels is None and self.weight.device.type == "cpu"
                and self.weight.dtype == torch.float32 and (self.packed is None or packed)):
            fit = panels_fit(self.weight, self.bias)
            # a float32 weight of >= 4096 rows has a oneDNN-packed copy (pack_weight): one more candidate
            layout = small_layout(tuple(self.weight.shape), fit, stacked=stacked, bf16=fit and self._offers_bf16_panels(),
                                  packed=self.packed is not None)
            if layout != "packed":
                self.packed = None
            if layout == "stacked":
                self.weight = self.weight.detach().t().contiguous().unsqueeze(0)
                self.bias = None if self.bias is None else self.bias.detach().reshape(1, 1, -1).contiguous()
                self.stacked = True
            elif layout in ("panels", "panels_bf16"):
                self.panels = _panels(self.weight, self.bias, torch.bfloat16 if layout == "panels_bf16" else None)
        return self

    def _offers_bf16_panels(self) -> bool:
        """Whether bfloat16 panels are a layout of this weight: a widened bfloat16 one (its values exact in
        bf16), an even number of inputs (bf16 panels pair them), and :data:`PANELS_BF16`."""
        inner = self.weight.shape[1] if self.stacked else self.weight.shape[-1]   # (stacked: [G, in, out])
        return self.half == torch.bfloat16 and PANELS_BF16 and inner % 2 == 0

    def op_weight(self) -> Tensor:
        """The weight as ``taps_ops.decoder_layer`` takes it: panels, oneDNN-packed, stacked or plain."""
        if self.panels is not None:
            return self.panels
        return self.packed if self.packed is not None else self.weight

    def __call__(self, x: Tensor) -> Tensor:
        if self.widened and x.dtype != torch.float32:
            if (x.dtype == torch.bfloat16 and self.panels is not None and self.panels.dtype == torch.bfloat16
                    and not torch.is_grad_enabled()):
                # panel_linear takes bfloat16 x over bfloat16 panels: widened as read (or AVX512-BF16's dot
                # products, the same bits), the float32 sums rounded to bfloat16 once
                return self._panels_product(x)
            return self._product(x.float()).to(x.dtype)
        return self._product(x)

    def tiles(self, x: Tensor) -> bool:
        """Whether products of x by this weight run on AMX tiles (:func:`taps_ops.panel_linear` at the amx level:
        bfloat16 x over bfloat16 panels, ``in`` a multiple of 32, :data:`PANEL_AMX`): there a 16-row product costs
        1.0-1.2x a one-row one (AMX Xeon, the shipped target's shapes), so computing fewer rows saves ~nothing."""
        return (self.panels is not None and self.panels.dtype == torch.bfloat16 and not self.stacked and PANEL_AMX
                and x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] % 32 == 0
                and not torch.is_grad_enabled() and taps_ops.cpu_level() == "amx")

    def screens(self, x: Tensor) -> bool:
        """Whether greedy verification takes its argmax from :meth:`argmax`: a CPU weight kept as panels without
        a bias, not stacked, autograd off, :data:`HEAD_SCREEN` on, the CPU kernels at the avx2 level or above
        (the scalar screen measured 0.6x the scalar product), and float32 x (float32 logits), or bfloat16 x over
        bfloat16 panels (bf16 logits) where the product has no AVX512-BF16 dot products: with them the product is
        already twice as fast and the screen, which keeps one bf16 step of margin, measured no gain in decoding
        (the op itself takes both: :func:`taps_ops.head_argmax`)."""
        if (self.panels is None or self.stacked or self.bias is not None or not HEAD_SCREEN
                or x.device.type != "cpu" or torch.is_grad_enabled() or taps_ops.cpu_level() == "scalar"):
            return False
        if x.dtype == torch.float32:
            return True
        return (x.dtype == torch.bfloat16 and self.widened and self.panels.dtype == torch.bfloat16
                and not _bf16_dot_products())

    def argmax(self, x: Tensor) -> Tensor:
        """``self(x).argmax(-1)`` (ties to the lowest id) where :meth:`screens` says yes, by
        :func:`taps_ops.head_argmax`: an int8 screen of the weight (built at the first call, a quarter of a
        float32 weight's bytes) and the panels of the outputs that could be the maximum, bit for bit the full
        product's argmax at a fraction of its cost."""
        if self.screen is None:
            self.screen = taps_ops.pack_head_screen(self.weight)
        return taps_ops.head_argmax(x, *self.screen, self.panels)

    def _panels_product(self, x: Tensor) -> Tensor:
        if not self.stacked:
            return _panel_linear(x, self.panels, self.bias)
        # G groups' panels: x [G, R, in], one product per group (each group's drafter's own, bit for bit)
        bias = self.bias
        return torch.stack([_panel_linear(x[g], self.panels[g], None if bias is None else bias[g, 0])
                            for g in range(x.shape[0])])

    def _product(self, x: Tensor) -> Tensor:
        if self.panels is not None and not torch.is_grad_enabled():
            return self._panels_product(x)
        if not self.stacked:
            if self.transposed is not None and not torch.is_grad_enabled():
                y = _mm_rows(x.reshape(-1, x.shape[-1]), self.transposed, self.bias)
                return y.view(*x.shape[:-1], y.shape[-1])
            if self.packed is not None and not torch.is_grad_enabled():
                return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
            return F.linear(x, self.weight, self.bias)
        if self.bias is not None:
            return torch.baddbmm(self.bias, x, self.weight)
        return torch.bmm(x, self.weight)


#: greedy verification's argmax of a head kept as panels through its int8 screen (:meth:`Linear.screens`,
#: :meth:`Linear.argmax`, ``taps_ops.head_argmax``: the same tokens as the full product; shipped target, Zen 4:
#: fp32 taps autoregressive 1.18x and token-store rows 1.09-1.11x faster, bf16 at emulated AVX2 1.03x / 1.03x);
#: TAPS_HEAD_SCREEN=0 turns it off
HEAD_SCREEN = os.environ.get("TAPS_HEAD_SCREEN", "1") != "0"
#: panel_linear's AMX tiles at the amx level (TAPS_PANEL_AMX=0, read by the op at load, turns them off; read here
#: for :meth:`Linear.tiles`)
PANEL_AMX = os.environ.get("TAPS_PANEL_AMX", "1") != "0"
_BF16_DOT = "avx512_bf16" in torch.ops.taps_ops._cpu_features()   # (cpu_info() would also read /proc/cpuinfo)


def _bf16_dot_products() -> bool:
    """Whether panel_linear multiplies bfloat16 x by AVX512-BF16's dot products at the level in force."""
    return _BF16_DOT and taps_ops.cpu_level() in ("avx512", "amx")


#: float32 weights of at least this many output rows called with ``Linear.pack(choose_layout=True)`` (heads)
#: have their layout timed at load (a few milliseconds for a 32,000-row head)
LAYOUT_MIN_ROWS = 4096
#: the most weight bytes a head's layouts are timed on (its first rows; see ``Linear._timed_layout``)
LAYOUT_PROBE_BYTES = 64 << 20


def _timed(candidates: dict, inputs: Sequence[Tensor], repeats: int, budget: float = 0.0,
           most: int = 25) -> dict:
    """Seconds per candidate function: summed over `inputs`, each the fastest of its calls after one
    untimed call, the candidates alternating (a burst of load hits them alike): ``repeats`` rounds, and
    more (up to ``most``) while the rounds of that input have taken less than ``budget`` seconds (a small
    weight's calls take microseconds, and a burst of load that spans three of them flips the choice; a
    large weight's take long enough to be timed three times only)."""
    seconds = dict.fromkeys(candidates, 0.0)
    with torch.no_grad():
        for x in inputs:
            best = dict.fromkeys(candidates, float("inf"))
            for fn in candidates.values():
                fn(x)
            start, rounds = time.perf_counter(), 0
            while rounds < repeats or (rounds < most and time.perf_counter() - start < budget):
                for key, fn in candidates.items():
                    t0 = time.perf_counter()
                    fn(x)
                    best[key] = min(best[key], time.perf_counter() - t0)
                rounds += 1
            for key in candidates:
                seconds[key] += best[key]
    return seconds


def _mm_rows(rows: Tensor, transposed: Tensor, bias: Optional[Tensor]) -> Tensor:
    """rows [R, in] times a weight kept transposed [in, out], plus bias."""
    return torch.addmm(bias, rows, transposed) if bias is not None else torch.mm(rows, transposed)


#: Whether taps' panels (taps_ops.panel_linear) are among the layouts timed at load; ``TAPS_PANELS=0`` leaves
#: them out (to compare against the BLAS layouts alone).
PANELS = os.environ.get("TAPS_PANELS", "1") != "0"
#: Whether a widened bfloat16 weight also times bfloat16 panels of its values; ``TAPS_PANELS_BF16=0`` leaves them
#: out (float32 panels of the widened weight stay a candidate).
PANELS_BF16 = os.environ.get("TAPS_PANELS_BF16", "1") != "0"


def panels_fit(weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a weight [out, in] can be kept as taps' panels: float32 (:func:`panel_shape_fits`) with a
    float32 bias or none."""
    return (weight.dtype == torch.float32 and (bias is None or bias.dtype == torch.float32)
            and panel_shape_fits(weight, bias))


def panel_shape_fits(weight: Tensor, bias: Optional[Tensor]) -> bool:
    """Whether a weight [out, in] of any dtype has the shape of taps' panels: on the CPU, out a multiple of
    ``taps_ops.PANEL_WIDTH`` and at least two panels (taps_ops.decoder_layer tells a [P, in, 16] panel
    weight from a stacked [1, in, out] one by P > 1), a bias [out] or none; and :data:`PANELS`."""
    return (PANELS and weight.device.type == "cpu" and weight.dim() == 2
            and weight.shape[0] % taps_ops.PANEL_WIDTH == 0 and weight.shape[0] >= 2 * taps_ops.PANEL_WIDTH
            and (bias is None or bias.dim() == 1))


def _probe_outputs(out: int, inner: int, budget: int, element: int) -> int:
    """The output rows a layout timing measures of a weight [out, in] of `element`-byte values: all of them up
    to `budget` bytes, else that many in whole panels (two panels at least)."""
    return min(out, max(2 * taps_ops.PANEL_WIDTH,
                        budget // (element * max(inner, 1)) // taps_ops.PANEL_WIDTH * taps_ops.PANEL_WIDTH))


# taps_ops.panel_linear without its Python wrapper's device checks (1 us of a 5 us call at decoding's sizes), through
# its fast entry
_panel_linear = taps_ops._panel_linear_call


def _panels(weight: Tensor, bias: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """The weight as panels (`dtype`: float32 by default; bfloat16 only for a widened bfloat16 weight, whose
    values it holds exactly), or None where :func:`panels_fit` says no."""
    if dtype is not None and (dtype != torch.bfloat16 or weight.shape[-1] % 2):  # bf16 panels pair the inputs
        return None
    return taps_ops.pack_panels(weight.detach(), dtype) if panels_fit(weight, bias) else None


def _stacked_panels(weight: Tensor, bias: Optional[Tensor], dtype: Optional[torch.dtype] = None) -> Optional[Tensor]:
    """G > 1 stacked weights [G, in, out] (bias [G, 1, out] or None) as each group's panels stacked: [G, out / 16,
    in, 16] float32 or [G, out / 16, in / 2, 16, 2] bfloat16 (what ``taps_ops.decoder_layer`` multiplies group by
    group), or None where a group's [out, in] does not fit panels."""
    parts = [_panels(w.t().contiguous(), None if bias is None else bias[g, 0], dtype)
             for g, w in enumerate(weight.detach())]
    return None if any(p is None for p in parts) else torch.stack(parts)


def fastest_layout(weight: Tensor, bias: Optional[Tensor], packed: Optional[Tensor], transposed: Tensor,
                   panels: Optional[Tensor] = None, repeats: int = 3, panels_bf16: Optional[Tensor] = None) -> str:
    """Which layout of a float32 CPU weight [out, in] multiplies fastest on this machine: ``"packed"``
    (oneDNN's blocked copy, when there is one), ``"plain"`` (``F.linear`` over [out, in]),
    ``"transposed"`` (``mm`` over `transposed`, its [in, out] copy), ``"panels"`` (``taps_ops.panel_linear``
    over `panels`, when there are some) or ``"panels_bf16"`` (over `panels_bf16`: bfloat16 panels of a
    widened bfloat16 weight, the same values): the least summed time of a 1-row and
    an 8-row product (a plain step's and a tree's), each the fastest of at least ``repeats`` calls and of
    as many more as 20 ms of calls per row count hold (up to 25: a burst of load over three calls of a
    small head chose a layout 1.4x slower at 8 rows in one process of ten). The layouts give the same
    products up to float rounding."""
    candidates = {"plain": lambda x: F.linear(x, weight, bias), "transposed": lambda x: _mm_rows(x, transposed, bias)}
    if packed is not None:
        candidates["packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if panels is not None:
        candidates["panels"] = lambda x: _panel_linear(x, panels, bias)
    if panels_bf16 is not None:
        candidates["panels_bf16"] = lambda x: _panel_linear(x, panels_bf16, bias)
    seconds = _timed(candidates, [torch.randn(rows, weight.shape[1], dtype=weight.dtype) for rows in (1, 8)], repeats,
                     budget=0.02)
    return min(seconds, key=seconds.get)


_SMALL_LAYOUT: dict = {}


def small_layout(shape: Tuple[int, int], panels: bool = True, repeats: int = 3, stacked: bool = True,
                 bf16: bool = False, packed: bool = False) -> str:
    """Which layout of a float32 [out, in] projection of x [1, R, in] multiplies fastest on this machine:
    ``"plain"`` (``mm`` over the rows and the [out, in] weight transposed: what ``F.linear`` and
    ``taps_ops.decoder_layer`` run for a plain weight), where `stacked` allows ``"stacked"`` (``bmm`` over
    the weight stacked [1, in, out]), where `panels` allows ``"panels"`` (``taps_ops.panel_linear``) and where
    `bf16` allows (a widened bfloat16 weight) ``"panels_bf16"`` (its values as bfloat16 panels) and where
    `packed` allows ``"packed"`` (oneDNN's blocked copy, :func:`pack_weight`: float32 weights of >= 4096 rows): the
    least summed time of 1 and 8 rows on random weights of that shape, each the fastest of at least
    ``repeats`` calls and of as many as 5 ms of calls hold; measured once per shape, candidates and thread
    count in a process (a few milliseconds; which BLAS kernel runs depends on the threads too)."""
    key = (tuple(shape), panels, stacked, bf16, packed, torch.get_num_threads())
    known = _SMALL_LAYOUT.get(key)
    if known is None:
        out, inner = shape
        # at most LAYOUT_PROBE_BYTES of rows (whole panels): a large model's MLP projection would otherwise
        # hold several copies of hundreds of megabytes while it is timed
        out = _probe_outputs(out, inner, LAYOUT_PROBE_BYTES, 4)
        weight = torch.randn(out, inner)
        as_stacked = weight.t().contiguous().unsqueeze(0)
        candidates = {"plain": lambda x: torch.mm(x[0], weight.t())}
        if stacked:
            candidates["stacked"] = lambda x: torch.bmm(x, as_stacked)
        if panels:
            full = taps_ops.pack_panels(weight)
            candidates["panels"] = lambda x: _panel_linear(x, full, None)
        if bf16:
            half = taps_ops.pack_panels(weight, torch.bfloat16)
            candidates["panels_bf16"] = lambda x: _panel_linear(x, half, None)
        blocked = pack_weight(weight) if packed else None
        if blocked is not None:
            candidates["packed"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, blocked, None, "none", [], "")
        seconds = _timed(candidates, [torch.randn(1, rows, inner) for rows in (1, 8)], repeats, budget=0.005)
        known = _SMALL_LAYOUT[key] = min(seconds, key=seconds.get)
    return known


_NATIVE_HALF_LAYOUT: dict = {}


def native_half_layout(shape: Tuple[int, int], repeats: int = 3) -> str:
    """Which layout of a bfloat16 [out, in] projection of bfloat16 x [1, R, in] multiplies fastest on a CPU
    with hardware bf16 products: ``"packed"`` (oneDNN's bf16 kernel over its blocked copy, :func:`pack_weight`,
    or ``F.linear`` where there is none) or ``"panels_bf16"`` (:func:`taps_ops.panel_linear` of the bf16 x over
    bfloat16 panels: float32 sums rounded to bfloat16 once, what a widened weight runs). The two differ in
    rounding (float32 sums in another order), not in what they compute. At the amx level the panels multiply
    bf16 x on AMX tiles (`in` a multiple of 32): 1.4-4.7x faster than oneDNN's AMX kernel at 1-16 rows on an AMX
    Xeon (the shipped target's shapes), and about as fast at 16 rows as at 1.

    Timed as a decoding step meets the weight: after the other layers' weights went through the caches (each
    call reads the next of copies that hold at least :data:`HALF_LAYOUT_COLD_BYTES` together, at most 64) and at the rows of
    a plain step and of a small tree (the least summed time of 1 and 4 rows: with a tuner most steps are plain
    ones, and the trees it picks hold a few nodes). On an AMD EPYC Zen 4 (AVX512-BF16, no AMX; 1 thread), a
    1536 x 256 projection timed so: oneDNN 63 / 65 / 105 us at 1 / 4 / 16 rows, the panels with bf16 x (AVX512-BF16's
    dot products, :func:`taps_ops.panel_linear`) 14 / 22 / ~70 us (oneDNN's call costs ~20 us more whatever the
    rows). Measured once per shape and thread count in a process."""
    key = (tuple(shape), torch.get_num_threads())
    known = _NATIVE_HALF_LAYOUT.get(key)
    if known is None:
        out, inner = shape
        out = _probe_outputs(out, inner, HALF_LAYOUT_PROBE_BYTES, 2)
        copies = min(64, max(2, -(-HALF_LAYOUT_COLD_BYTES // (2 * out * inner))))   # tiny weights: 64
        weights = [torch.randn(out, inner).bfloat16() for _ in range(copies)]
        blocked = [pack_weight(w) for w in weights]
        halves = [taps_ops.pack_panels(w.float(), torch.bfloat16) for w in weights]
        turn = {"packed": 0, "panels_bf16": 0}

        def packed(x):
            i = turn["packed"] = (turn["packed"] + 1) % copies
            if blocked[i] is None:
                return F.linear(x, weights[i])
            return torch.ops.mkldnn._linear_pointwise(x, blocked[i], None, "none", [], "")

        def panels(x):
            i = turn["panels_bf16"] = (turn["panels_bf16"] + 1) % copies
            return _panel_linear(x, halves[i], None)

        seconds = _timed({"packed": packed, "panels_bf16": panels},
                         [torch.randn(1, rows, inner).bfloat16() for rows in (1, 4)], repeats, budget=0.005)
        known = _NATIVE_HALF_LAYOUT[key] = min(seconds, key=seconds.get)
    return known


#: native_half_layout: the bytes of weight copies a timed call cycles through (more than a core's L2 cache)
HALF_LAYOUT_COLD_BYTES = 8 << 20
#: native_half_layout: the most bytes of one timed copy (its first rows, whole panels)
HALF_LAYOUT_PROBE_BYTES = 16 << 20


def pack_weight(weight: Tensor) -> Optional[Tensor]:
    """oneDNN's pre-packed form of a CPU linear weight [out, in], or None where it does not pay or is not
    available. bf16 weights are packed (the same oneDNN kernel F.linear runs, bit for bit, without
    re-laying out the weight on every call: 10 us per small call, 100 us per 8192-row head on the
    development CPU); fp32 weights only for heads of >= 4096 rows (oneDNN's fp32 kernel is about twice
    as fast as the default there, and equal to it up to float rounding)."""
    if weight.device.type != "cpu" or weight.dim() != 2 or not torch.backends.mkldnn.is_available():
        return None
    if not (weight.dtype == torch.bfloat16 or (weight.dtype == torch.float32 and weight.shape[0] >= 4096)):
        return None
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
        probe = torch.randn(3, weight.shape[1], dtype=weight.dtype)
        with torch.no_grad():
            ok = torch.allclose(torch.ops.mkldnn._linear_pointwise(probe, packed, None, "none", [], "").float(),
                                F.linear(probe, weight).float(), rtol=1e-2, atol=1e-2)
    except (RuntimeError, AttributeError):
        return None
    return packed if ok else None


class Norm:
    """RMSNorm as Hugging Face's Llama computes it (in float32, then cast, then scaled by the weight), for
    one weight [H] or G stacked ones ([G, 1, H], x [G, R, H]).

    With autograd off, float32 and bfloat16 activations of the weight's dtype go through one
    ``taps_ops.rms_norm`` call (the composite form costs half a dozen operators and temporaries: 10-30 us
    a call at decoding's sizes on the CPU, about 4 us for the op); otherwise the composite form."""

    __slots__ = ("weight", "eps", "width", "rows")

    def __init__(self, weights, eps: float):
        if isinstance(weights, (list, tuple)):
            weights = weights[0] if len(weights) == 1 else torch.stack([w.detach() for w in weights]).unsqueeze(1)
        self.weight = weights
        self.eps = float(eps)
        self.width = (int(weights.shape[-1]),)
        self.rows = weights.detach().reshape(-1, weights.shape[-1])  # [G, H] (a view)

    def __call__(self, x: Tensor) -> Tensor:
        if x.dtype == self.rows.dtype and x.dtype in _FUSED_NORM_DTYPES and not torch.is_grad_enabled():
            return taps_ops.rms_norm(x, self.rows, self.eps)
        if x.dtype == torch.float32:
            if self.weight.dim() == 1:
                return F.rms_norm(x, self.width, self.weight, self.eps)
            return F.rms_norm(x, self.width, None, self.eps) * self.weight
        return F.rms_norm(x.float(), self.width, None, self.eps).to(x.dtype) * self.weight


class LayerWeights:
    """One Llama-style decoder layer's weights (single or G stacked sets).

    Built from Hugging Face decoder layer modules of one shape (``LlamaDecoderLayer`` and its Mistral,
    Qwen2 and Qwen3 twins, or the EAGLE head's layers); ``input_layernorm`` may be absent (EAGLE-1/2's
    first layer), as may ``q_norm`` / ``k_norm`` (present in Qwen3).
    """

    def __init__(self, layers: Sequence[nn.Module]):
        first = layers[0]
        attn, mlp = first.self_attn, first.mlp

        def lin(get):
            mods = [get(layer) for layer in layers]
            return Linear([m.weight for m in mods], [m.bias for m in mods])

        def norm(get):
            mods = [get(layer) for layer in layers]
            if mods[0] is None:
                return None
            return Norm([m.weight for m in mods], _norm_eps(mods[0]))

        self.in_norm = norm(lambda layer: getattr(layer, "input_layernorm", None))
        self.post_norm = norm(lambda layer: layer.post_attention_layernorm)
        self.q = lin(lambda layer: layer.self_attn.q_proj)
        self.k = lin(lambda layer: layer.self_attn.k_proj)
        self.v = lin(lambda layer: layer.self_attn.v_proj)
        self.o = lin(lambda layer: layer.self_attn.o_proj)
        self.q_norm = norm(lambda layer: getattr(layer.self_attn, "q_norm", None))
        self.k_norm = norm(lambda layer: getattr(layer.self_attn, "k_norm", None))
        self.gate = lin(lambda layer: layer.mlp.gate_proj)
        self.up = lin(lambda layer: layer.mlp.up_proj)
        self.down = lin(lambda layer: layer.mlp.down_proj)
        self.qkv: Optional[Linear] = None       # fused projections (inference on the CPU, see pack)
        self.gate_up: Optional[Linear] = None
        self.op_args: Optional[Tuple[list, list, list]] = None   # taps_ops.decoder_layer's (see pack)
        self.head_dim = int(getattr(attn, "head_dim"))
        self.heads = int(self.q.weight.shape[-1 if self.q.stacked else 0]) // self.head_dim
        self.kv_heads = int(self.k.weight.shape[-1 if self.k.stacked else 0]) // self.head_dim
        self.scale = float(getattr(attn, "scaling", self.head_dim ** -0.5))
        if not _is_silu(getattr(mlp, "act_fn", None)):
            raise ValueError(f"lean path: the MLP activation must be SiLU, got {type(getattr(mlp, 'act_fn', None)).__name__}")

    def pack(self) -> "LayerWeights":
        """For inference on the CPU: fuse q/k/v and gate/up into one projection each (copies; the same
        results bit for bit) and pre-pack every projection (:meth:`Linear.pack`)."""
        if self.q.weight.device.type == "cpu":
            self.qkv = Linear.concat([self.q, self.k, self.v]).pack()
            self.gate_up = Linear.concat([self.gate, self.up]).pack()
        for lin in (self.q, self.k, self.v, self.o, self.gate, self.up, self.down):
            lin.pack()
        for lin in (self.qkv, self.o, self.gate_up, self.down):
            if lin is not None:
                lin.choose_small_layout(packed=True)
        self.op_args = None
        dtype = self.post_norm.rows.dtype
        # the op takes widened float32 projections (Linear.pack) beside half-precision norms, as the Python body
        same_dtype = (self.in_norm is None or self.in_norm.rows.dtype == dtype) and all(
            lin is None or lin.weight.dtype == dtype or lin.widened for lin in (self.qkv, self.o, self.gate_up, self.down))
        if self.qkv is not None and self.q_norm is None and dtype in _FUSED_NORM_DTYPES and same_dtype:
            # the whole layer as one taps_ops.decoder_layer call, when its attention is a TreeAttend
            fused_rope = dtype == torch.float32 or (self.heads + self.kv_heads) * self.head_dim <= _FUSED_ROPE_HALF_WIDTH
            weights = [self.in_norm.rows if self.in_norm is not None else None, None]
            for lin in (self.qkv, self.o):
                weights += [lin.op_weight(), lin.bias]
            weights.append(self.post_norm.rows)
            for lin in (self.gate_up, self.down):
                weights += [lin.op_weight(), lin.bias]
            eps = [self.in_norm.eps if self.in_norm is not None else 0.0, 0.0, self.post_norm.eps]
            self.op_args = (weights, eps, [self.heads, self.kv_heads, self.head_dim, int(fused_rope)])
        return self


def _is_silu(module) -> bool:
    return isinstance(module, nn.SiLU) or type(module).__name__ == "SiLUActivation"


def _norm_eps(module: nn.Module) -> float:
    eps = getattr(module, "variance_epsilon", None)
    if eps is None:
        eps = getattr(module, "eps", None)
    if eps is None:
        raise ValueError(f"lean path: {type(module).__name__} has no epsilon attribute")
    return float(eps)


#: attend(layer_index, q [GB, T, Hq, D], k [GB, T, Hkv, D], v [GB, T, Hkv, D]) -> out [GB, Hq, T, D]
Attend = Callable[[int, Tensor, Tensor, Tensor], Tensor]

#: Rotary positions of tokens [R, T]: a tensor [R, T], or a ``range`` that every row shares (T consecutive
#: positions, or a single one for all T tokens), which :class:`RopeTable` serves as views.
Positions = Union[Tensor, range]


def decoder_layer(w: LayerWeights, index: int, x: Tensor, cos: Tensor, sin: Tensor, attend: Attend,
                  rows: int, tokens: int) -> Tensor:
    """One decoder layer. x: [G, rows * tokens, H] (G weight groups; G = 1 for a single weight set),
    cos / sin: [G * rows, tokens, 1, D] (sin with rotate_half's sign folded in, see :class:`RopeTable`).

    With autograd off, packed weights (:meth:`LayerWeights.pack`) and an attention that offers a fused path
    (``attend.fused_layer``, e.g. :class:`taps.kv.TreeAttend`), the layer runs as one ``taps_ops.decoder_layer``
    call: the same operators in the same order, bit for bit, without their Python-side cost."""
    fused = getattr(attend, "fused_layer", None)
    if fused is not None and w.op_args is not None and _layer_op_ok(w, x, cos):
        return fused(w.op_args, index, x, None, cos, sin)
    h = w.in_norm(x) if w.in_norm is not None else x
    return _attention_mlp(w, index, x, h, cos, sin, attend, rows, tokens)


def eagle3_layer(w: LayerWeights, hidden_norm: Norm, index: int, emb: Tensor, x: Tensor, cos: Tensor, sin: Tensor,
                 attend: Attend, rows: int, tokens: int) -> Tensor:
    """The EAGLE-3 head's decoder layer (``midlayer``): the attention reads
    ``cat(input_layernorm(emb), hidden_norm(x))`` (q/k/v projections from 2H) while the residual stream is
    x; then the MLP as in :func:`decoder_layer`. emb, x: [G, rows * tokens, H]; cos / sin as there (and as
    there, one ``taps_ops.decoder_layer`` call when it can)."""
    fused = getattr(attend, "fused_layer", None)
    if (fused is not None and w.op_args is not None and emb.dtype == x.dtype
            and hidden_norm.rows.dtype == x.dtype and _layer_op_ok(w, x, cos)):
        weights, eps, dims = w.op_args
        if weights[1] is not hidden_norm.rows:
            weights, eps = list(weights), list(eps)
            weights[1], eps[1] = hidden_norm.rows, hidden_norm.eps
            w.op_args = (weights, eps, dims)
        return fused(w.op_args, index, x, emb, cos, sin)
    h = torch.cat([w.in_norm(emb), hidden_norm(x)], dim=-1)
    return _attention_mlp(w, index, x, h, cos, sin, attend, rows, tokens)


def _layer_op_ok(w: LayerWeights, x: Tensor, cos: Tensor) -> bool:
    """Whether taps_ops.decoder_layer computes what the Python body would for these inputs."""
    return x.dtype == w.post_norm.rows.dtype and cos.dtype == x.dtype and not torch.is_grad_enabled()


def _attention_mlp(w: LayerWeights, index: int, x: Tensor, h: Tensor, cos: Tensor, sin: Tensor, attend: Attend,
                   rows: int, tokens: int) -> Tensor:
    """x + attention(h), then the MLP block with its own residual (the body of a decoder layer)."""
    groups = x.shape[0]
    gb = groups * rows
    half = w.head_dim // 2
    if w.qkv is not None and w.q_norm is None and torch.is_grad_enabled() is False:
        qkv = w.qkv(h).view(gb, tokens, w.heads + 2 * w.kv_heads, w.head_dim)
        if cos.dtype == qkv.dtype and (qkv.dtype == torch.float32 or
                                      (w.heads + w.kv_heads) * w.head_dim <= _FUSED_ROPE_HALF_WIDTH):
            # q and k rotated together, in place, in one pass
            taps_ops.rope_(qkv[:, :, :w.heads + w.kv_heads], cos, sin)
            q, k, v = qkv.split([w.heads, w.kv_heads, w.kv_heads], dim=2)
        else:
            qk, v = qkv.split([w.heads + w.kv_heads, w.kv_heads], dim=2)
            qk = qk * cos + qk.roll(half, -1) * sin
            q, k = qk.split([w.heads, w.kv_heads], dim=2)
    else:
        q = w.q(h).view(gb, tokens, w.heads, w.head_dim)
        k = w.k(h).view(gb, tokens, w.kv_heads, w.head_dim)
        v = w.v(h).view(gb, tokens, w.kv_heads, w.head_dim)
        if w.q_norm is not None:
            q, k = _head_norm(w.q_norm, q, groups), _head_norm(w.k_norm, k, groups)
        q = q * cos + q.roll(half, -1) * sin
        k = k * cos + k.roll(half, -1) * sin
    out = attend(index, q, k, v)                                   # [GB, Hq, T, D]
    x = x + w.o(out.transpose(1, 2).reshape(groups, rows * tokens, w.heads * w.head_dim))
    h = w.post_norm(x)
    if w.gate_up is not None and not torch.is_grad_enabled():
        gate, up = w.gate_up(h).chunk(2, dim=-1)
        return x + w.down(F.silu(gate) * up)
    return x + w.down(F.silu(w.gate(h)) * w.up(h))


def _head_norm(norm: Norm, t: Tensor, groups: int) -> Tensor:
    if norm.weight.dim() == 1:
        return norm(t)
    shape = t.shape
    return norm(t.reshape(groups, -1, shape[-1])).view(shape)


class RopeTable:
    """cos / sin rows of a rotary-embedding module for positions 0 .. P-1 (``cos``, ``sin``: [P, 1, D]), grown
    on demand.

    ``sin`` carries rotate_half's sign (-1 on the first half of the features), so that
    ``x * cos + x.roll(D // 2, -1) * sin`` equals Hugging Face's ``x * cos + rotate_half(x) * sin``
    element for element.

    Args:
        rotary: the model's rotary module (called as ``rotary(x, position_ids) -> (cos, sin)``).
        dtype: the activations' dtype (Hugging Face casts cos / sin to it).
    """

    def __init__(self, rotary: nn.Module, dtype: torch.dtype):
        self.rotary, self.dtype = rotary, dtype
        self.cos: Optional[Tensor] = None
        self.sin: Optional[Tensor] = None

    def ensure(self, length: int, device: torch.device) -> None:
        """Make rows 0 .. length-1 available."""
        if self.cos is not None and self.cos.shape[0] >= length and self.cos.device == device:
            return
        size = max(int(length), 2 * (self.cos.shape[0] if self.cos is not None else 0), 256)
        probe = torch.zeros(1, dtype=self.dtype, device=device)
        pos = torch.arange(size, device=device).unsqueeze(0)
        with torch.no_grad():
            cos, sin = self.rotary(probe, pos)
        cos, sin = cos[0].to(self.dtype), sin[0].to(self.dtype)
        half = cos.shape[-1] // 2
        sign = torch.ones(cos.shape[-1], dtype=self.dtype, device=device)
        sign[:half] = -1
        # [P, 1, D]: a gather or a slice of it is already the [..., 1, D] that q and k's heads broadcast over
        self.cos, self.sin = cos.contiguous().unsqueeze(1), (sin * sign).contiguous().unsqueeze(1)

    def __call__(self, positions: Positions, shape: Optional[Tuple[int, int]] = None) -> Tuple[Tensor, Tensor]:
        """cos, sin [R, T, 1, D] for tokens at ``positions``: a tensor [R, T] (gathered rows), or a ``range``
        that every row of ``shape = (R, T)`` shares (T consecutive positions, or one position for all T
        tokens), served as views of the table, no copy. Rows must have been made available
        (:meth:`ensure`)."""
        if isinstance(positions, range):
            full = (shape[0], shape[1], 1, self.cos.shape[-1])
            return (self.cos[positions.start:positions.stop].expand(full),
                    self.sin[positions.start:positions.stop].expand(full))
        return self.cos[positions], self.sin[positions]


def lean_support(model: nn.Module) -> Optional[str]:
    """None when :class:`LeanCausalLM` reproduces `model`'s forward, else the reason it does not."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        return f"architecture {name} (the lean path covers {', '.join(SUPPORTED_ARCHITECTURES)})"
    config = model.config
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "rotary_emb"):
        return "no model.layers / model.rotary_emb"
    rope_type = str(getattr(inner.rotary_emb, "rope_type", "default"))
    if "dynamic" in rope_type or "longrope" in rope_type:
        return f"rope type {rope_type!r} (its frequencies depend on the sequence length)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"activation {config.hidden_act!r}"
    if int(getattr(config, "pretraining_tp", 1) or 1) != 1:
        return "pretraining_tp > 1"
    norms = [inner.norm] + [m for layer in inner.layers for m in (layer.input_layernorm, layer.post_attention_layernorm)]
    for m in norms:
        if type(m).__name__ not in _RMS_NORMS:
            return f"norm {type(m).__name__}"
    for layer in inner.layers:
        if getattr(layer.self_attn, "sliding_window", None) is not None:
            return "sliding-window attention layers"
        if not _is_silu(getattr(layer.mlp, "act_fn", None)):
            return "MLP activation is not SiLU"
    return None


class LeanCausalLM:
    """A Llama-family causal LM (or G of one shape, stacked) run by :func:`decoder_layer`.

    Args:
        models: one Hugging Face causal LM, or a list of G with identical shapes (small-LM drafters run
            as one batched forward; their weights are then stacked copies).

    The caller owns the KV storage and the attention (``attend``); this class only computes. Activations
    are [G, R, H]; request rows are group-major (row g * B + b is request b of model g).
    """

    def __init__(self, models):
        models = list(models) if isinstance(models, (list, tuple)) else [models]
        for m in models:
            why = lean_support(m)
            if why is not None:
                raise ValueError(f"lean path: unsupported model: {why}")
        self.models = models
        self.groups = len(models)
        inners = [m.model for m in models]
        self.layers = [LayerWeights([inner.layers[i] for inner in inners]) for i in range(len(inners[0].layers))]
        self.norm = Norm([inner.norm.weight for inner in inners], _norm_eps(inners[0].norm))
        heads = [m.get_output_embeddings() for m in models]
        self.head = Linear([h.weight for h in heads], [h.bias for h in heads])
        embeds = [m.get_input_embeddings().weight for m in models]
        self.embed_weight = embeds[0] if len(embeds) == 1 else torch.cat([e.detach() for e in embeds])
        self.vocab = int(embeds[0].shape[0])
        self.dtype = embeds[0].dtype
        self.rope = RopeTable(inners[0].rotary_emb, self.dtype)
        self.key = stack_key(self.sources())

    def pack(self) -> "LeanCausalLM":
        """Pre-pack the projections and the head for the CPU (inference; see :func:`pack_weight`)."""
        for w in self.layers:
            w.pack()
        self.head.pack().choose_small_layout(stacked=False)
        return self

    def sources(self) -> List[Tensor]:
        """The source parameters (to detect changes when the weights are stacked copies)."""
        return [p for m in self.models for p in m.parameters()] if self.groups > 1 else []

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def embed(self, ids: Tensor) -> Tensor:
        """ids [G * R, T] (group-major rows) -> [G, R * T, H]."""
        if self.groups > 1:
            rows = ids.shape[0] // self.groups
            offset = (torch.arange(self.groups, device=ids.device) * self.vocab).repeat_interleave(rows)
            ids = ids + offset.unsqueeze(1)
        return F.embedding(ids, self.embed_weight).view(self.groups, -1, self.embed_weight.shape[-1])

    def hidden(self, ids: Tensor, positions: Positions, attend: Attend, capture: Sequence[int] = ()):
        """Final normalised hidden states [G, R * T, H] of ids [G * R, T] at rotary positions [G * R, T] (or a
        range all rows share, see :data:`Positions`);
        with ``capture`` (layer indices), (hidden, {i: the input of layer i, [G, R * T, H]}); index
        ``num_layers`` is the final normalised hidden state (``output_hidden_states``' last entry)."""
        rows, tokens = ids.shape[0] // self.groups, ids.shape[1]
        x = self.embed(ids)
        cos, sin = self.rope(positions, (ids.shape[0], tokens))
        layers = {}
        for i, w in enumerate(self.layers):
            if i in capture:
                layers[i] = x
            x = decoder_layer(w, i, x, cos, sin, attend, rows, tokens)
        out = self.norm(x)
        if len(self.layers) in capture:
            layers[len(self.layers)] = out
        return (out, layers) if capture else out

    def logits(self, hidden: Tensor) -> Tensor:
        """lm_head of hidden [G, R, H] -> [G, R, V]."""
        return self.head(hidden)
