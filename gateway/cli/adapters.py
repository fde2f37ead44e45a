"""`loraplex adapters upload|list|show|delete`: a tenant's adapters, over the gateway's REST API.

The gateway comes from --base-url (LORAPLEX_BASE_URL, as for the openai client: `http://host:8000/v1`;
a URL without the `/v1` gets it) and the key from --api-key (LORAPLEX_API_KEY); the flags win. `upload
PATH` takes a PEFT adapter directory (packed into a .tar.gz first) or an archive, and streams it with a
progress bar on stderr when stderr is a terminal (--progress / --no-progress force it).

Exit codes: 0 done; 1 the server refused the request (invalid adapter, quota, too large); 2 usage (bad
flags, no key, PATH unusable); 3 the key was refused (401/403); 4 no such adapter (404); 5 the gateway
could not be reached or failed (connection, 5xx). Errors are one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import secrets
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

DEFAULT_BASE_URL = "http://127.0.0.1:8000/v1"
EXIT_OK, EXIT_REFUSED, EXIT_USAGE, EXIT_AUTH, EXIT_NOT_FOUND, EXIT_UNAVAILABLE = 0, 1, 2, 3, 4, 5
_CHUNK_BYTES = 256 * 1024


def add_adapters_parser(sub: argparse._SubParsersAction, env: Mapping[str, str]) -> None:
    """Register `adapters` and its actions on the `loraplex` subcommand parser."""
    client = argparse.ArgumentParser(add_help=False)
    group = client.add_argument_group("connection (also LORAPLEX_* environment variables)")
    group.add_argument("--base-url", default=env.get("LORAPLEX_BASE_URL") or DEFAULT_BASE_URL,
                       help=f"the gateway's API base URL (LORAPLEX_BASE_URL, default {DEFAULT_BASE_URL})")
    group.add_argument("--api-key", default=env.get("LORAPLEX_API_KEY"), help="your API key (LORAPLEX_API_KEY)")
    adapters = sub.add_parser("adapters", help="upload, list, show and delete your LoRA adapters")
    asub = adapters.add_subparsers(dest="action", required=True, metavar="ACTION")
    upload = asub.add_parser("upload", parents=[client], help="upload a PEFT adapter (a new version if the name exists)")
    upload.add_argument("path", help="a PEFT adapter directory (adapter_config.json + adapter_model.safetensors) "
                                     "or a .tar.gz / .tgz / .tar / .zip of one")
    upload.add_argument("--name", required=True, help="the adapter's name: call it as model=NAME or NAME@VERSION")
    upload.add_argument("--description", default="", help="a note kept with this version")
    progress = upload.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_true", default=None,
                          help="always show the progress bar")
    progress.add_argument("--no-progress", dest="progress", action="store_false", help="never show it")
    listing = asub.add_parser("list", parents=[client], help="list your adapters")
    listing.add_argument("--json", action="store_true", help="print the API's JSON")
    show = asub.add_parser("show", parents=[client], help="an adapter and its versions")
    show.add_argument("name")
    show.add_argument("--json", action="store_true", help="print the API's JSON")
    delete = asub.add_parser("delete", parents=[client], help="delete every version of an adapter")
    delete.add_argument("name")
    adapters.set_defaults(handler=run_adapters)


class CliFailure(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def run_adapters(args: argparse.Namespace, out: TextIO | None = None, err: TextIO | None = None) -> int:
    out, err = out or sys.stdout, err or sys.stderr
    try:
        if not args.api_key:
            raise CliFailure("no API key: pass --api-key or set LORAPLEX_API_KEY", EXIT_USAGE)
        actions = {"upload": _upload, "list": _list, "show": _show, "delete": _delete}
        return actions[args.action](args, out, err)
    except CliFailure as e:
        print(f"loraplex: error: {e}", file=err)
        return e.exit_code


def api_base(base_url: str) -> str:
    base = base_url.rstrip("/")
    return base if base.endswith("/v1") else base + "/v1"


def _request(args: argparse.Namespace, method: str, path: str, **kwargs: Any) -> Any:
    """One API call; the decoded JSON body, or CliFailure with the server's message on one line."""
    import httpx

    url = api_base(args.base_url) + path
    headers = {"authorization": f"Bearer {args.api_key}", **kwargs.pop("headers", {})}
    try:
        with httpx.Client(timeout=httpx.Timeout(30.0, read=600.0)) as client:
            response = client.request(method, url, headers=headers, **kwargs)
    except httpx.WriteError as e:
        raise CliFailure(f"the gateway closed the connection during the upload ({e}); the file may be over "
                         "its upload limit", EXIT_REFUSED) from None
    except httpx.HTTPError as e:
        raise CliFailure(f"cannot reach the gateway at {url}: {e or type(e).__name__}", EXIT_UNAVAILABLE) from None
    if response.is_success:
        return response.json()
    raise _failure(response)


def _failure(response: Any) -> CliFailure:
    """The server's error as one line, with the exit code its status (and code) call for."""
    try:
        error = response.json()["error"]
        message, code = str(error["message"]), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = response.text.strip()[:300] or response.reason_phrase, None
    detail = f"HTTP {response.status_code}" + (f", {code}" if code else "")
    status = response.status_code
    if status == 404:
        exit_code = EXIT_NOT_FOUND
    elif status in (401, 403) and code != "adapter_quota_exceeded":
        exit_code = EXIT_AUTH
    else:
        exit_code = EXIT_UNAVAILABLE if status >= 500 else EXIT_REFUSED
    return CliFailure(" ".join(f"{message} ({detail})".split()), exit_code)


def _upload(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    from adapters.archive import pack_adapter_dir
    from adapters.errors import AdapterError

    path = Path(args.path)
    if not path.exists():
        raise CliFailure(f"{path}: no such file or directory", EXIT_USAGE)
    packed = None
    if path.is_dir():
        try:
            packed = archive = pack_adapter_dir(path)
        except AdapterError as e:
            raise CliFailure(f"{path}: {e}", EXIT_USAGE) from None
        filename = f"{path.resolve().name or 'adapter'}.tar.gz"
    else:
        archive, filename = path, path.name
    try:
        show_bar = err.isatty() if args.progress is None else args.progress
        body = MultipartBody(archive, filename, {"name": args.name, "description": args.description},
                             ProgressBar(f"uploading {args.name}", err) if show_bar else None)
        record = _request(args, "POST", "/adapters", content=body.chunks(), headers=body.headers())
    finally:
        if packed is not None:
            packed.unlink(missing_ok=True)
    print(f"uploaded {record['id']} (sha256 {record['sha256'][:12]}, rank {record['rank']}, "
          f"{_size(record['size_bytes'])}): call it as model={record['name']!r} or {record['id']!r}", file=out)
    return EXIT_OK


def _list(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    data = _request(args, "GET", "/adapters")["data"]
    if args.json:
        print(json.dumps(data, indent=2), file=out)
        return EXIT_OK
    if not data:
        print("no adapters", file=out)
        return EXIT_OK
    rows = [("NAME", "LATEST", "VERSIONS", "RANK", "SIZE", "TARGETS")]
    rows += [(a["name"], f"@{a['latest_version']}", str(len(a["versions"])), str(a["rank"]), _size(a["size_bytes"]),
              ",".join(a["target_modules"])) for a in data]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip(), file=out)
    return EXIT_OK


def _show(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    adapter = _request(args, "GET", f"/adapters/{args.name}")
    if args.json:
        print(json.dumps(adapter, indent=2), file=out)
        return EXIT_OK
    print(f"{adapter['name']} (latest @{adapter['latest_version']})", file=out)
    for v in adapter["versions"]:
        note = f"  {v['description']}" if v["description"] else ""
        print(f"  @{v['version']}  rank {v['rank']}  {_size(v['size_bytes'])}  sha256 {v['sha256']}  "
              f"targets {','.join(v['target_modules'])}  created {v['created']}{note}", file=out)
    return EXIT_OK


def _delete(args: argparse.Namespace, out: TextIO, err: TextIO) -> int:
    deleted = _request(args, "DELETE", f"/adapters/{args.name}")
    print(f"deleted {deleted['name']} (versions {', '.join(str(v) for v in deleted['versions'])})", file=out)
    return EXIT_OK


def _size(n: int) -> str:
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


class ProgressBar:
    """`label [#####.....]  45%  1.2/2.6 MiB` redrawn in place on a terminal stream."""

    def __init__(self, label: str, stream: TextIO, width: int = 30) -> None:
        self.label, self.stream, self.width = label, stream, width
        self.last_percent = -1

    def update(self, done: int, total: int) -> None:
        percent = 100 if total == 0 else done * 100 // total
        if percent == self.last_percent:
            return
        self.last_percent = percent
        filled = self.width * percent // 100
        self.stream.write(f"\r{self.label} [{'#' * filled}{'.' * (self.width - filled)}] {percent:3d}%  "
                          f"{_size(done)} / {_size(total)}")
        if done >= total:
            self.stream.write("\n")
        self.stream.flush()


class MultipartBody:
    """multipart/form-data with text fields and one file, streamed from disk with a known length."""

    def __init__(self, file: Path, filename: str, fields: Mapping[str, str], progress: ProgressBar | None) -> None:
        self.file, self.progress = file, progress
        self.boundary = "loraplex-" + secrets.token_hex(16)
        safe_name = "".join(c for c in filename if c.isprintable() and c not in '"\\') or "adapter.tar.gz"
        head = b"".join(
            f'--{self.boundary}\r\nContent-Disposition: form-data; name="{key}"\r\n\r\n'.encode() + value.encode()
            + b"\r\n" for key, value in fields.items())
        self.head = head + (f'--{self.boundary}\r\nContent-Disposition: form-data; name="file"; '
                            f'filename="{safe_name}"\r\nContent-Type: application/octet-stream\r\n\r\n').encode()
        self.tail = f"\r\n--{self.boundary}--\r\n".encode()
        self.file_bytes = file.stat().st_size

    def headers(self) -> dict[str, str]:
        length = len(self.head) + self.file_bytes + len(self.tail)
        return {"content-type": f"multipart/form-data; boundary={self.boundary}", "content-length": str(length)}

    def chunks(self) -> Iterator[bytes]:
        yield self.head
        sent = 0
        with self.file.open("rb") as f:
            while chunk := f.read(_CHUNK_BYTES):
                sent += len(chunk)
                if self.progress is not None:
                    self.progress.update(sent, self.file_bytes)
                yield chunk
        if self.progress is not None and self.file_bytes == 0:
            self.progress.update(0, 0)
        yield self.tail
