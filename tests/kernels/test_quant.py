"""Quantized linear (weight-only, w8a8 and w4a8): quantizers, the CPU layouts, and every dispatch path against the
torch twin."""

from __future__ import annotations

import pytest
import torch

from kernels import dense_cpu, quant, quant_cpu
from kernels.quant import Int4Weight, Int8Weight, dequantize, int4_values, linear, linear_ref, place

# (out_features, in_features): one full 64-row block, tails of 48 and 16 rows after full blocks, a lone tail.
SHAPES = [(64, 128), (176, 64), (80, 96), (48, 256)]
# Max |y - y_ref| / max |y_ref|: fp32 differs only in summation order; bf16/fp16 round x @ W's sums.
REL_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.fixture
def torch_int4(monkeypatch: pytest.MonkeyPatch) -> None:
    """No native panels (tested in test_native_cpu.py): int4 goes to torch's CPU layout, as where the native
    ops are not built."""
    from kernels import native_cpu

    monkeypatch.setattr(native_cpu, "available_for", lambda t: None)


def weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed))


def close(y: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert y.dtype == ref.dtype == dtype
    err = (y.float() - ref.float()).abs().max().item() / ref.float().abs().max().item()
    assert err <= REL_TOL[dtype], err


def test_int8_rounds_each_row_to_within_half_a_step() -> None:
    w = weight(40, 96)
    q = quant.quantize_int8(w, torch.float32)
    assert q.qweight.dtype == torch.int8 and q.qweight.abs().max() <= 127
    step = q.scales[:, None]
    assert ((dequantize(q) - w).abs() <= step / 2 + 1e-6).all()
    assert torch.allclose(q.scales, w.abs().amax(1) / 127)
    assert q.nbytes == 40 * 96 + 40 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_table_rows_read_every_layout(dtype: torch.dtype) -> None:
    """An embedding lookup in an int8 table (a tied lm_head held as int8): each layout's rows are exactly the
    dequantized rows, N not a multiple of the 16-row panels, ids repeated and out of order."""
    q = quant.quantize_int8(weight(37, 24, seed=5), dtype)
    ids = torch.tensor([36, 0, 17, 17, 15, 16, 3])
    want = dequantize(q, dtype)[ids]
    layouts = [q, place(q, "cpu"),
               Int8Weight(dense_cpu.panel(q.qweight, pairs=False), q.scales, "panels"),
               Int8Weight(dense_cpu.panel(q.qweight, pairs=True), q.scales, "panels"),
               Int8Weight(dense_cpu.quads(q.qweight), q.scales, "quads", "int8")]
    for w in layouts:
        got = quant.rows(w, ids)
        assert got.dtype == dtype and torch.equal(got, want), w.layout


def test_int8_activations_round_each_row_to_within_half_a_step() -> None:
    x = weight(7, 96, seed=3) * torch.arange(1, 8)[:, None]  # rows of different scales
    x[3] = 0
    qx, sx = quant.round_rows_int8(x)
    assert torch.equal(qx, qx.round()) and qx.abs().max() <= 127
    assert torch.equal(qx[3], torch.zeros(96)) and sx[3] == 0
    assert torch.allclose(sx, x.abs().amax(1) / 127)
    assert (qx.abs().amax(1)[sx > 0] == 127).all()  # each row's largest input maps to +-127
    assert ((qx * sx[:, None] - x).abs() <= sx[:, None] / 2 + 1e-6).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_without_its_native_kernel_runs_the_rounded_rows(dtype: torch.dtype, torch_int4: None) -> None:
    """Rows layout (no VNNI quads: another CPU, or CUDA's form): the rounded rows through the weight-only
    path, then each row's scale, match the reference's exact integer product."""
    q = quant.quantize_int8(weight(80, 96, seed=4), dtype, activations="int8")
    placed = place(q, "cpu")
    assert placed.layout == "rows" and placed.activations == "int8"
    x = weight(5, 96, seed=5).to(dtype)
    bias = weight(1, 80, seed=6)[0].to(dtype)
    for b in (None, bias):
        close(linear(x, placed, b), linear_ref(x, placed, b), dtype)
    weight_only = linear_ref(x, Int8Weight(q.qweight, q.scales), None).float()
    assert (linear_ref(x, q, None).float() - weight_only).abs().max() > 1e-3  # the rounding is applied
    with pytest.raises(ValueError, match="int8 activations only"):
        Int8Weight(placed.qweight, placed.scales, "quads")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w4a8_without_its_native_kernel_runs_the_rounded_rows(dtype: torch.dtype, torch_int4: None) -> None:
    """int4 weights with int8 activations and no native quads (another CPU, or CUDA's form): the rounded
    rows through the weight-only int4 path, then each row's scale, match the reference (the rounded rows'
    product with the dequantized weight in float64)."""
    q = quant.quantize_int4(weight(80, 96, seed=7), 32, dtype, activations="int8")
    placed = place(q, "cpu")
    assert placed.layout == "cpu_int4pack" and placed.activations == "int8"
    x = weight(5, 96, seed=8).to(dtype)
    bias = weight(1, 80, seed=9)[0].to(dtype)
    for b in (None, bias):
        close(linear(x, placed, b), linear_ref(x, placed, b), dtype)
    weight_only = linear_ref(x, quant.quantize_int4(weight(80, 96, seed=7), 32, dtype), None).float()
    assert (linear_ref(x, q, None).float() - weight_only).abs().max() > 1e-3  # the rounding is applied
    fused = quant.concat([q, q])
    assert fused.activations == "int8" and fused.shape == (160, 96)
    with pytest.raises(ValueError, match="int8 activations only"):
        Int4Weight(placed.qweight, placed.scale_zeros, 32, "quads")


@pytest.mark.parametrize("n", [16, 40, 100])
def test_int4_quads_round_trip(n: int) -> None:
    """The native w4a8 kernel's quads hold every value (N not a multiple of 16: zero past N), 16 columns x 4 k
    a 32-byte row, 8 columns a nibble."""
    values = torch.randint(0, 16, (n, 64), generator=torch.Generator().manual_seed(n), dtype=torch.uint8)
    packed = quant_cpu.pack_int4_quads(values)
    assert packed.shape == (-(-n // 16), 4, 4, 32) and packed.dtype == torch.uint8
    assert torch.equal(quant_cpu.unpack_int4_quads(packed, n), values)
    assert packed[0, 0, 0, 0].item() == values[0, 0].item() | values[8, 0].item() << 4
    assert packed[0, 0, 1, 5].item() == values[1, 5].item() | values[9, 5].item() << 4  # column 5 // 4, k 4 + 5 % 4
    # their scales and zeros, panel-major: one panel's groups in one block, zero past N
    sz = torch.randn(2, n, 2, generator=torch.Generator().manual_seed(n + 1))
    panel_sz = quant_cpu.pack_quads_scale_zeros(sz)
    assert panel_sz.shape == (-(-n // 16), 2, 2, 16)
    assert torch.equal(quant_cpu.unpack_quads_scale_zeros(panel_sz, n), sz)
    assert panel_sz[0, 1, 0, 3] == sz[1, 3, 0] and panel_sz[-1, 0, 1, 15] == (sz[0, n - 1, 1] if n % 16 == 0 else 0)


@pytest.mark.parametrize("group_size", [32, 64])
def test_int4_rounds_each_group_to_within_half_a_step(group_size: int) -> None:
    w = weight(48, 128, seed=1)
    q = quant.quantize_int4(w, group_size, torch.float32)
    values = int4_values(q)
    assert values.dtype == torch.uint8 and values.max() <= 15
    step = q.scale_zeros[..., 0].T.repeat_interleave(group_size, dim=1)  # (N, K)
    assert ((dequantize(q) - w).abs() <= step / 2 + 1e-6).all()
    groups = w.view(48, 128 // group_size, group_size)  # each group's min and max are hit (up to rounding)
    deq = dequantize(q).view_as(groups)
    assert torch.allclose(deq.amin(-1), groups.amin(-1), atol=1e-5)
    assert torch.allclose(deq.amax(-1), groups.amax(-1), atol=1e-5)
    assert q.nbytes == 48 * 64 + (128 // group_size) * 48 * 2 * 4


def test_int4_rejects_group_sizes_the_kernels_cannot_run() -> None:
    with pytest.raises(ValueError, match="group size must be one of"):
        quant.quantize_int4(weight(16, 64), 16, torch.float32)
    with pytest.raises(ValueError, match="does not divide in_features 96"):
        quant.quantize_int4(weight(16, 96), 64, torch.float32)


@pytest.mark.parametrize("shape", SHAPES, ids=[f"{n}x{k}" for n, k in SHAPES])
def test_cpu_int4_layout_round_trips(shape: tuple[int, int], torch_int4: None) -> None:
    q = quant.quantize_int4(weight(*shape, seed=2), 32, torch.bfloat16)
    packed = place(q, "cpu")
    assert isinstance(packed, Int4Weight) and packed.layout == "cpu_int4pack" and packed.shape == shape
    assert torch.equal(int4_values(packed), int4_values(q))
    assert torch.equal(quant_cpu.dequantize_int4_t(packed, torch.float32),
                       quant_cpu.dequantize_int4_t(q, torch.float32))
    assert packed.nbytes == q.nbytes


@pytest.mark.parametrize("layout", ["cpu_int4pack", "nibbles"])
def test_bf16_dequantized_int4_is_the_exact_weight_rounded_once(layout: str, torch_int4: None) -> None:
    host = quant.quantize_int4(weight(176, 128, seed=11), 32, torch.bfloat16)
    w = place(host, "cpu") if layout == "cpu_int4pack" else host
    assert isinstance(w, Int4Weight) and w.layout == layout
    want = dequantize(w).to(torch.bfloat16).T  # fp32 formula, one rounding
    assert torch.equal(quant_cpu.dequantize_int4_t(w, torch.bfloat16), want)


def test_int4_rows_not_a_multiple_of_16_stay_in_nibbles(torch_int4: None) -> None:
    q = place(quant.quantize_int4(weight(40, 64), 32, torch.bfloat16), "cpu")
    assert isinstance(q, Int4Weight) and q.layout == "nibbles"
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(3)).bfloat16()
    close(linear(x, q), linear_ref(x, q), torch.bfloat16)


def quantized(kind: str, n: int, k: int, dtype: torch.dtype) -> Int8Weight | Int4Weight:
    w = weight(n, k, seed=4)
    return place(quant.quantize_int8(w, dtype) if kind == "int8" else quant.quantize_int4(w, 32, dtype), "cpu")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_cpu_linear_matches_reference_on_both_sides_of_the_threshold(kind: str, dtype: torch.dtype) -> None:
    limit = quant_cpu.INT8_PACKED_MAX_TOKENS if kind == "int8" else quant_cpu.INT4_PACKED_MAX_TOKENS
    gen = torch.Generator().manual_seed(5)
    for n, k in SHAPES:
        w = quantized(kind, n, k, dtype)
        bias = torch.randn(n, generator=gen).to(dtype)
        for tokens in (1, 3, limit, limit + 1, 70):
            x = torch.randn(tokens, k, generator=gen).to(dtype)
            close(linear(x, w, bias), linear_ref(x, w, bias), dtype)
            close(linear(x, w), linear_ref(x, w), dtype)


@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_packed_kernels_and_the_dequantized_path_agree(kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's packed int8/int4 kernels (where the native int8 panels are not built: they are tested in
    test_native_cpu.py) against the dequantize-then-matmul path."""
    from kernels import native_cpu

    monkeypatch.setattr(native_cpu, "available_for", lambda t: None)
    w = quantized(kind, 176, 64, torch.bfloat16)
    assert getattr(w, "layout", None) != "panels"
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(6)).bfloat16()
    packed = linear(x, w)
    monkeypatch.setattr(quant_cpu, "INT8_PACKED_MAX_TOKENS", 0)
    monkeypatch.setattr(quant_cpu, "INT4_PACKED_MAX_TOKENS", 0)
    dequantized = linear(x, w)
    close(packed, dequantized, torch.bfloat16)
    assert not torch.equal(packed, dequantized)  # two different computations, not the same path twice


def test_a_missing_packed_kernel_falls_back_to_dequantize(monkeypatch: pytest.MonkeyPatch, torch_int4: None) -> None:
    monkeypatch.setattr(quant_cpu, "HAS_INT8_MM", False)
    monkeypatch.setattr(quant_cpu, "HAS_INT4_MM", False)
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    for w in (quantized("int8", 64, 64, torch.bfloat16), quantized("int4", 64, 64, torch.bfloat16)):
        if isinstance(w, quant.Int4Weight):
            assert w.layout == "nibbles"  # int4 is not packed for a kernel that is missing
        close(linear(x, w), linear_ref(x, w), torch.bfloat16)


def test_fused_weights_are_their_parts_stacked() -> None:
    parts = [weight(32, 64, seed=s) for s in range(3)]
    for make in (lambda w: quant.quantize_int8(w, torch.float32), lambda w: quant.quantize_int4(w, 32, torch.float32)):
        fused = quant.concat([make(w) for w in parts])
        assert torch.equal(dequantize(fused), torch.cat([dequantize(make(w)) for w in parts]))


def test_linear_refuses_activations_of_another_dtype() -> None:
    w = quantized("int8", 16, 32, torch.bfloat16)
    with pytest.raises(ValueError, match="scales are torch.bfloat16"):
        linear(torch.zeros(1, 32), w)


# ----- the Triton kernel (interpreted on CPU here, compiled on a GPU) ---------------------------------------


def test_triton_kernel_is_interpreted_without_a_gpu() -> None:
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the kernel is compiled")
    from triton import knobs
    from triton.runtime.interpreter import InterpretedFunction

    from kernels import quant_triton

    assert knobs.runtime.interpret
    assert isinstance(quant_triton._quant_matmul_kernel, InterpretedFunction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("kind", ["int8", "int4"])
def test_triton_matmul_matches_reference(kind: str, dtype: torch.dtype, triton_device: torch.device) -> None:
    from kernels import quant_triton

    gen = torch.Generator().manual_seed(8)
    for n, k in ((48, 64), (130, 96)):
        w = weight(n, k, seed=9)
        host = quant.quantize_int8(w, dtype) if kind == "int8" else quant.quantize_int4(w, 32, dtype)
        dev = place(host, "cuda") if triton_device.type == "cuda" else host  # the interpreter reads nibbles
        for tokens in (1, 5, 20):  # the three row tiles of MATMUL_CONFIGS
            x = torch.randn(tokens, k, generator=gen).to(dtype)
            y = quant_triton.matmul(x.to(triton_device), dev).cpu()
            close(y, linear_ref(x, host), dtype)


def test_triton_linear_dequantizes_for_long_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    from kernels import quant_triton

    monkeypatch.setattr(quant_triton, "CUDA_KERNEL_MAX_TOKENS", 4)
    gen = torch.Generator().manual_seed(10)
    for host in (quant.quantize_int8(weight(48, 64), torch.float32), quant.quantize_int4(weight(48, 64), 32, torch.float32)):
        x, bias = torch.randn(6, 64, generator=gen), torch.randn(48, generator=gen)
        close(quant_triton.linear(x, host, bias), linear_ref(x, host, bias), torch.float32)
