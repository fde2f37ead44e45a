"""Hostile uploads get a 4xx and leave nothing behind: a body that stalls is dropped (408), a tenant's
uploads beyond its concurrent cap are refused (429) before a byte is read, the byte quota cuts a body off
while it streams (403), a base-model name, an over-long boundary and a config nested 200k deep are 400s;
what is stored is owner-only (0600 files, 0700 directories)."""

from __future__ import annotations

import json
import select
import socket
import stat

import pytest

from tests.engine.lora_peft import load_hf_base, make_peft_adapter
from tests.gateway.adapter_server import LORA_ARGS, adapter_files, running_adapter_server, tar_gz
from tests.gateway.conftest import BASE_MODEL, wait_until

READ_TIMEOUT_S = 3.0
BOUNDARY = "hostile-boundary"


@pytest.fixture(scope="module")
def server(llama_dir, tmp_path_factory):
    with running_adapter_server(llama_dir, tmp_path_factory.mktemp("data"), max_upload_bytes=1 << 30,
                                upload_read_timeout_s=READ_TIMEOUT_S, max_concurrent_uploads=2) as s:
        yield s


@pytest.fixture(scope="module")
def good(llama_dir, tmp_path_factory):
    base = load_hf_base(llama_dir)
    return adapter_files(make_peft_adapter(base, tmp_path_factory.mktemp("peft") / "ok", seed=1, **LORA_ARGS).path)


def _port(server) -> int:
    return int(server.url.rsplit(":", 1)[1])


def _upload_head(server, tenant: str, content_length: int, name: str = "slow", boundary: str = BOUNDARY) -> bytes:
    """Request line, headers and the multipart body up to the file part's first byte."""
    part = (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\n{name}\r\n'
            f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.tar.gz"\r\n'
            "Content-Type: application/octet-stream\r\n\r\n").encode()
    return (f"POST /v1/adapters HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.keys[tenant]}\r\n"
            f"content-type: multipart/form-data; boundary={boundary}\r\ncontent-length: {content_length}\r\n\r\n"
            ).encode() + part


def _read_response(sock: socket.socket) -> tuple[int, dict]:
    data = b""
    while b"\r\n\r\n" not in data or len(data.split(b"\r\n\r\n", 1)[1]) < _content_length(data):
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, body = data.split(b"\r\n\r\n", 1)
    return int(head.split()[1]), json.loads(body[:_content_length(data)])


def _content_length(data: bytes) -> int:
    for line in data.split(b"\r\n\r\n", 1)[0].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            return int(value)
    return 0


def _work_dirs(server) -> list[str]:
    return [e for e in server.stored_entries() if e.startswith(".tmp-upload-") and "/" not in e]


def _closed_by_server(sock: socket.socket) -> bool:
    try:
        return sock.recv(65536) == b""
    except ConnectionResetError:
        return True


def test_a_stalled_upload_is_dropped_with_408_and_its_work_dir_removed(server):
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(_upload_head(server, "acme", 10 << 20) + bytes(1000))  # then nothing more
        assert wait_until(lambda: bool(_work_dirs(server)))  # the handler is receiving
        status, body = _read_response(sock)  # the server answers on its own: the client sent nothing more
        assert status == 408
        assert body["error"]["code"] == "upload_timeout" and body["error"]["type"] == "invalid_request_error"
        assert _closed_by_server(sock)
    assert wait_until(lambda: not _work_dirs(server))
    assert not server.records("acme", "slow")


def test_a_tenant_past_its_concurrent_uploads_gets_429_and_others_are_unaffected(server, good):
    stalled = [socket.create_connection(("127.0.0.1", _port(server)), timeout=30) for _ in range(2)]
    try:
        for sock in stalled:
            sock.sendall(_upload_head(server, "globex", 10 << 20) + bytes(100))
        assert wait_until(lambda: len(_work_dirs(server)) == 2)
        third = server.upload("globex", tar_gz(good), name="third")
        assert third.status_code == 429, third.text
        assert third.json()["error"]["code"] == "too_many_uploads" and third.headers["retry-after"] == "1"
        assert len(_work_dirs(server)) <= 2  # refused before a work directory was made
        other = server.upload("acme", tar_gz(good), name="bystander")  # another tenant uploads meanwhile
        assert other.status_code == 201, other.text
        for sock in stalled:  # the stalled ones are dropped by the read timeout, freeing the tenant's slots
            assert _read_response(sock)[0] == 408
    finally:
        for sock in stalled:
            sock.close()
    assert wait_until(lambda: not _work_dirs(server))
    assert server.upload("globex", tar_gz(good), name="after").status_code == 201


def test_the_byte_quota_cuts_an_upload_off_while_it_streams(server):
    declared = 256 << 20  # far over the tenant's 4096 bytes (and its 1 MiB of slack), under the server limit
    chunk = bytes(64 * 1024)
    sent = 0
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(_upload_head(server, "tight", declared, name="flood"))
        answered = False
        while sent < declared:
            if select.select([sock], [], [], 0)[0]:
                answered = True
                break
            try:
                sock.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                answered = True
                break
            sent += len(chunk)
        assert answered and sent < declared // 4, sent  # the answer came long before the body was sent
        status, body = _read_response(sock)
    assert status == 403 and body["error"]["code"] == "adapter_quota_exceeded"
    assert body["error"]["type"] == "insufficient_quota"
    assert wait_until(lambda: not _work_dirs(server))
    assert not server.records("tight", "flood")


def test_an_adapter_may_not_take_the_base_models_name(server, good):
    resp = server.upload("acme", tar_gz(good), name=BASE_MODEL)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"] | {"message": ""} == {"message": "", "type": "invalid_request_error",
                                                      "param": "name", "code": "reserved_name"}
    assert not server.records("acme", BASE_MODEL)


def test_a_boundary_over_256_characters_is_a_400(server):
    boundary = "b" * 300
    body = (f'--{boundary}\r\nContent-Disposition: form-data; name="name"\r\n\r\nx\r\n--{boundary}--\r\n').encode()
    with socket.create_connection(("127.0.0.1", _port(server)), timeout=30) as sock:
        sock.sendall(f"POST /v1/adapters HTTP/1.1\r\nhost: x\r\nauthorization: Bearer {server.keys['acme']}\r\n"
                     f"content-type: multipart/form-data; boundary={boundary}\r\ncontent-length: {len(body)}\r\n\r\n"
                     .encode() + body)
        status, error = _read_response(sock)
    assert status == 400 and error["error"]["code"] == "malformed_multipart"
    assert wait_until(lambda: not _work_dirs(server))


def test_an_adapter_config_nested_200k_deep_is_a_400(server, good):
    deep = b'{"r": 4, "target_modules": ["q_proj"], "x": ' + b"[" * 200_000 + b"]" * 200_000 + b"}"
    resp = server.upload("acme", tar_gz({**good, "adapter_config.json": deep}), name="deep")
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["code"] == "invalid_adapter" and "nested too deeply" in resp.json()["error"]["message"]
    assert wait_until(lambda: not _work_dirs(server))


def test_stored_files_are_owner_only(server, good):
    assert server.upload("acme", tar_gz(good), name="private").status_code == 201
    root = server.adapter_root
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    stored = [p for p in root.rglob("*") if not p.name.startswith(".tmp-")]
    assert stored
    for path in stored:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), (path, oct(mode))
    databases = sorted(root.parent.glob("*.db*"))  # the store and the budget ledger, with their -wal/-shm files
    assert {p.name for p in databases} >= {"store.db", "store.db-wal"} and len(databases) >= 4, databases
    for path in databases:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path
