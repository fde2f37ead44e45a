"""The Triton dispatch launches only the configurations it exports (the ones the AOT compile test builds)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kernels import attention_triton, lora_triton  # noqa: E402
from kernels.attention import paged_attention_ref  # noqa: E402
from kernels.launch_config import LaunchConfig  # noqa: E402
from kernels.lora import add_lora_ref  # noqa: E402
from kernels.lora_meta import LoRABatchMeta  # noqa: E402


class LaunchRecorder:
    """Stands in for a @triton.jit kernel: records each launch's keyword arguments, then launches it."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self.launches: list[dict] = []

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            self.launches.append(kwargs)
            return launch(*args, **kwargs)

        return run

    def configs(self) -> list[LaunchConfig]:
        return [LaunchConfig.of(num_warps=k["num_warps"], num_stages=k["num_stages"],
                                **{n: v for n, v in k.items() if n.startswith("BLOCK_")}) for k in self.launches]


def _record(monkeypatch, module, name: str) -> LaunchRecorder:
    recorder = LaunchRecorder(getattr(module, name))
    monkeypatch.setattr(module, name, recorder)
    return recorder


@pytest.mark.parametrize("max_rank", [8, 80])  # 80: two rank tiles of 64 in shrink
@pytest.mark.parametrize("segments", [False, True], ids=["tokens", "segments"])
def test_lora_launches_use_exported_configs(max_rank, segments, monkeypatch, lora_weights, triton_device) -> None:
    ranks = [[max_rank], [max(1, max_rank - 10)], [3], [0]]
    weights = lora_weights(ranks, 24, (40,), max_rank=max_rank, seed=31)
    slots = [0] * 20 + [1] * 3 + [-1] + [2] * 2 + [3, 0] if segments else [0, 1, 2, -1, 3, 1]
    gen = torch.Generator().manual_seed(32)
    x = torch.randn(len(slots), 24, generator=gen)
    y = torch.randn(len(slots), 40, generator=gen)
    expected = y.clone()
    add_lora_ref(expected, x, weights, torch.tensor(slots))
    shrink = _record(monkeypatch, lora_triton, "_shrink_kernel")
    expand = _record(monkeypatch, lora_triton, "_expand_kernel")
    meta = LoRABatchMeta.build(slots, device=triton_device)
    y_dev = y.to(triton_device)
    lora_triton.add_lora(y_dev, x.to(triton_device), _to(weights, triton_device), meta, segments)
    torch.testing.assert_close(y_dev.cpu(), expected, atol=1e-3, rtol=1e-4)
    rows = meta.max_segment_len if segments else 1
    assert shrink.configs() == [lora_triton.shrink_config(rows, max_rank, torch.float32)]
    assert expand.configs() == [lora_triton.expand_config(rows, torch.float32)]
    assert shrink.configs()[0] in lora_triton.SHRINK_CONFIGS.values()
    assert all(k["enable_fp_fusion"] is True for k in shrink.launches + expand.launches)


@pytest.mark.parametrize(("group", "head_dim", "dtype"), [(16, 32, torch.float32), (16, 16, torch.bfloat16),
                                                           (3, 16, torch.float32)])
def test_attention_launches_use_exported_configs(group, head_dim, dtype, monkeypatch, paged_batch,
                                                 triton_device) -> None:
    batch = paged_batch([1, 20, 1, 3], [9, 20, 30, 7], block_size=8, num_kv_heads=1, group=group,
                        head_dim=head_dim, dtype=dtype, seed=33)
    decode = _record(monkeypatch, attention_triton, "_decode_kernel")
    prefill = _record(monkeypatch, attention_triton, "_prefill_kernel")
    out = attention_triton.paged_attention(*batch.args(triton_device), head_dim**-0.5, None)
    ref = paged_attention_ref(*batch.args(), head_dim**-0.5, None)
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=tol, rtol=tol)
    assert decode.configs() == [attention_triton.decode_config(group, head_dim)]
    assert decode.launches[0]["USE_DOT"] == (decode.configs()[0]["BLOCK_G"] >= 16)
    assert prefill.configs() == [attention_triton.prefill_config(20, head_dim, dtype)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_config_choice_covers_every_supported_shape(dtype) -> None:
    decode = set(attention_triton.DECODE_CONFIGS.values())
    prefill = set(attention_triton.PREFILL_CONFIGS.values())
    for group in range(1, attention_triton.MAX_GROUP + 1):
        for head_dim in (1, 8, 16, 24, 32, 48, 64, 80, 96, 112, 128, 160, 192, 256):
            assert attention_triton.decode_config(group, head_dim) in decode
            for query_len in (2, 16, 17, 8192):
                assert attention_triton.prefill_config(query_len, head_dim, dtype) in prefill
    shrink, expand = set(lora_triton.SHRINK_CONFIGS.values()), set(lora_triton.EXPAND_CONFIGS.values())
    for rows in (1, 2, 16, 17, 4096):
        assert lora_triton.expand_config(rows, dtype) in expand
        for max_rank in range(1, 513):
            config = lora_triton.shrink_config(rows, max_rank, dtype)
            assert config in shrink and config["BLOCK_R"] <= lora_triton.MAX_RANK_TILE


def test_attention_rejects_shapes_without_a_compiled_variant(triton_device) -> None:
    def args(num_heads: int, head_dim: int) -> tuple:
        return (torch.zeros(1, num_heads, head_dim, device=triton_device),
                torch.zeros(1, 4, 1, head_dim, device=triton_device), torch.zeros(1, 4, 1, head_dim, device=triton_device),
                torch.zeros(1, 1, dtype=torch.int32, device=triton_device),
                torch.tensor([0, 1], dtype=torch.int32, device=triton_device),
                torch.tensor([1], dtype=torch.int32, device=triton_device), 1.0)

    with pytest.raises(ValueError, match="support at most 16 and 256"):
        attention_triton.paged_attention(*args(32, 64))
    with pytest.raises(ValueError, match="support at most 16 and 256"):
        attention_triton.paged_attention(*args(1, 512))


def _to(weights, device):
    from dataclasses import replace

    return replace(weights, lora_a=weights.lora_a.to(device), lora_b=weights.lora_b.to(device),
                   scaling=weights.scaling.to(device), ranks=weights.ranks.to(device))
