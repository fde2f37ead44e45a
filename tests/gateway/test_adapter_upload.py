"""Adapter lifecycle end to end: peft adapters uploaded with the CLI to a live gateway, called through the
official openai client, compared with the offline LLM; versions, prefix-cache separation, delete, isolation."""

from __future__ import annotations

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from gateway.cli.main import main as loraplex
from tests.engine.lora_peft import load_hf_base, make_peft_adapter, random_prompts
from tests.gateway.adapter_server import ENGINE_ARGS, LORA_ARGS, adapter_files, running_adapter_server, tar_gz

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def peft_dirs(llama_dir, tmp_path_factory):
    """Two versions of one adapter and an unrelated third, each made and saved by peft."""
    base = load_hf_base(llama_dir)
    root = tmp_path_factory.mktemp("peft")
    return {tag: make_peft_adapter(base, root / tag, seed=seed, scale=0.3, **LORA_ARGS).path
            for tag, seed in (("v1", 1), ("v2", 2), ("other", 3))}


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with running_adapter_server(llama_dir, tmp_path_factory.mktemp("data")) as s:
        yield s


@pytest.fixture(scope="module")
def offline(llama_dir, peft_dirs):
    """The offline LLM with the same adapters: the reference every served answer must equal."""
    llm = LLM(str(llama_dir), **ENGINE_ARGS)
    for tag, path in peft_dirs.items():
        llm.load_adapter(tag, path)
    return llm


@pytest.fixture(scope="module")
def prompts(offline):
    return random_prompts(offline.tokenizer.vocab_size, [13, 17, 11], seed=7)


def _offline_text(offline, prompt, adapter):
    out = offline.generate({"prompt_token_ids": prompt}, SamplingParams(max_tokens=MAX_TOKENS, temperature=0),
                           adapters=[adapter])
    return out[0].outputs[0].text


def _client(server, tenant="acme"):
    return openai.OpenAI(base_url=server.v1, api_key=server.keys[tenant], max_retries=0, timeout=60)


def _complete(server, model, prompt, tenant="acme"):
    return _client(server, tenant).completions.create(model=model, prompt=prompt, max_tokens=MAX_TOKENS,
                                                      temperature=0)


def _cli(server, *argv, tenant="acme"):
    return loraplex(["adapters", *argv, "--base-url", server.url, "--api-key", server.keys[tenant]])


def test_cli_upload_then_openai_call_equals_offline_llm(server, peft_dirs, offline, prompts, capsys):
    assert _cli(server, "upload", str(peft_dirs["v1"]), "--name", "support-bot", "--description", "first") == 0
    assert "uploaded support-bot@1" in capsys.readouterr().out
    served = _complete(server, "support-bot", prompts[0])
    assert served.model == "support-bot"
    assert served.choices[0].text == _offline_text(offline, prompts[0], "v1")
    assert served.choices[0].text != _offline_text(offline, prompts[0], None)  # the adapter changes the output
    chat = _client(server).chat.completions.create(model="support-bot", max_tokens=4, temperature=0,
                                                   messages=[{"role": "user", "content": "hello"}])
    assert chat.choices[0].finish_reason in ("length", "stop")


def test_second_upload_is_the_new_default_and_v1_stays_callable(server, peft_dirs, offline, prompts, capsys):
    if not server.records("acme", "support-bot"):
        assert _cli(server, "upload", str(peft_dirs["v1"]), "--name", "support-bot") == 0
    assert _cli(server, "upload", str(peft_dirs["v2"]), "--name", "support-bot") == 0
    assert "uploaded support-bot@2" in capsys.readouterr().out
    shown = httpx.get(server.v1 + "/adapters/support-bot", headers=server.headers("acme")).json()
    assert shown["latest_version"] == 2 and [v["version"] for v in shown["versions"]] == [1, 2]
    assert shown["versions"][0]["sha256"] != shown["versions"][1]["sha256"]
    assert shown["rank"] == LORA_ARGS["r"] and shown["target_modules"] == ["q_proj", "v_proj", "down_proj"]

    prompt = prompts[1]
    assert _complete(server, "support-bot", prompt).choices[0].text == _offline_text(offline, prompt, "v2")
    assert _complete(server, "support-bot@2", prompt).choices[0].text == _offline_text(offline, prompt, "v2")
    for old in ("support-bot@1", "support-bot@v1"):
        assert _complete(server, old, prompt).choices[0].text == _offline_text(offline, prompt, "v1")


def _cached(server, model, prompt):
    usage = _complete(server, model, prompt).usage
    return usage.prompt_tokens_details.cached_tokens if usage.prompt_tokens_details else 0


def test_versions_never_share_prefix_cache(server, peft_dirs, prompts):
    for tag in ("v1", "v2"):
        assert server.upload("acme", _tgz(peft_dirs[tag]), name="cache-bot").status_code == 201
    prompt = prompts[2]  # seen by no earlier request
    assert _cached(server, "cache-bot@1", prompt) == 0
    assert _cached(server, "cache-bot@1", prompt) > 0  # v1 hits its own cache
    assert _cached(server, "cache-bot@2", prompt) == 0  # v2 never sees v1's KV
    assert _cached(server, "cache-bot@1", prompt) > 0
    assert _cached(server, "cache-bot", prompt) > 0  # the bare name is v2: same content, same namespace


def test_delete_finishes_in_flight_refuses_new_and_removes_the_file(server, peft_dirs, prompts):
    assert server.upload("acme", _tgz(peft_dirs["other"]), name="ephemeral").status_code == 201
    sha = server.records("acme", "ephemeral")[0].sha256
    assert (server.adapter_root / sha).is_dir()
    stream = _client(server).completions.create(model="ephemeral", prompt=prompts[0], max_tokens=200, stream=True,
                                               temperature=0, extra_body={"ignore_eos": True})
    chunks = iter(stream)
    first = next(chunks)
    deleted = httpx.delete(server.v1 + "/adapters/ephemeral", headers=server.headers("acme"))
    assert deleted.status_code == 200 and deleted.json()["versions"] == [1]
    assert server.llm.stats().num_running == 1  # deleted while its request is still generating
    rest = list(chunks)
    assert (rest or [first])[-1].choices[0].finish_reason == "length"  # the running request finished
    assert len("".join(c.choices[0].text for c in [first, *rest] if c.choices)) > 0
    with pytest.raises(openai.NotFoundError, match="ephemeral"):
        _complete(server, "ephemeral", prompts[0])
    assert not (server.adapter_root / sha).exists()
    assert all(r.deleted_at is not None for r in server.records("acme", "ephemeral"))
    assert httpx.get(server.v1 + "/adapters/ephemeral", headers=server.headers("acme")).status_code == 404
    assert httpx.delete(server.v1 + "/adapters/ephemeral", headers=server.headers("acme")).status_code == 404


def test_shared_content_file_stays_while_another_record_uses_it(server, peft_dirs):
    archive = _tgz(peft_dirs["other"])
    assert server.upload("acme", archive, name="twin-a").status_code == 201
    assert server.upload("globex", archive, name="twin-b").status_code == 201
    sha = server.records("acme", "twin-a")[0].sha256
    assert server.records("globex", "twin-b")[0].sha256 == sha
    assert httpx.delete(server.v1 + "/adapters/twin-a", headers=server.headers("acme")).status_code == 200
    assert (server.adapter_root / sha).is_dir()  # globex's twin-b still points at it
    assert httpx.delete(server.v1 + "/adapters/twin-b", headers=server.headers("globex")).status_code == 200
    assert not (server.adapter_root / sha).exists()


def test_other_tenant_can_neither_list_call_show_nor_delete(server, peft_dirs, prompts):
    assert server.upload("acme", _tgz(peft_dirs["v1"]), name="acme-private").status_code == 201
    listed = httpx.get(server.v1 + "/adapters", headers=server.headers("globex")).json()["data"]
    assert "acme-private" not in {a["name"] for a in listed}
    own = httpx.get(server.v1 + "/adapters", headers=server.headers("acme")).json()["data"]
    assert "acme-private" in {a["name"] for a in own}
    for model in ("acme-private", "acme-private@1"):
        with pytest.raises(openai.NotFoundError):
            _complete(server, model, prompts[0], tenant="globex")
    shown = httpx.get(server.v1 + "/adapters/acme-private", headers=server.headers("globex"))
    missing = httpx.get(server.v1 + "/adapters/no-such-adapter", headers=server.headers("globex"))
    assert shown.status_code == missing.status_code == 404
    assert shown.json()["error"]["message"].replace("acme-private", "X") == \
        missing.json()["error"]["message"].replace("no-such-adapter", "X")
    assert httpx.delete(server.v1 + "/adapters/acme-private", headers=server.headers("globex")).status_code == 404
    assert all(r.deleted_at is None for r in server.records("acme", "acme-private"))
    assert _complete(server, "acme-private", prompts[0]).choices[0].text  # still the owner's
    assert httpx.get(server.v1 + "/adapters").status_code == 401


def _tgz(adapter_dir):
    return tar_gz(adapter_files(adapter_dir))
