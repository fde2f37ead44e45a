"""The native CPU ops (kernels/native_cpu.py) against their torch twins and the naive references.

The library must build on every machine the suite runs on (setup installs g++ and ninja): a silent fall
back to the torch path would leave the engine's CPU serving path untested, so its absence fails here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from kernels import dense_cpu, native_cpu
from kernels.attention import StepAttentionPlan, paged_attention, paged_attention_ref, scoring_query, write_kv
from kernels.fused import add_rms_norm, rms_norm_ref, rope_store_kv, rotate_half_ref, silu_mul


def test_the_library_builds_and_is_named_for_this_source_and_cpu(ops):
    name = native_cpu.loaded_name()
    assert name is not None and name.startswith("loraplex_cpu_")
    assert native_cpu.build_name() == name == native_cpu.build_dir().name  # the source here is what was built
    assert (native_cpu.build_dir() / f"{name}.so").exists()


@pytest.mark.parametrize("march", ["x86-64-v3", "icelake-server", "sapphirerapids"])
def test_the_source_compiles_for_other_x86_cpus(march):
    """The build targets the host (-march=native), so a preprocessor branch this CPU does not take is never
    compiled by the tests: AVX2 only, AVX-512 without BF16 or AMX, and AMX tiles (which the AMD CI machines
    lack) are each compiled here, syntax and types only (g++ -fsyntax-only, ~10 s)."""
    import platform
    import shutil
    import subprocess
    import sysconfig

    from torch.utils import cpp_extension

    if platform.machine() != "x86_64" or shutil.which("g++") is None:
        pytest.skip("needs g++ on x86-64")
    includes = [f"-I{p}" for p in [*cpp_extension.include_paths(), sysconfig.get_paths()["include"]]]
    cmd = ["g++", "-std=c++17", "-fsyntax-only", "-fopenmp", f"-march={march}", "-DTORCH_EXTENSION_NAME=check",
           *includes, str(native_cpu.SOURCE)]
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    errors = [ln for ln in res.stderr.splitlines() if ": error:" in ln]
    assert res.returncode == 0 and not errors, "\n".join(errors[:10]) or res.stderr[-2000:]


def _decode_batch(paged_batch, lens, *, block_size, num_kv_heads, group, head_dim, dtype, seed, head_major):
    batch = paged_batch([1] * len(lens), lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                        head_dim=head_dim, dtype=dtype, seed=seed)
    k, v = batch.k_cache, batch.v_cache
    if head_major:  # the engine's CPU storage: (H_kv, blocks, block_size, D) seen as (blocks, block_size, H_kv, D)
        k, v = (t.permute(2, 0, 1, 3).contiguous().permute(1, 2, 0, 3) for t in (k, v))
    return batch, k, v


@pytest.mark.parametrize(
    ("block_size", "num_kv_heads", "group", "head_dim", "window"),
    [(16, 3, 3, 64, None), (8, 2, 4, 128, None), (4, 1, 1, 32, None), (16, 2, 2, 64, 9), (4, 2, 8, 80, 1),
     (16, 1, 5, 64, None), (16, 2, 3, 128, 40), (16, 1, 3, 80, None), (8, 2, 1, 80, None)],
    # query heads in register chunks of 4 (D 64) / 2 (D 128) + a rest; AVX2 builds sum values 32 columns a pass
    # for up to 3 heads, so D 80 ends on a 16-column pass
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_major", [False, True])
def test_decode_attention_matches_the_naive_reference(ops, paged_batch, dense_attention, block_size, num_kv_heads,
                                                      group, head_dim, window, dtype, head_major):
    lens = [1, 37, 5, 100, 64, 16, 17]  # one key, block edges, a long one
    batch, k, v = _decode_batch(paged_batch, lens, block_size=block_size, num_kv_heads=num_kv_heads, group=group,
                                head_dim=head_dim, dtype=dtype, seed=head_dim + group, head_major=head_major)
    scale = head_dim**-0.5
    ids = torch.arange(len(lens))
    out = ops.decode_attention(batch.q, k, v, batch.block_tables, ids, batch.seq_lens, scale, window or 0)
    assert out.dtype == dtype and out.shape == batch.q.shape
    want = dense_attention(batch, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def test_decode_attention_reads_the_sequences_it_is_given(ops, paged_batch, dense_attention):
    """Rows name their sequence (a mixed step's decode rows are a subset, in any order)."""
    batch = paged_batch([1, 1, 1, 1], [30, 3, 50, 9], block_size=8, num_kv_heads=2, group=2, head_dim=64, seed=4)
    ids = torch.tensor([2, 0], dtype=torch.int64)
    out = ops.decode_attention(batch.q[ids], batch.k_cache, batch.v_cache, batch.block_tables, ids, batch.seq_lens,
                               0.125, 0)
    want = dense_attention(batch, 0.125, None)[ids]
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_over_shared_prefix_blocks_in_any_row_order(ops, paged_batch, dense_attention, dtype):
    """Rows whose sequences share a cached prefix (their leading blocks) are computed next to each other
    (the kernel's work order): each row's output still lands in its own place, whatever the rows' order."""
    lens = [45, 40, 33, 47, 36, 48, 8]  # two prefix groups of 2 blocks, interleaved, and a row on its own
    batch = paged_batch([1] * len(lens), lens, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype,
                        seed=11)
    for row in range(2, 6):  # rows 0, 2, 4 share row 0's first two blocks; rows 1, 3, 5 row 1's
        batch.block_tables[row, :2] = batch.block_tables[row % 2, :2]
    ids = torch.tensor([5, 0, 6, 3, 1, 4, 2], dtype=torch.int64)
    out = ops.decode_attention(batch.q[ids], batch.k_cache, batch.v_cache, batch.block_tables, ids, batch.seq_lens,
                               0.125, 0)
    want = dense_attention(batch, 0.125, None)[ids]
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


def _share(batch, rows, blocks):
    """Rows `rows` read the first `blocks` blocks of rows[0]'s table (a prefix the radix cache hands them all)."""
    for row in rows[1:]:
        batch.block_tables[row, :blocks] = batch.block_tables[rows[0], :blocks]


@pytest.mark.parametrize(("num_kv_heads", "group", "head_dim"), [(3, 3, 64), (2, 4, 128), (1, 16, 64), (2, 1, 64)])
@pytest.mark.parametrize(("q_dtype", "cache_dtype"),
                         [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                          (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("scale", [0.125, 1.0])  # 1.0: peaked rows, the prefix's and a row's own maxima far apart
def test_decode_attention_over_long_shared_prefixes_matches_the_naive_reference(
        ops, paged_batch, dense_attention, num_kv_heads, group, head_dim, q_dtype, cache_dtype, scale):
    """Sequences that share 64 keys or more from position 0 on read them once per group (AVX2 builds: one
    pass per group, tile of 8 members and kv head, whose state each member's own pass merges): a group of 10
    (two tiles), one whose shortest member keeps a single key of its own, a group nested in a wider one, a
    pair sharing only 32 keys (each on its own), rows on their own; a subset of the rows, in shuffled order."""
    lens = [100, 97, 130, 120, 150, 99, 101, 140, 111, 105,  # 0-9 share 6 blocks (96 keys)
            65, 81, 90,  # 10-12 share 5 blocks: row 10 keeps key 64 (the 65th) to itself
            200, 180, 170, 220,  # 13-16 share 4 blocks, 14 and 15 share 10
            40, 50,  # 17-18 share 2 blocks: too few
            77, 1]  # on their own
    batch = paged_batch([1] * len(lens), lens, block_size=16, num_kv_heads=num_kv_heads, group=group,
                        head_dim=head_dim, dtype=q_dtype, seed=head_dim + group)
    _share(batch, list(range(10)), 6)
    _share(batch, [10, 11, 12], 5)
    _share(batch, [13, 14, 15, 16], 4)
    _share(batch, [14, 15], 10)
    _share(batch, [17, 18], 2)
    k, v = batch.k_cache.to(cache_dtype), batch.v_cache.to(cache_dtype)
    meant = dataclasses.replace(batch, q=scoring_query(batch.q, cache_dtype), k_cache=k.to(q_dtype),
                                v_cache=v.to(q_dtype))
    ids = torch.randperm(len(lens), generator=torch.Generator().manual_seed(3))[:-2]  # two rows left out
    out = ops.decode_attention(batch.q[ids], k, v, batch.block_tables, ids, batch.seq_lens, scale, 0)
    want = dense_attention(meant, scale, None)[ids]
    tol = 1e-2 if q_dtype == torch.bfloat16 else 1e-5  # bf16 q: the output's own rounding
    if q_dtype != cache_dtype:
        # float32 q over a bf16 cache: a row that merges a shared pass (rows 0-16, on builds that have it) keeps
        # its probabilities in fp32; the others round theirs to bf16 as the AVX-512 kernel weighs them, within
        # test_kv_cache_dtypes' bound of the reference that rounds them too
        merged = ids < 17 if ops.has_shared_prefix_decode() else torch.zeros_like(ids, dtype=torch.bool)
        rounded = dense_attention(meant, scale, None, torch.bfloat16)[ids]
        torch.testing.assert_close(out[~merged].double(), rounded[~merged], atol=1e-3, rtol=1e-3)
        out, want = out[merged], want[merged]
    torch.testing.assert_close(out.double(), want, atol=tol, rtol=tol)


@pytest.fixture
def restore_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_results_do_not_depend_on_the_threads_or_on_who_takes_which_item(ops, paged_batch, restore_threads):
    """The GEMMs, the attentions and the LoRA add split their items across threads and let a thread that is
    done take the rest of another's share (parallel_stealing): every item is computed the same way by
    whoever takes it, once. 1 thread against 2, 3 and 7 on this machine's cores (oversubscribed, so some
    threads are descheduled mid-share and others take their items), three calls each: equal to the bit."""
    from kernels.quant import linear, place, quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(17)
    cases = []  # (name, fn)
    for dtype in (torch.float32, torch.bfloat16):
        if not (ops.has_bf16_linear() if dtype == torch.bfloat16 else ops.has_f32_linear()):
            continue
        w, x = torch.randn(600, 96, generator=g).to(dtype), torch.randn(40, 96, generator=g).to(dtype)
        packed = dense_cpu.pack(w)
        for m in (1, 3, 40):  # one row (bf16: runs of 8 panels), one tile (no prefetch), several (fetched ahead)
            cases.append((f"dense {dtype} m={m}", lambda x=x[:m], packed=packed: dense_cpu.linear(x, packed)))
    if ops.has_bf16_linear():
        xb = torch.randn(40, 128, generator=g).bfloat16()
        placed8 = place(quantize_int8(torch.randn(600, 128, generator=g), torch.bfloat16), "cpu")
        placed4 = place(quantize_int4(torch.randn(600, 128, generator=g), 32, torch.bfloat16), "cpu")
        for m in (1, 3, 13):  # runs of 8 panels, streaming tiles, the widened-panel scratch
            cases.append((f"int8 m={m}", lambda x=xb[:m]: linear(x, placed8)))
            cases.append((f"int4 m={m}", lambda x=xb[:m]: linear(x, placed4)))
    if ops.has_w8a8_linear():
        placed = place(quantize_int8(torch.randn(600, 128, generator=g), torch.bfloat16, activations="int8"), "cpu")
        x8 = torch.randn(13, 128, generator=g).bfloat16()
        cases.append(("w8a8", lambda: linear(x8, placed)))
        cases.append(("w8a8 m=1", lambda: linear(x8[:1], placed)))  # runs of 8 quads' panels
    if ops.has_w4a8_linear():
        placed4a8 = place(quantize_int4(torch.randn(600, 128, generator=g), 32, torch.float32, activations="int8"),
                          "cpu")
        x4 = torch.randn(13, 128, generator=g)
        cases.append(("w4a8", lambda: linear(x4, placed4a8)))
    lens = [45, 40, 33, 47, 36, 48, 8, 70, 1, 16]
    for dtype in (torch.float32, torch.bfloat16):
        b = paged_batch([1] * len(lens), lens, block_size=16, num_kv_heads=3, group=3, head_dim=64, dtype=dtype,
                        seed=5)
        b.block_tables[2:6, :2] = b.block_tables[0, :2]  # a shared prefix: rows ordered by their first block
        ids = torch.arange(len(lens))
        cases.append((f"decode attention {dtype}", lambda b=b, ids=ids: ops.decode_attention(
            b.q, b.k_cache, b.v_cache, b.block_tables, ids, b.seq_lens, 0.125, 0)))
        if ops.has_prefill_attention():
            pb = paged_batch([90, 17], [130, 17], block_size=16, num_kv_heads=2, group=3, head_dim=64, dtype=dtype,
                             seed=6)
            cases.append((f"prefill attention {dtype}", lambda pb=pb: paged_attention(*pb.args(), 0.125, None)))
    for dtype in (torch.float32, torch.bfloat16):  # the batched LoRA add: tiles of one slot's tokens
        h_in, sizes, R, S = 100, [200, 72], 16, 3
        ranks, scaling = torch.tensor([[16, 3], [1, 16], [7, 0]], dtype=torch.int32), torch.full((S, 2), 0.5)
        lora_a = torch.randn(S, 2 * R, h_in, generator=g).to(dtype)
        b_t = torch.randn(S, R, sum(sizes), generator=g).to(dtype)
        slots = torch.randint(-1, S, (40,), generator=g, dtype=torch.int32)
        x, y = torch.randn(40, h_in, generator=g).to(dtype), torch.randn(40, sum(sizes), generator=g).to(dtype)

        def add(y=y, x=x, lora_a=lora_a, b_t=b_t, ranks=ranks, scaling=scaling, slots=slots, sizes=sizes):
            out = y.clone()
            ops.lora_add(out, x, lora_a, b_t, ranks, scaling, slots, sizes)
            return out
        cases.append((f"lora_add {dtype}", add))
    assert cases
    torch.set_num_threads(1)
    want = {name: fn() for name, fn in cases}
    for threads in (2, 3, 7):
        torch.set_num_threads(threads)
        for name, fn in cases:
            for _ in range(3):
                assert torch.equal(fn(), want[name]), f"{name}, {threads} threads"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_on_mixed_batches_equals_the_reference(ops, paged_batch, dtype):
    batch = paged_batch([1, 7, 1, 12, 3, 1], [9, 7, 20, 33, 5, 1], block_size=4, num_kv_heads=2, group=2,
                        head_dim=64, dtype=dtype, seed=1)
    plan = StepAttentionPlan.build(batch.block_tables, batch.query_start_loc, batch.seq_lens, 4, 6)
    got = paged_attention(*batch.args(), 0.2, 6, plan)
    want = paged_attention_ref(*batch.args(), 0.2, 6, plan)
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # the reference rounds bf16 probabilities, the kernel does not
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_equals_the_twin(ops, dtype, with_delta):
    g = torch.Generator().manual_seed(3)
    residual = (torch.randn(9, 576, generator=g) * 3).to(dtype)
    delta = torch.randn(9, 576, generator=g).to(dtype) if with_delta else None
    weight = (torch.rand(576, generator=g) + 0.5).to(dtype)
    want_new = residual + delta if delta is not None else residual.clone()
    want = rms_norm_ref(want_new, weight, 1e-5)
    mine = residual.clone()
    new, out = add_rms_norm(mine, delta, weight, 1e-5)
    assert new.data_ptr() == mine.data_ptr()  # updated in place, as the layer loop expects
    assert torch.equal(new, want_new)  # the residual add rounds like torch's
    tol = 1e-6 if dtype == torch.float32 else 8e-3  # bf16: an occasional last-bit difference
    torch.testing.assert_close(out.float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_equals_the_twin(ops, dtype):
    x = (torch.randn(7, 2 * 1536, generator=torch.Generator().manual_seed(5)) * 4).to(dtype)
    gate, up = x.chunk(2, dim=-1)
    want = F.silu(gate) * up
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(silu_mul(x).float(), want.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_store_kv_equals_the_twin(ops, dtype):
    g = torch.Generator().manual_seed(6)
    n_tok, hq, hkv, d, block_size, blocks = 5, 6, 2, 64, 4, 8
    qkv = torch.randn(n_tok, (hq + 2 * hkv) * d, generator=g).to(dtype)
    pos = torch.tensor([0, 3, 17, 100, 2047])
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    emb = torch.cat([torch.outer(pos.float(), inv)] * 2, dim=-1)
    cos, sin = emb.cos()[:, None, :], emb.sin()[:, None, :]
    slots = torch.tensor([3, 0, 17, 30, 9])
    storage = torch.zeros(2, hkv, blocks, block_size, d, dtype=dtype)  # head-major k and v caches
    k_cache, v_cache = storage[0].permute(1, 2, 0, 3), storage[1].permute(1, 2, 0, 3)
    ref_k, ref_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)

    def views(t):
        return (t[:, : (hq + hkv) * d].view(n_tok, hq + hkv, d), t[:, (hq + hkv) * d :].view(n_tok, hkv, d))

    rot = rotate_half_ref(views(qkv)[0], cos, sin)
    write_kv(rot[:, hq:], views(qkv)[1], ref_k, ref_v, slots)
    mine = qkv.clone()
    q = rope_store_kv(*views(mine), cos, sin, hq, k_cache, v_cache, slots)
    tol = 1e-6 if dtype == torch.float32 else 8e-3
    torch.testing.assert_close(q.float(), rot[:, :hq].float(), atol=tol, rtol=tol)
    torch.testing.assert_close(k_cache.float(), ref_k.float(), atol=tol, rtol=tol)
    assert torch.equal(v_cache, ref_v)  # values are copied as they are


def _need_panels(ops, dtype):
    """The panel GEMMs are compiled only where the compiler targets AVX512-BF16 (bf16), AVX-512 or AVX2 (fp32)."""
    if not (ops.has_bf16_linear() if dtype == torch.bfloat16 else ops.has_f32_linear()):
        pytest.skip(f"this CPU has no native {dtype} panel kernel "
                    f"({'no AVX512-BF16' if dtype == torch.bfloat16 else 'neither AVX-512 nor AVX2'})")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("n", "k"), [(96, 80), (72, 64), (600, 96), (44, 48)])
def test_panel_linear_equals_f_linear(ops, dtype, m, n, k):
    """Every tile shape: rows 1..6 and their remainders (AVX2: 1 row x 4 panels, 2-3 x 2, 4-6 x 1), panel
    groups of 1..4, N not a multiple of 16 (72: half a panel; 44: part of one half)."""
    _need_panels(ops, dtype)
    g = torch.Generator().manual_seed(m + n)
    w, bias = (torch.randn(n, k, generator=g) / k**0.5).to(dtype), torch.randn(n, generator=g).to(dtype)
    x = torch.randn(m, k, generator=g).to(dtype)
    packed = dense_cpu.pack(w)
    assert packed.layout == "panels"
    for b in (None, bias):
        got, want = dense_cpu.linear(x, packed, b), F.linear(x.float(), w.float(), None if b is None else b.float())
        assert got.shape == (m, n) and got.dtype == dtype
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)
    assert torch.equal(dense_cpu.unpack(packed), w)
    ids = torch.tensor([0, n - 1, 17, 17, 5])
    assert torch.equal(dense_cpu.rows(packed, ids), w[ids])  # a tied embedding's lookup
    assert packed.nbytes == -(-n // 16) * 16 * k * w.element_size()


@pytest.mark.parametrize("panels", [1, 3, 5, 8, 13, 36, 60, 128])
def test_decode_rows_equal_the_same_rows_in_a_batch(ops, panels, restore_threads):
    """One or two rows stream their panels (bf16 and int8 panels, w8a8 quads) in runs of up to 8, split evenly
    across the threads (float32 panels: groups of 4); more rows run the 6-row tiles over groups of 4. All sum
    every column in the same k order, so a row's product does not depend on how many rows came with it: equal
    to the bit. Panel counts give runs of 1..8 on 1 and 2 threads, and N ends part-way into its last panel."""
    from kernels.quant import linear, place, quantize_int8

    g = torch.Generator().manual_seed(panels)
    n, k = 16 * panels - 5, 256
    # W's second half is minus its first and x's second half equals its first: every exact sum is 0, and what
    # the fp32 sums leave is their rounding, which another order of k changes (random data would round to
    # the same bf16 almost always). w8a8 sums exact integers in any order: for it, the test holds each run's
    # columns, scales and row sums to the batch path's (random values).
    w = torch.randn(n, k // 2, generator=g) * 2.0 ** torch.randint(-8, 8, (n, k // 2), generator=g)
    w = torch.cat([w, -w], 1)
    x = torch.randn(13, k // 2, generator=g).repeat(1, 2)
    cases = []  # (name, x, weight)
    if ops.has_bf16_linear():
        cases += [("bf16", x.bfloat16(), dense_cpu.pack(w.bfloat16())),
                  ("int8", x.bfloat16(), place(quantize_int8(w, torch.bfloat16), "cpu"))]
    if ops.has_f32_linear():
        cases.append(("float32", x, dense_cpu.pack(w)))
    if ops.has_w8a8_linear():
        w8 = quantize_int8(torch.randn(n, k, generator=g), torch.bfloat16, activations="int8")
        cases.append(("w8a8", torch.randn(13, k, generator=g).bfloat16(), place(w8, "cpu")))
    if not cases:
        pytest.skip("this CPU has no native panel kernel")
    for name, xs, packed in cases:
        bias = torch.randn(n, generator=g).to(xs.dtype)
        for threads in (1, 2):
            torch.set_num_threads(threads)
            for b in (None, bias):
                whole = linear(xs, packed, b)
                for m in (1, 2):
                    for i in range(0, 13 - m + 1, 3):
                        assert torch.equal(linear(xs[i:i + m], packed, b), whole[i:i + m]), (name, threads, m, i)
                assert ops.set_stream_rows(0) == 2  # 1 and 2 rows on the tiles, as before the runs
                try:
                    assert torch.equal(linear(xs[:2], packed, b), whole[:2]), (name, threads, "tiles")
                finally:
                    ops.set_stream_rows(2)


def test_panel_linear_takes_strided_rows_and_leading_dims(ops):
    _need_panels(ops, torch.float32)
    g = torch.Generator().manual_seed(9)
    w = torch.randn(48, 64, generator=g)
    packed = dense_cpu.pack(w)
    wide = torch.randn(10, 100, generator=g)
    x = wide[:, 3:67]  # row stride 100
    torch.testing.assert_close(dense_cpu.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 3, 64, generator=g)
    torch.testing.assert_close(dense_cpu.linear(x3, packed), F.linear(x3, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 6, 7, 13, 64])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 32), (600, 96), (44, 48)])
def test_int8_panels_equal_the_dequantized_product(ops, m, n, k, dtype):
    """Streaming tiles (up to 6 rows) and the widened-to-bf16 path (more rows), with a bias; float32
    activations read single-k int8 panels (the AVX2 kernel, fp32 sums: within fp32 rounding)."""
    from kernels.quant import dequantize, int8_rows, linear, place, quantize_int8

    if dtype == torch.bfloat16:
        _need_panels(ops, torch.bfloat16)
    elif not ops.has_int8_linear_f32():
        pytest.skip("this CPU has no native int8 kernel for float32 activations (no AVX2)")
    g = torch.Generator().manual_seed(m * n)
    q = quantize_int8(torch.randn(n, k, generator=g), dtype)
    placed = place(q, "cpu")
    assert placed.layout == "panels" and placed.shape == (n, k)
    assert torch.equal(int8_rows(placed), q.qweight) and torch.equal(dequantize(placed), dequantize(q))
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    for b in (None, bias):
        want = F.linear(x.float(), dequantize(q), None if b is None else b.float())
        got = linear(x, placed, b)
        assert got.dtype == dtype and got.shape == (m, n)
        torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol * want.abs().max().item())
    assert isinstance(place(placed, "cpu").qweight, torch.Tensor)  # placing again keeps the values
    assert torch.equal(int8_rows(place(placed, "cpu")), q.qweight)


def assert_matches_exact(got: torch.Tensor, exact: torch.Tensor) -> None:
    """An integer-activation product against its exact float64 value: bf16 to its rounding of the exact value,
    float32 to fp32 sums (1e-5 of the largest output)."""
    if got.dtype == torch.bfloat16:
        torch.testing.assert_close(got.double(), exact.bfloat16().double(), rtol=8e-3, atol=1e-6)
    else:
        torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-5 * exact.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 6, 7, 13, 40])
@pytest.mark.parametrize(("n", "k"), [(96, 64), (40, 32), (600, 96), (16, 1536)])
def test_w8a8_quads_equal_the_integer_product(ops, m, n, k, dtype):
    """One tile (1-6 rows, 4 on AVX2; no prefetch) and several, N not a multiple of 16 (nor of 8), a long
    K, an all-zero row, a bias, weights and rows at the +-127 extremes (AVX2 sums products in int16 pairs:
    they must not saturate): the exact integer product of the rounded rows and q (float64), scaled once,
    in x's dtype (bf16: VNNI or AVX2 builds; float32: AVX2 builds)."""
    from kernels.quant import int8_rows, linear, place, quantize_int8, round_rows_int8

    if not (ops.has_w8a8_linear() if dtype == torch.bfloat16 else ops.has_w8a8_linear_f32()):
        pytest.skip(f"no native int8 kernel for {dtype} x here: w8a8 runs the rounded rows through the "
                    "weight-only path")
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    w[0, : k // 2] = w[0].abs().max() * torch.where(torch.arange(k // 2) % 3 == 0, -1.0, 1.0)  # q = +-127
    q = quantize_int8(w, dtype, activations="int8")
    placed = place(q, "cpu")
    assert placed.layout == "quads" and placed.shape == (n, k) and placed.activations == "int8"
    assert torch.equal(int8_rows(placed), q.qweight)
    assert placed.nbytes == -(-n // 16) * 16 * k + n * q.scales.element_size()
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0, : k // 2] = torch.where(torch.arange(k // 2) % 2 == 0, -5.0, 5.0).to(dtype)  # qx = +-127 against q = +-127
    x[m // 2] = 0  # its scale is 0: the row's products are 0 (plus the bias), not NaN
    bias = torch.randn(n, generator=g).to(dtype)
    qx, sx = round_rows_int8(x)
    for b in (None, bias):
        exact = (qx.double() @ q.qweight.double().T) * sx.double()[:, None] * q.scales.double()[None, :]
        if b is not None:
            exact = exact + b.double()
        got = linear(x, placed, b)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_matches_exact(got, exact)
    assert torch.equal(int8_rows(place(placed, "cpu")), q.qweight)  # placing again keeps the values


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 13, 40, 70])
@pytest.mark.parametrize(("n", "k", "group"), [(96, 64, 32), (40, 64, 32), (600, 128, 64), (16, 1536, 128),
                                               (24, 256, 256)])
def test_w4a8_quads_equal_the_integer_product(ops, m, n, k, group, dtype):
    """int4 weights x rows rounded to int8 (AVX2 builds): one tile (1-4 rows) and several, both kernels (the
    one for 1-7 rows and the one from 8, whose K = 1536 runs in two chunks and 70 rows in two blocks), N not a
    multiple of 16 (nor of 8), every group size, a bias, an all-zero row, and the int16 extremes: q = 15 (and
    0) against qx = +-127 for a whole row, eight pair sums at 2 * 15 * 127 each in one int16 lane before it widens.
    Against the exact product of the rounded rows and the dequantized weight (float64), scaled once, in x's
    dtype; each row alone equals the row in the batch, to the bit."""
    from kernels.quant import (
        dequantize,
        int4_from_values,
        int4_scale_zeros,
        int4_values,
        linear,
        place,
        round_rows_int8,
    )

    if not ops.has_w4a8_linear():
        pytest.skip("no native int4 x int8 kernel here: w4a8 runs the rounded rows through the int4 path")
    g = torch.Generator().manual_seed(m * n + k + group)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    values[0], values[1] = 15, 0
    scales = (torch.rand(k // group, n, generator=g) * 0.1 + 0.01).to(dtype)
    zeros = (torch.randn(k // group, n, generator=g) * 0.1).to(dtype)
    q = int4_from_values(values, scales, zeros, group, activations="int8")
    placed = place(q, "cpu")
    assert placed.layout == "quads" and placed.shape == (n, k) and placed.activations == "int8"
    assert torch.equal(int4_values(placed), values)
    padded = -(-n // 16) * 16  # the quads and their panel-major scales and zeros hold whole panels
    assert placed.nbytes == padded * k // 2 + padded * (k // group) * 2 * dtype.itemsize
    assert torch.equal(int4_scale_zeros(placed), q.scale_zeros)
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0] = -2.0 if m % 2 else 2.0  # qx = +-127 at every k
    x[m // 2] = 0 if m > 1 else x[m // 2]  # its scale is 0: the row's products are 0 (plus the bias), not NaN
    bias = torch.randn(n, generator=g).to(dtype)
    qx, sx = round_rows_int8(x)
    w = dequantize(q, torch.float64)
    for b in (None, bias):
        exact = (qx.double() @ w.T) * sx.double()[:, None]
        if b is not None:
            exact = exact + b.double()
        got = linear(x, placed, b)
        assert got.dtype == dtype and got.shape == (m, n)
        assert_matches_exact(got, exact)
        assert torch.equal(torch.cat([linear(x[i : i + 1], placed, b) for i in range(m)]), got)
    assert torch.equal(int4_values(place(placed, "cpu")), values)  # placing again keeps the values


@pytest.fixture
def w4a8_vnni_restored(ops):
    """w4a8's AVX512-VNNI kernel switched back on after the test (a failing test must not leave it off)."""
    yield
    ops.set_w4a8_vnni(True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 5, 7, 8, 9, 13, 40, 70])
@pytest.mark.parametrize(("n", "k", "group"), [(40, 64, 32), (600, 128, 64), (16, 1536, 128), (24, 256, 256)])
def test_w4a8_vnni_kernel_equals_the_avx2_kernels(ops, w4a8_vnni_restored, m, n, k, group, dtype):
    """Where the CPU has AVX512-VNNI, w4a8 runs 4-k products straight into int32 (1-3 rows with two sums a row,
    tiles of 8 rows and a remainder); its int32 sums are exact and its fp32 steps the AVX2 kernels', so the two
    give the same bits, the int16 extremes (q = 15 and 0 against qx = +-127) and a zero row included."""
    from kernels.quant import int4_from_values, linear, place

    if not ops.set_w4a8_vnni(True):
        pytest.skip("this CPU has no AVX512-VNNI: w4a8 runs the AVX2 kernels only")
    g = torch.Generator().manual_seed(7 * m + n + k + group)
    values = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    values[0], values[1] = 15, 0
    scales = (torch.rand(k // group, n, generator=g) * 0.1 + 0.01).to(dtype)
    zeros = (torch.randn(k // group, n, generator=g) * 0.1).to(dtype)
    placed = place(int4_from_values(values, scales, zeros, group, activations="int8"), "cpu")
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[0] = -2.0  # qx = -127 at every k
    x[m // 2] = 0 if m > 1 else x[m // 2]
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (None, bias):
        vnni = linear(x, placed, b)
        assert not ops.set_w4a8_vnni(False)
        avx2 = linear(x, placed, b)
        assert ops.set_w4a8_vnni(True)
        assert torch.equal(vnni, avx2)


@pytest.fixture
def amx_off(ops):
    """The AVX-512 tiles for the test's length, restored after (a failing test must not leave AMX off)."""
    ops.set_amx(False)
    yield
    ops.set_amx(True)


@pytest.mark.parametrize("m", [4, 15, 16, 17, 31, 33, 64, 100])
@pytest.mark.parametrize(("n", "k"), [(40, 64), (600, 96), (16, 1536), (72, 128)])
def test_amx_tiles_equal_the_avx512_tiles(ops, m, n, k):
    """Where the CPU has AMX, bf16 x of 4 rows and more runs on tiles: 1 or 2 row blocks of 16 (M not a
    multiple of 16: a zero-padded copy) x 1 or 2 panels (an odd panel count, N not a multiple of 16) for
    bf16 and int8 panels, int4 panels dequantized to bf16 per panel pair, and int8 x int8 quads for w8a8 (K a
    multiple of 64; 96 keeps the AVX-512 tiles). Held to the AVX-512 tiles' results: w8a8's int32 sums are
    exact both ways, so bit for bit; bf16 and int8 weight-only sum fp32 in another order, and int4 rounds
    each dequantized weight to bf16, so within the output's rounding."""
    from kernels.quant import linear, place, quantize_int4, quantize_int8

    if not ops.has_amx():
        pytest.skip("this CPU (or its OS) has no AMX tiles")
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g) / k**0.5
    x = torch.randn(m, k, generator=g).bfloat16()
    bias = torch.randn(n, generator=g).bfloat16()
    weights = {"bf16": dense_cpu.pack(w.bfloat16()),
               "int8": place(quantize_int8(w, torch.bfloat16), "cpu"),
               "w8a8": place(quantize_int8(w, torch.bfloat16, activations="int8"), "cpu"),
               "int4": place(quantize_int4(w, 32, torch.bfloat16), "cpu")}
    for name, packed in weights.items():
        run = (lambda b, p=packed: dense_cpu.linear(x, p, b)) if name == "bf16" else (lambda b, p=packed: linear(x, p, b))
        for b in (None, bias):
            assert ops.set_amx(True)
            tiles = run(b)
            ops.set_amx(False)
            try:
                avx512 = run(b)
            finally:
                ops.set_amx(True)
            assert tiles.shape == (m, n) and tiles.dtype == torch.bfloat16
            if name == "w8a8":
                assert torch.equal(tiles, avx512), name
            else:
                torch.testing.assert_close(tiles.float(), avx512.float(), rtol=1e-2, atol=1e-2 * avx512.abs().max().item())


@pytest.mark.parametrize("m", [1, 4, 17, 32, 100])
@pytest.mark.parametrize("tiles", ["vectors", "amx"])
def test_silu_linear_equals_silu_mul_of_the_product(ops, m, tiles, amx_off):
    """The fused gate/up op is silu_mul of the same kernel's product, bit for bit, for every weight kind the
    decode layer takes (bf16, fp32, int8, int4 panels, w8a8 and w4a8 quads, the quantized kinds with bf16 or
    float32 activations): on AMX tiles (bf16 panels and w8a8 quads) its epilogue rounds the gate and up sums to bf16
    as the product's store does, then runs silu_mul's operations; elsewhere the two ops run in turn. I = 48 (three 16-column panels per half), K = 128."""
    from engine.models.llama import _native_operands
    from kernels.quant import linear, place, quantize_int4, quantize_int8

    if tiles == "amx" and not ops.set_amx(True):
        pytest.skip("this CPU (or its OS) has no AMX tiles")
    g = torch.Generator().manual_seed(m)
    n, k = 96, 128
    w = torch.randn(n, k, generator=g) / k**0.5
    x = (torch.randn(m, k, generator=g) * 2).bfloat16()
    cases = {"fp32": (dense_cpu.pack(w), x.float()),
             "int8": (place(quantize_int8(w, torch.bfloat16), "cpu"), x),
             "w8a8": (place(quantize_int8(w, torch.bfloat16, activations="int8"), "cpu"), x),
             "int4": (place(quantize_int4(w, 32, torch.bfloat16), "cpu"), x),
             "int8-fp32": (place(quantize_int8(w, torch.float32), "cpu"), x.float()),
             "w8a8-fp32": (place(quantize_int8(w, torch.float32, activations="int8"), "cpu"), x.float()),
             "int4-fp32": (place(quantize_int4(w, 32, torch.float32), "cpu"), x.float()),
             "w4a8": (place(quantize_int4(w, 32, torch.bfloat16, activations="int8"), "cpu"), x),
             "w4a8-fp32": (place(quantize_int4(w, 32, torch.float32, activations="int8"), "cpu"), x.float())}
    if dense_cpu.can_pack(w.bfloat16()):  # a CPU without native bf16 keeps bf16 weights unpacked
        cases["bf16"] = (dense_cpu.pack(w.bfloat16()), x)
    # int4 panels read x as it is: an int8-input weight in them runs op by op (its rows rounded first), never
    # through the native layer's panel product
    assert _native_operands(dataclasses.replace(cases["int4-fp32"][0], activations="int8"), torch.float32) is None
    ran = []
    for name, (packed, xi) in cases.items():
        operands = _native_operands(packed, xi.dtype)
        if operands is None:
            continue  # this CPU's build keeps that kind out of native panels
        fused = ops.silu_linear(xi, *operands, n)
        want = ops.silu_mul(linear(xi, packed))
        assert fused.shape == (m, n // 2) and fused.dtype == xi.dtype, name
        assert torch.equal(fused, want), name
        ran.append(name)
    if tiles == "amx":  # an AMX CPU has the two fused kinds' native layouts
        assert {"bf16", "w8a8"} <= set(ran), ran
    if not ran:
        pytest.skip("no weight kind is in native panels on this CPU")


def test_set_amx_reports_whether_the_tiles_run(ops, amx_off):
    assert ops.set_amx(False) is False
    assert ops.set_amx(True) is ops.has_amx()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("m", [1, 2, 3, 4, 6, 7, 13, 40])
@pytest.mark.parametrize(("n", "k", "group_size"), [(96, 64, 32), (40, 128, 64), (600, 256, 128), (72, 64, 64)])
def test_int4_panels_equal_the_dequantized_product(ops, m, n, k, group_size, dtype):
    """Streaming tiles (bf16: 1-2 rows x 4 panels, 3-6 rows x 2; float32: 1-2 rows x 2 panels, 3-4 rows x 1),
    the widened path (more rows), N not a multiple of 16, every group size, with a bias: the fp32 product
    over the dequantized weights, rounded once to x's dtype. float32 activations read single-k panels (the
    AVX2 kernel)."""
    from kernels.quant import dequantize, int4_values, linear, place, quantize_int4

    if dtype == torch.bfloat16:
        _need_panels(ops, torch.bfloat16)
    elif not ops.has_int4_linear_f32():
        pytest.skip("this CPU has no native int4 kernel for float32 activations (no AVX2)")
    g = torch.Generator().manual_seed(m * n + k)
    q = quantize_int4(torch.randn(n, k, generator=g), group_size, dtype)
    placed = place(q, "cpu")
    assert placed.layout == "panels" and placed.shape == (n, k) and placed.group_size == group_size
    assert placed.qweight.shape[1:] == ((k // 2, 16) if dtype == torch.float32 else (k // 4, 32))
    assert torch.equal(int4_values(placed), int4_values(q)) and torch.equal(dequantize(placed), dequantize(q))
    # scales and zeros: not copied
    assert placed.nbytes == -(-n // 16) * 16 * k // 2 + q.scale_zeros.numel() * dtype.itemsize
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    for b in (None, bias):
        want = F.linear(x.float(), dequantize(q), None if b is None else b.float())
        got = linear(x, placed, b)
        assert got.dtype == dtype and got.shape == (m, n)
        if dtype == torch.bfloat16:
            # bf16 output rounding (2^-8 relative) on top of fp32 sums of 128 + q that the group terms cancel
            torch.testing.assert_close(got.float(), want, rtol=1e-2, atol=1e-2 * want.abs().max().item())
        else:  # fp32 sums of x * q per group, then scale and zero terms: within fp32 rounding
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    if dtype == torch.float32:  # each row as it comes out alone: the same FMAs at every batch size
        for i in range(m):
            assert torch.equal(linear(x[i : i + 1], placed, bias)[0], linear(x, placed, bias)[i])
    assert torch.equal(int4_values(place(placed, "cpu")), int4_values(q))  # placing again keeps the values


@pytest.mark.parametrize(("query_lens", "seq_lens", "window", "head_dim", "group"), [
    ([33, 1, 20], [33, 40, 100], None, 64, 3),  # fresh prompt, a decode row, a chunk over cached context
    ([50, 17], [90, 17], 9, 128, 4),
    ([16, 64], [16, 200], 1, 64, 1),
    ([130, 45], [200, 45], None, 64, 2),  # several 64-key blocks and 32-row items, a partial last 16-row tile
    ([77], [150], 70, 128, 2),  # a window wider than one block at head_dim 128
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tiles", ["vectors", "amx"])
def test_prefill_attention_matches_the_naive_reference(ops, paged_batch, dense_attention, query_lens, seq_lens,
                                                       window, head_dim, group, dtype, tiles, amx_off):
    """bf16 chunks run on AMX tiles where the CPU has them (AVX-512 bf16 dot products otherwise, or with
    set_amx(False)); fp32 ones always on AVX-512 vectors; without AVX-512 both on the AVX2 kernel."""
    if not ops.has_prefill_attention():
        pytest.skip("neither AVX-512 nor AVX2 here: prefill chunks run in torch")
    if tiles == "amx" and dtype == torch.float32:
        pytest.skip("fp32 chunks have no tile path")
    if tiles == "amx" and not ops.set_amx(True):
        pytest.skip("this CPU (or its OS) has no AMX tiles")
    batch = paged_batch(query_lens, seq_lens, block_size=16, num_kv_heads=2, group=group, head_dim=head_dim,
                        dtype=dtype, seed=sum(seq_lens))
    scale = head_dim**-0.5
    got = paged_attention(*batch.args(), scale, window)  # the native path: prefill chunks and decode rows
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), dense_attention(batch, scale, window), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lora_add_matches_the_float64_reference_over_wide_slices_and_odd_ranks(ops, dtype):
    """Slices wider than one 64-column chunk and not a multiple of 16, odd ranks (bf16 pairs them), an input
    width not a multiple of 32, base tokens (slot -1) and runs of up to 5 tokens per slot (a 4-token tile
    and a 1-token tile). bf16 rounds x, the factors, the shrunk activations and y: held to the delta's scale."""
    g = torch.Generator().manual_seed(7)
    h_in, sizes, R, S = 100, [200, 72, 8], 16, 3
    ranks = torch.tensor([[16, 3, 1], [1, 16, 0], [7, 0, 5]], dtype=torch.int32)
    scaling = torch.tensor([[0.5, 1.0, 2.0], [1.5, 0.25, 1.0], [1.0, 1.0, 0.75]])
    lora_a = (torch.randn(S, len(sizes) * R, h_in, generator=g) * 0.3).to(dtype)
    b_t = (torch.randn(S, R, sum(sizes), generator=g) * 0.3).to(dtype)
    slots = torch.tensor([0, 0, 2, -1, 0, 1, 0, 0, 2, 1, -1, 2], dtype=torch.int32)
    x = torch.randn(len(slots), h_in, generator=g).to(dtype)
    y = torch.randn(len(slots), sum(sizes), generator=g).to(dtype)
    want = y.double().clone()
    for t, s in enumerate(slots.tolist()):
        if s < 0:
            continue
        col = 0
        for i, n in enumerate(sizes):
            r = int(ranks[s, i])
            if r:
                a = lora_a[s, i * R : i * R + r].double()  # (r, h_in)
                u = (a @ x[t].double()) * float(scaling[s, i])
                want[t, col : col + n] += u @ b_t[s, :r, col : col + n].double()
            col += n
    got = y.clone()
    ops.lora_add(got, x, lora_a, b_t, ranks, scaling, slots, sizes)
    delta = (want - y.double()).abs().max()
    err = (got.double() - want).abs().max() / delta
    assert err < (1e-5 if dtype == torch.float32 else 0.02), err
    assert torch.equal(got[slots < 0], y[slots < 0])
