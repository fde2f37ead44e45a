"""Dense weights prepacked at load (kernels.dense_cpu): the same products as F.linear, at every M, in both
layouts (the native panels are tested further in test_native_cpu.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from kernels import dense_cpu, native_cpu
from kernels.quant import dequantize, linear, nbytes, place

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="torch built without oneDNN")


@pytest.fixture(params=["panels", "onednn"])
def layout(request, monkeypatch):
    """Which packed layout `pack` makes: the native panels, or oneDNN's where the native ops are absent."""
    if request.param == "onednn":
        monkeypatch.setattr(native_cpu, "available_for", lambda t: None)
    elif native_cpu.ops() is None or not native_cpu.ops().has_f32_linear():
        pytest.skip("the native panel kernels are not built here (no AVX-512)")
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 3, 17, 64])
def test_packed_linear_equals_f_linear(dtype, m, layout):
    g = torch.Generator().manual_seed(m)
    w = torch.randn(96, 80, generator=g).to(dtype)
    bias = torch.randn(96, generator=g).to(dtype)
    x = torch.randn(m, 80, generator=g).to(dtype)
    if not dense_cpu.can_pack(w):
        pytest.skip(f"oneDNN has no native {dtype} on this CPU")
    if layout == "panels" and dtype == torch.bfloat16 and not native_cpu.ops().has_bf16_linear():
        pytest.skip("no AVX512-BF16 here: bf16 goes to oneDNN's layout")
    packed = dense_cpu.pack(w)
    assert packed.layout == layout
    for b in (None, bias):
        got, want = dense_cpu.linear(x, packed, b), F.linear(x, w, b)
        assert got.shape == want.shape == (m, 96) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    assert torch.equal(dense_cpu.unpack(packed), w)
    assert packed.nbytes == w.numel() * w.element_size()


def test_place_packs_cpu_weights_and_every_helper_reads_them(monkeypatch, layout):
    w = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    placed = place(w, "cpu")
    assert isinstance(placed, dense_cpu.PackedDense)
    x = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(linear(x, placed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    assert torch.equal(dequantize(placed), w) and nbytes(placed) == nbytes(w)
    assert isinstance(place(placed, "cpu"), dense_cpu.PackedDense)  # placing again keeps the values
    with pytest.raises(ValueError, match="packed weight is torch.float32"):
        linear(x.bfloat16(), placed)
    monkeypatch.setenv(dense_cpu.PREPACK_ENV, "0")
    assert isinstance(place(w, "cpu"), torch.Tensor)  # the A/B switch keeps plain F.linear
    assert not dense_cpu.can_pack(w.half())  # only the dtypes oneDNN runs natively
