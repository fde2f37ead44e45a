"""Receive a multipart/form-data upload straight into a file, counting bytes while they arrive.

Starlette's `request.form()` spools file parts into the system temp directory and bounds only the text
fields, so uploads are parsed here with python-multipart's streaming parser instead: the one file part is
written into a file the caller chose (inside the data directory, on the filesystem that keeps adapters),
text fields are bounded, unknown fields are refused, and a body that ends before the closing boundary
(client gone, connection cut) is an error rather than a silently shorter file.

The caller owns the destination file's directory and removes it on every outcome.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.concurrency import run_in_threadpool
from starlette.requests import ClientDisconnect, Request

from gateway.http.errors import ApiError, invalid_request

MAX_BOUNDARY_CHARS = 256  # python-multipart's own bound (RFC 2046 allows 70)
QUOTA_SLACK_BYTES = 1 << 20  # archive headers and small extra files over the adapter files' own bytes


@dataclass(frozen=True)
class UploadForm:
    """What a multipart upload may hold: one file field and a few short text fields.

    `max_file_bytes` is the server's limit on one upload (passing it: 413); `quota_bytes`, when set, what
    the tenant's adapter byte quota leaves room for (its stored files plus QUOTA_SLACK_BYTES: passing it,
    403 adapter_quota_exceeded); both are enforced while the bytes arrive. `read_timeout_s`: the longest
    wait for the next chunk of the body (then 408, the connection closed)."""

    file_field: str
    text_fields: frozenset[str]
    max_file_bytes: int
    max_text_bytes: int = 4096
    quota_bytes: int | None = None
    read_timeout_s: float | None = None


@dataclass(frozen=True)
class ReceivedUpload:
    path: Path  # the file part's bytes, exactly as sent
    size_bytes: int
    filename: str
    fields: dict[str, str]  # text fields that were sent


def upload_too_large(max_bytes: int) -> ApiError:
    return ApiError(413, f"The uploaded file is larger than this server's limit of {max_bytes} bytes.",
                    param="file", code="upload_too_large")


def upload_over_quota(quota_bytes: int) -> ApiError:
    return ApiError(403, f"The uploaded file passed the {quota_bytes} bytes this tenant's adapter quota has room "
                         "for; delete an adapter first.", param="file", code="adapter_quota_exceeded",
                    error_type="insufficient_quota", headers={"connection": "close"})


def upload_timed_out(seconds: float) -> ApiError:
    return ApiError(408, f"The upload sent nothing for {seconds:g} seconds and was dropped.", param="file",
                    code="upload_timeout", headers={"connection": "close"})


@dataclass
class _PartCollector:
    """python-multipart callbacks → one file on disk (writes are handed back, not done in callbacks)."""

    form: UploadForm
    out: BinaryIO
    headers: dict[str, str] = field(default_factory=dict)
    header_field: bytearray = field(default_factory=bytearray)
    header_value: bytearray = field(default_factory=bytearray)
    current: str | None = None  # field name of the part being read
    current_is_file: bool = False
    text: bytearray = field(default_factory=bytearray)
    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    file_bytes: int = 0
    pending: list[bytes] = field(default_factory=list)
    complete: bool = False

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self.on_part_begin, "on_part_data": self.on_part_data,
            "on_part_end": self.on_part_end, "on_header_field": self.on_header_field,
            "on_header_value": self.on_header_value, "on_header_end": self.on_header_end,
            "on_headers_finished": self.on_headers_finished, "on_end": self.on_end,
        }

    def on_part_begin(self) -> None:
        self.headers.clear()
        self.current, self.current_is_file = None, False
        self.text.clear()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self.header_field.extend(data[start:end])

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self.header_value.extend(data[start:end])

    def on_header_end(self) -> None:
        self.headers[self.header_field.decode("latin-1").lower()] = self.header_value.decode("latin-1")
        self.header_field.clear()
        self.header_value.clear()

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self.headers.get("content-disposition", ""))
        name = options.get(b"name", b"").decode("utf-8", "replace")
        if not name:
            raise invalid_request("A multipart part has no name in its Content-Disposition header.")
        if name in self.fields or (name == self.form.file_field and self.filename is not None):
            raise invalid_request(f"The field '{name}' was sent twice.", param=name)
        if name == self.form.file_field:
            self.filename = options.get(b"filename", b"upload").decode("utf-8", "replace")
            self.current_is_file = True
        elif name not in self.form.text_fields:
            accepted = ", ".join([self.form.file_field, *sorted(self.form.text_fields)])
            raise invalid_request(f"Unknown form field '{name}' (accepted: {accepted}).", param=name)
        self.current = name

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self.current_is_file:
            self.file_bytes += end - start
            if self.file_bytes > self.form.max_file_bytes:
                raise upload_too_large(self.form.max_file_bytes)
            if self.form.quota_bytes is not None and self.file_bytes > self.form.quota_bytes:
                raise upload_over_quota(self.form.quota_bytes)
            self.pending.append(data[start:end])
            return
        self.text.extend(data[start:end])
        if len(self.text) > self.form.max_text_bytes:
            raise invalid_request(f"The field '{self.current}' is longer than {self.form.max_text_bytes} bytes.",
                                  param=self.current)

    def on_part_end(self) -> None:
        if self.current is not None and not self.current_is_file:
            try:
                self.fields[self.current] = self.text.decode("utf-8")
            except UnicodeDecodeError:
                raise invalid_request(f"The field '{self.current}' is not valid UTF-8.", param=self.current) from None
        self.current, self.current_is_file = None, False

    def on_end(self) -> None:
        self.complete = True

    def flush(self) -> None:
        self.out.writelines(self.pending)
        self.pending.clear()


async def receive_upload(request: Request, dest: Path, form: UploadForm) -> ReceivedUpload:
    """Stream the request's multipart body; the file part goes to `dest` (created, must not exist).

    Raises ApiError: 400 for a body that is not multipart/form-data, is malformed (a boundary over
    MAX_BOUNDARY_CHARS included), lacks the file, or ends early (truncated, client disconnected); 403 once
    the file passes `form.quota_bytes`; 408 when no byte came for `form.read_timeout_s`; 413 once the
    file passes `form.max_file_bytes`.
    """
    content_type, params = parse_options_header(request.headers.get("content-type", ""))
    if content_type != b"multipart/form-data" or not params.get(b"boundary"):
        raise ApiError(415, f"Send the upload as multipart/form-data with a '{form.file_field}' file field.",
                       code="unsupported_media_type")
    boundary = params[b"boundary"]
    if len(boundary) > MAX_BOUNDARY_CHARS:
        raise invalid_request(f"The multipart boundary is longer than {MAX_BOUNDARY_CHARS} characters.",
                              code="malformed_multipart")
    with open(os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:  # owner-only
        collector = _PartCollector(form, out)
        parser = MultipartParser(boundary, collector.callbacks())  # type: ignore[arg-type]
        chunks = request.stream()
        try:
            while (chunk := await _next_chunk(chunks, form.read_timeout_s)) is not None:
                if collector.complete:
                    continue  # epilogue after the closing boundary: read and ignored
                parser.write(chunk)
                if collector.pending:
                    await run_in_threadpool(collector.flush)
        except ClientDisconnect:
            raise invalid_request("The upload was interrupted before it was complete.",
                                  code="upload_incomplete") from None
        except FormParserError as e:  # MultipartParseError and the parser's other refusals
            raise invalid_request(f"The multipart body is malformed ({e}).", code="malformed_multipart") from None
        parser.finalize()
    if not collector.complete:
        raise invalid_request("The upload ended before the multipart body was complete (truncated).",
                              code="upload_incomplete")
    if collector.filename is None:
        raise invalid_request(f"The upload has no '{form.file_field}' file field.", param=form.file_field)
    return ReceivedUpload(dest, collector.file_bytes, collector.filename, dict(collector.fields))


async def _next_chunk(chunks: AsyncIterator[bytes], timeout_s: float | None) -> bytes | None:
    """The body's next chunk, None at its end. Raises ApiError(408) after `timeout_s` without one."""
    try:
        with anyio.fail_after(timeout_s):
            return await anext(chunks)
    except StopAsyncIteration:
        return None
    except TimeoutError:
        raise upload_timed_out(timeout_s or 0.0) from None
