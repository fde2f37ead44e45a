"""Every bad upload is refused with a message naming the problem, and leaves no file and no record."""

from __future__ import annotations

import io
import json
import socket
import tarfile
import zipfile

import httpx
import pytest
import torch
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors

from gateway.cli.adapters import MultipartBody
from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import (
    LORA_ARGS,
    MAX_UPLOAD_BYTES,
    adapter_files,
    running_adapter_server,
    tar_gz,
)
from tests.gateway.conftest import wait_until

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
Q_PROJ_A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with running_adapter_server(llama_dir, tmp_path_factory.mktemp("data")) as s:
        yield s


@pytest.fixture(scope="module")
def good(llama_dir, tmp_path_factory):
    """The files of a valid peft adapter (and of one whose rank is above the server's max of 8)."""
    base = load_hf_base(llama_dir)
    root = tmp_path_factory.mktemp("peft")
    wide = {**LORA_ARGS, "r": 16, "lora_alpha": 16}
    return {"ok": adapter_files(make_peft_adapter(base, root / "ok", seed=1, **LORA_ARGS).path),
            "wide": adapter_files(make_peft_adapter(base, root / "wide", seed=2, **wide).path)}


def _with_tensor(files, key, make):
    tensors = load_safetensors(files[WEIGHTS])
    tensors[key] = make(tensors[key])
    return {**files, WEIGHTS: save_safetensors(tensors)}


def _tar_with(members):
    """A .tar.gz from (TarInfo, content or None) pairs, for members tarfile.add would never write."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for info, content in members:
            info.size = len(content) if content is not None else 0
            tar.addfile(info, io.BytesIO(content) if content is not None else None)
    return buf.getvalue()


def _symlinked(files):
    link = tarfile.TarInfo(WEIGHTS)
    link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
    return _tar_with([(tarfile.TarInfo(CONFIG), files["ok"][CONFIG]), (link, None)])


def _zip(members):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, content in members.items():
            zf.writestr(name, content)
    return buf.getvalue()


BOMB_BYTES = 8 << 20  # zeros: compress about 1000:1, far past the 100:1 ratio limit

BAD_ARCHIVES = {
    "pickle": (lambda g: tar_gz({CONFIG: g["ok"][CONFIG], "adapter_model.bin": b"\x80\x04pickled"}),
               "pickle file"),
    "shape": (lambda g: tar_gz(_with_tensor(g["ok"], Q_PROJ_A, lambda t: torch.zeros(t.shape[0], t.shape[1] + 1))),
              "has shape (4, 65), but the base model needs (4, 64)"),
    "rank": (lambda g: tar_gz(g["wide"]), "rank 16 (at model.layers.0.self_attn.q_proj) is above this server's "
                                          "max_lora_rank 8"),
    "nan": (lambda g: tar_gz(_with_tensor(g["ok"], Q_PROJ_A, lambda t: t.index_fill(1, torch.tensor([3]), float("nan")))),
            "contains NaN or Inf"),
    "inf": (lambda g: tar_gz(_with_tensor(g["ok"], Q_PROJ_A, lambda t: t.index_fill(0, torch.tensor([0]), float("inf")))),
            "contains NaN or Inf"),
    "traversal": (lambda g: tar_gz({"../" + CONFIG: g["ok"][CONFIG], WEIGHTS: g["ok"][WEIGHTS]}),
                  "'..' path components are not accepted"),
    "absolute": (lambda g: tar_gz({"/tmp/" + CONFIG: g["ok"][CONFIG], WEIGHTS: g["ok"][WEIGHTS]}),
                 "absolute paths are not accepted"),
    "symlink": (_symlinked, "is a symlink"),
    "tar_bomb": (lambda g: tar_gz({CONFIG: g["ok"][CONFIG], WEIGHTS: bytes(BOMB_BYTES)}), "archive bomb"),
    "zip_bomb": (lambda g: _zip({CONFIG: g["ok"][CONFIG], WEIGHTS: bytes(BOMB_BYTES)}), "archive bomb"),
    "truncated_archive": (lambda g: tar_gz(g["ok"])[: len(tar_gz(g["ok"])) // 2], "truncated or corrupt"),
    "not_an_archive": (lambda g: b"just some text, not an archive", "unsupported archive format"),
    "no_weights": (lambda g: tar_gz({CONFIG: g["ok"][CONFIG]}), "archive has no adapter_model.safetensors"),
    "bad_config": (lambda g: tar_gz({CONFIG: b"{not json", WEIGHTS: g["ok"][WEIGHTS]}), "invalid JSON"),
    "unknown_target": (lambda g: tar_gz({CONFIG: json.dumps({**json.loads(g["ok"][CONFIG]),
                                                              "target_modules": ["wq"]}).encode(),
                                         WEIGHTS: g["ok"][WEIGHTS]}), "wq"),
}


def _assert_left_nothing(server, before, tenant, name):
    assert wait_until(lambda: server.stored_entries() == before), server.stored_entries() - before
    assert server.records(tenant, name) == []


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_bad_archive_is_refused_and_leaves_nothing(server, good, case):
    make, expected = BAD_ARCHIVES[case]
    before = server.stored_entries()
    resp = server.upload("acme", make(good), name=f"bad-{case.replace('_', '-')}")
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["code"] == "invalid_adapter" and error["type"] == "invalid_request_error"
    assert error["message"].startswith("Adapter rejected: ") and expected in error["message"], error["message"]
    _assert_left_nothing(server, before, "acme", f"bad-{case.replace('_', '-')}")


def test_over_the_tenant_byte_quota(server, good):
    before = server.stored_entries()
    resp = server.upload("tight", tar_gz(good["ok"]), name="too-big")
    assert resp.status_code == 403
    assert resp.json()["error"]["code"] == "adapter_quota_exceeded"
    assert "over its limit of 4096 bytes" in resp.json()["error"]["message"]
    _assert_left_nothing(server, before, "tight", "too-big")


def test_over_the_tenant_adapter_count(server, good):
    assert server.upload("single", tar_gz(good["ok"]), name="first").status_code == 201
    before = server.stored_entries()
    resp = server.upload("single", tar_gz(good["ok"]), name="second")
    assert resp.status_code == 403 and "its limit is 1" in resp.json()["error"]["message"]
    _assert_left_nothing(server, before, "single", "second")


def test_file_over_the_upload_limit_is_413(server):
    before = server.stored_entries()
    resp = server.upload("acme", bytes(MAX_UPLOAD_BYTES + 1), name="huge")
    assert resp.status_code == 413
    assert resp.json()["error"]["code"] == "upload_too_large"
    _assert_left_nothing(server, before, "acme", "huge")


def test_declared_body_over_the_upload_limit_is_413_before_reading(server):
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(f"POST /v1/adapters HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.keys['acme']}\r\n"
                     f"content-type: multipart/form-data; boundary=b\r\ncontent-length: {10 * MAX_UPLOAD_BYTES}"
                     "\r\n\r\n".encode())
        assert sock.recv(4096).startswith(b"HTTP/1.1 413")


def test_upload_cut_mid_body_leaves_nothing(server, good, tmp_path):
    archive = tmp_path / "ok.tar.gz"
    archive.write_bytes(tar_gz(good["ok"]) + bytes(256 * 1024))  # padding: a body the server reads in pieces
    body = MultipartBody(archive, "ok.tar.gz", {"name": "cut"}, None)
    payload = b"".join(body.chunks())
    before = server.stored_entries()
    head = "".join(f"{k}: {v}\r\n" for k, v in body.headers().items())
    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=10) as sock:
        sock.sendall(f"POST /v1/adapters HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.keys['acme']}\r\n"
                     f"{head}\r\n".encode() + payload[: len(payload) // 2])
        # the handler is receiving: its work directory exists until the cut is noticed
        assert wait_until(lambda: any(e.startswith(".tmp-upload-") for e in server.stored_entries()))
    _assert_left_nothing(server, before, "acme", "cut")


def test_multipart_body_without_its_closing_boundary(server, good, tmp_path):
    archive = tmp_path / "ok.tar.gz"
    archive.write_bytes(tar_gz(good["ok"]))
    body = MultipartBody(archive, "ok.tar.gz", {"name": "unfinished"}, None)
    payload = b"".join(body.chunks())[: -len(body.tail)]
    before = server.stored_entries()
    resp = httpx.post(server.v1 + "/adapters", content=payload, headers={
        **server.headers("acme"), "content-type": body.headers()["content-type"]})
    assert resp.status_code == 400 and "truncated" in resp.json()["error"]["message"]
    _assert_left_nothing(server, before, "acme", "unfinished")


@pytest.mark.parametrize(("fields", "expected"), [
    ({"name": None}, "needs a 'name' field"),
    ({"name": "../etc"}, "Adapter name '../etc' is invalid"),
    ({"name": "bot@2"}, "is invalid"),
    ({"name": "ok", "colour": "blue"}, "Unknown form field 'colour'"),
    ({"name": "ok", "description": "x" * 1001}, "description is longer than 1000 characters"),
])
def test_bad_form_fields(server, good, fields, expected):
    before = server.stored_entries()
    extra = {k: v for k, v in fields.items() if k != "name"}
    name = fields["name"]
    resp = server.upload("acme", tar_gz(good["ok"]), name=name, **extra)
    assert resp.status_code == 400 and expected in resp.json()["error"]["message"], resp.text
    _assert_left_nothing(server, before, "acme", name or "")


def test_not_multipart_is_415(server, good):
    resp = httpx.post(server.v1 + "/adapters", content=tar_gz(good["ok"]),
                      headers={**server.headers("acme"), "content-type": "application/gzip"})
    assert resp.status_code == 415 and "multipart/form-data" in resp.json()["error"]["message"]


def test_uploads_need_a_key(server, good):
    resp = httpx.post(server.v1 + "/adapters", files={"file": ("a.tar.gz", tar_gz(good["ok"]))}, data={"name": "x"})
    assert resp.status_code == 401
