"""`loraplex adapters ...` against a live gateway: output, one-line errors, exit codes, env and flags."""

from __future__ import annotations

import io
import json
import zipfile

import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from gateway.cli.adapters import (
    EXIT_AUTH,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNAVAILABLE,
    EXIT_USAGE,
    ProgressBar,
    api_base,
    run_adapters,
)
from gateway.cli.main import build_parser
from tests.conftest import free_port
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import LORA_ARGS, adapter_files, running_adapter_server, tar_gz


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with running_adapter_server(llama_dir, tmp_path_factory.mktemp("data")) as s:
        yield s


@pytest.fixture(scope="module")
def peft_dir(llama_dir, tmp_path_factory):
    return make_peft_adapter(load_hf_base(llama_dir), tmp_path_factory.mktemp("peft") / "bot", 1, **LORA_ARGS).path


def _run(argv, env=None):
    """(exit code, stdout, stderr) of `loraplex adapters ARGV` with only `env` as the environment."""
    args = build_parser(env or {}).parse_args(["adapters", *argv])
    out, err = io.StringIO(), io.StringIO()
    return run_adapters(args, out, err), out.getvalue(), err.getvalue()


def _as(server, tenant="acme"):
    return ["--base-url", server.url, "--api-key", server.keys[tenant]]


def test_upload_a_directory_and_an_archive_then_list_show_delete(server, peft_dir, tmp_path):
    code, out, err = _run(["upload", str(peft_dir), "--name", "cli-bot", "--progress", *_as(server)])
    assert code == EXIT_OK, err
    assert out.startswith("uploaded cli-bot@1 (sha256 ") and "model='cli-bot' or 'cli-bot@1'" in out
    assert "uploading cli-bot [" in err and "100%" in err and err.endswith("\n")
    archive = tmp_path / "bot.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for name, content in adapter_files(peft_dir).items():
            zf.writestr(name, content)
    code, out, err = _run(["upload", str(archive), "--name", "cli-bot", "--description", "from a zip",
                           "--no-progress", *_as(server)])
    assert (code, err) == (EXIT_OK, "") and out.startswith("uploaded cli-bot@2")

    code, out, _ = _run(["list", *_as(server)])
    header, row = out.splitlines()[:2]
    assert header.split() == ["NAME", "LATEST", "VERSIONS", "RANK", "SIZE", "TARGETS"]
    assert row.split()[:4] == ["cli-bot", "@2", "2", "4"] and row.endswith("q_proj,v_proj,down_proj")
    code, out, _ = _run(["show", "cli-bot", *_as(server)])
    assert code == EXIT_OK and out.splitlines()[0] == "cli-bot (latest @2)"
    assert out.splitlines()[2].strip().startswith("@2") and out.splitlines()[2].endswith("from a zip")
    code, out, _ = _run(["show", "cli-bot", "--json", *_as(server)])
    assert [v["version"] for v in json.loads(out)["versions"]] == [1, 2]

    assert _run(["delete", "cli-bot", *_as(server)])[:2] == (EXIT_OK, "deleted cli-bot (versions 1, 2)\n")
    code, out, err = _run(["show", "cli-bot", *_as(server)])
    assert (code, out) == (EXIT_NOT_FOUND, "")
    assert err == ("loraplex: error: The adapter 'cli-bot' does not exist or you do not have access to it. "
                   "(HTTP 404, adapter_not_found)\n")


def test_environment_gives_url_and_key_and_flags_override_it(server):
    env = {"LORAPLEX_BASE_URL": server.v1, "LORAPLEX_API_KEY": server.keys["acme"]}
    args = build_parser(env).parse_args(["adapters", "list"])
    assert (args.base_url, args.api_key) == (server.v1, server.keys["acme"])
    assert _run(["list", "--json"], env)[0] == EXIT_OK
    wrong_env = {**env, "LORAPLEX_API_KEY": "lpx-wrong"}
    assert _run(["list"], wrong_env)[0] == EXIT_AUTH
    assert _run(["list", "--api-key", server.keys["acme"]], wrong_env)[0] == EXIT_OK


def test_refused_upload_is_one_readable_line_and_exit_1(server, peft_dir, tmp_path):
    files = adapter_files(peft_dir)
    tensors = load_safetensors(files["adapter_model.safetensors"])
    key = next(iter(tensors))
    tensors[key] = torch.full_like(tensors[key], float("nan"))
    bad = tmp_path / "nan.tar.gz"
    bad.write_bytes(tar_gz({**files, "adapter_model.safetensors": save_safetensors(tensors)}))
    code, out, err = _run(["upload", str(bad), "--name", "nan-bot", "--no-progress", *_as(server)])
    assert (code, out) == (EXIT_REFUSED, "")
    assert len(err.splitlines()) == 1 and err.startswith("loraplex: error: Adapter rejected: tensor ")
    assert "contains NaN or Inf values (HTTP 400, invalid_adapter)" in err
    code, _, err = _run(["upload", str(peft_dir), "--name", "big", "--no-progress", *_as(server, "tight")])
    assert code == EXIT_REFUSED and "adapter_quota_exceeded" in err


@pytest.mark.parametrize(("argv", "env", "code", "message"), [
    (["list"], {}, EXIT_USAGE, "no API key: pass --api-key or set LORAPLEX_API_KEY"),
    (["upload", "/no/such/adapter", "--name", "x"], {"LORAPLEX_API_KEY": "k"}, EXIT_USAGE,
     "/no/such/adapter: no such file or directory"),
])
def test_usage_errors_exit_2(argv, env, code, message):
    assert _run(argv, env) == (code, "", f"loraplex: error: {message}\n")


def test_pickle_only_directory_is_refused_before_sending(tmp_path):
    (tmp_path / "adapter_config.json").write_text("{}")
    (tmp_path / "adapter_model.bin").write_bytes(b"\x80\x04")
    code, _, err = _run(["upload", str(tmp_path), "--name", "x", "--api-key", "k"])
    assert code == EXIT_USAGE and "adapter_model.bin is a pickle file" in err


def test_wrong_key_exits_3_and_unreachable_gateway_exits_5(server):
    code, _, err = _run(["list", "--base-url", server.url, "--api-key", "lpx-nope"])
    assert code == EXIT_AUTH and "(HTTP 401, invalid_api_key)" in err
    code, _, err = _run(["list", "--base-url", f"http://127.0.0.1:{free_port()}", "--api-key", "k"])
    assert code == EXIT_UNAVAILABLE and err.startswith("loraplex: error: cannot reach the gateway at ")
    assert len(err.splitlines()) == 1


def test_api_base_accepts_urls_with_or_without_v1():
    assert api_base("http://h:8000") == api_base("http://h:8000/") == api_base("http://h:8000/v1/") == "http://h:8000/v1"


def test_progress_bar_draws_in_place_and_ends_the_line():
    stream = io.StringIO()
    bar = ProgressBar("up", stream, width=10)
    for done in (0, 512, 512, 1024):
        bar.update(done, 1024)
    drawn = stream.getvalue()
    assert drawn.count("\r") == 3 and drawn.endswith("\n")  # the repeated 50% is not redrawn
    assert "\rup [#####.....]  50%" in drawn and "\rup [##########] 100%" in drawn
