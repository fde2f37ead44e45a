"""Hostile values aimed at the engine: the attacker gets a 4xx, a bystander's stream gets exactly its tokens.

One live gateway over an in-process engine. The checkpoint says bfloat16 (the engine itself computes in
float32 on this CPU), so uploads are checked against bfloat16's range.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import LORA_ARGS, adapter_files, running_adapter_server, tar_gz
from tests.gateway.conftest import BASE_MODEL

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q_PROJ_B = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"
BYSTANDER = {"model": BASE_MODEL, "prompt": "the quick brown fox jumps over", "max_tokens": 24, "temperature": 0,
             "logprobs": 0, "stream": True}


@pytest.fixture(scope="module")
def bf16_model(make_model):
    return make_model("llama", dtype=torch.bfloat16)


@pytest.fixture(scope="module")
def server(bf16_model, tmp_path_factory):
    with running_adapter_server(bf16_model, tmp_path_factory.mktemp("hostile")) as s:
        yield s


@pytest.fixture(scope="module")
def good(bf16_model, tmp_path_factory):
    base = load_hf_base(bf16_model)
    return adapter_files(make_peft_adapter(base, tmp_path_factory.mktemp("peft") / "ok", seed=3, **LORA_ARGS).path)


def stream_tokens(server, tenant: str, started: threading.Event | None = None) -> list[str]:
    """The bystander's streamed completion, token by token (each chunk's logprobs tokens)."""
    tokens: list[str] = []
    with httpx.stream("POST", server.v1 + "/completions", headers=server.headers(tenant), json=BYSTANDER,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            tokens += (choice.get("logprobs") or {}).get("tokens") or []
            if started is not None and tokens:
                started.set()
        assert choice["finish_reason"] == "length"
    return tokens


def with_bystander(server, attack):
    """Run `attack()` while tenant globex streams; returns (attack's result, globex's tokens)."""
    started = threading.Event()
    result: dict = {}

    def bystander() -> None:
        result["tokens"] = stream_tokens(server, "globex", started)

    thread = threading.Thread(target=bystander)
    thread.start()
    assert started.wait(60)
    try:
        out = attack()
    finally:
        thread.join(120)
    return out, result["tokens"]


def complete(server, **body) -> httpx.Response:
    return httpx.post(server.v1 + "/completions", headers=server.headers("acme"), timeout=60,
                      json={"model": BASE_MODEL, "prompt": "hello", "max_tokens": 4, **body})


def test_out_of_range_seeds_and_token_ids_are_400s_and_the_bystander_is_untouched(server):
    alone = stream_tokens(server, "globex")
    assert len(alone) == 24

    def attack():
        return [complete(server, seed=2**64), complete(server, seed=-1),
                complete(server, logit_bias={"1000000": 5}), complete(server, seed=2**64 - 1, temperature=1.0)]

    (big, negative, bias, largest), tokens = with_bystander(server, attack)
    for resp, param in ((big, "seed"), (negative, "seed"), (bias, "logit_bias")):
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == param and error["type"] == "invalid_request_error", error
        assert "Traceback" not in error["message"] and "Overflow" not in error["message"]
    assert largest.status_code == 200, largest.text  # the largest seed the generator takes is served
    assert tokens == alone
    server.llm.engine.scheduler.check_integrity()


def _upload(server, files, name):
    return server.upload("acme", tar_gz(files), name=name)


def _with_config(files, **changes):
    return {**files, CONFIG: json.dumps({**json.loads(files[CONFIG]), **changes}).encode()}


def _with_weight(files, value):
    tensors = load_safetensors(files[WEIGHTS])
    tensors[Q_PROJ_B][0, 1] = value
    return {**files, WEIGHTS: save_safetensors(tensors)}


@pytest.mark.parametrize(("make", "expected"), [
    (lambda g: _with_config(g, lora_alpha=1e300), "beyond the range of bfloat16"),
    (lambda g: _with_config(g, lora_alpha=8, use_rslora=True, alpha_pattern={"q_proj": 1e39}), "sqrt(r)"),
    (lambda g: _with_weight(g, 3.39e38), "which is inf in bfloat16"),  # finite in float32
], ids=["alpha-1e300", "rslora-alpha-pattern", "weight-inf-in-bf16"])
def test_adapters_that_overflow_the_compute_dtype_are_refused_at_upload(server, good, make, expected):
    alone = stream_tokens(server, "globex")
    resp, tokens = with_bystander(server, lambda: _upload(server, make(good), "overflow"))
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_adapter" and expected in error["message"], error
    assert server.records("acme", "overflow") == []
    assert tokens == alone


def test_a_good_adapter_still_uploads_and_serves(server, good):
    resp = _upload(server, good, "fine")
    assert resp.status_code in (200, 201), resp.text
    out = complete(server, model="fine", temperature=0)
    assert out.status_code == 200, out.text
