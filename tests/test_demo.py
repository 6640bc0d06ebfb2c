"""The demo's pieces that need no model: the accepted-token marks and `--dtype auto`."""

import pytest
import torch

import taps_ops
from taps import models
from taps.demo import _Marker


def test_marks_never_span_a_line_break():
    mark = _Marker(tok=None, color=False).mark
    assert mark("abc") == "[abc]"
    assert mark("ab\ncd") == "[ab]\n[cd]"
    assert mark("ab\n") == "[ab]\n" and mark("\n") == "\n" and mark("\n\nx") == "\n\n[x]"
    green = _Marker(tok=None, color=True).mark("a\nb")
    assert green == "\033[32ma\033[0m\n\033[32mb\033[0m"


@pytest.mark.parametrize("native", [True, False])
def test_auto_dtype_is_bf16_only_with_native_bf16(native, monkeypatch):
    asked = []
    monkeypatch.setattr(taps_ops, "native_half_matmul", lambda dtype: asked.append(dtype) or native)
    assert models.resolve_dtype("auto") == (torch.bfloat16 if native else torch.float32)
    assert asked == [torch.bfloat16]
    assert models.resolve_dtype("auto", "cpu") == models.resolve_dtype()
    assert models.resolve_dtype("fp32") == models.resolve_dtype("float32") == torch.float32
    assert models.resolve_dtype("bf16") == models.resolve_dtype("bfloat16") == torch.bfloat16
    with pytest.raises(ValueError, match="fp8"):
        models.resolve_dtype("fp8")


def test_auto_dtype_follows_the_cpu():
    expected = torch.bfloat16 if taps_ops.cpu_info()["native_bf16"] else torch.float32
    assert models.resolve_dtype("auto") == expected
