"""Uploaded adapter archives: safe unpacking (tar, tar.gz, zip) and packing for the upload CLI.

An archive holds adapter_config.json, adapter_model.safetensors and optionally README.md, at its top level
or inside one top-level directory. Nothing else is accepted: no links, devices, other files or nested
directories. Sizes are counted while bytes are written (headers are never trusted alone), and the total
unpacked size may not exceed `max_compression_ratio` times the archive's size (archive bombs).
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, BinaryIO

from adapters.adapter_files import (
    ADAPTER_README_FILE,
    ADAPTER_WEIGHTS_FILE,
    PICKLE_WEIGHT_FILES,
    REQUIRED_ADAPTER_FILES,
)
from adapters.errors import AdapterError

ACCEPTED_ARCHIVE_FILES = (*REQUIRED_ADAPTER_FILES, ADAPTER_README_FILE)
_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class ArchiveLimits:
    """Bounds on what an uploaded archive may unpack to."""

    max_members: int = 16  # entries of any kind, directories included
    max_file_bytes: int = 4 << 30  # one unpacked file
    max_total_bytes: int = 4 << 30  # all unpacked files together
    max_compression_ratio: float = 100.0  # unpacked bytes per archive byte
    ratio_floor_bytes: int = 1 << 20  # the ratio is enforced once this much has been unpacked

    def __post_init__(self) -> None:
        if min(self.max_members, self.max_file_bytes, self.max_total_bytes, self.ratio_floor_bytes) < 1:
            raise ValueError("archive limits must be positive")
        if not self.max_compression_ratio >= 1:
            raise ValueError(f"max_compression_ratio must be >= 1, got {self.max_compression_ratio}")


def unpack_adapter_archive(
    archive: str | Path, dest_dir: str | Path, limits: ArchiveLimits | None = None
) -> Path:
    """Unpack `archive` into the new directory `dest_dir` (which must not exist) and return it.

    The adapter files land directly in dest_dir (a single top-level directory is flattened). On any
    error dest_dir is removed again, so a rejected archive leaves nothing behind.
    """
    archive, dest = Path(archive), Path(dest_dir)
    limits = limits or ArchiveLimits()
    if not archive.is_file():
        raise AdapterError(f"{archive.name}: archive file not found")
    dest.mkdir()  # NOTE: not exist_ok: the caller must hand a fresh path, never a directory with content
    try:
        writer = _MemberWriter(dest, limits, archive_bytes=archive.stat().st_size)
        with archive.open("rb") as f:
            head = f.read(512)
            f.seek(0)
            if head.startswith(b"PK\x03\x04") or head.startswith(b"PK\x05\x06"):
                _unpack_zip(f, writer, limits)
            elif head.startswith(b"\x1f\x8b") or head[257:262] == b"ustar":
                _unpack_tar(f, writer, limits)
            else:
                raise AdapterError("unsupported archive format (expected .tar.gz, .tgz, .tar or .zip)")
        for required in REQUIRED_ADAPTER_FILES:
            if required not in writer.written:
                raise AdapterError(f"archive has no {required}")
    except BaseException:
        shutil.rmtree(dest, ignore_errors=True)
        raise
    return dest


def pack_adapter_dir(adapter_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Pack an adapter directory's files into a .tar.gz (flat, reproducible: fixed mtimes and owners).

    out_path None: a new temporary file (the caller deletes it). Refuses a directory without the required
    files, or whose weights are only a pickle.
    """
    src = Path(adapter_dir)
    if not src.is_dir():
        raise AdapterError(f"{src}: not a directory")
    if not (src / ADAPTER_WEIGHTS_FILE).is_file():
        pickles = [p for p in PICKLE_WEIGHT_FILES if (src / p).exists()]
        if pickles:
            raise AdapterError(
                f"{pickles[0]} is a pickle file; save the adapter with safe_serialization=True"
            )
    files = [name for name in ACCEPTED_ARCHIVE_FILES if (src / name).is_file()]
    for required in REQUIRED_ADAPTER_FILES:
        if required not in files:
            raise AdapterError(f"{required} is missing from {src}")
    if out_path is None:
        fd, name = tempfile.mkstemp(prefix=f"{src.name or 'adapter'}-", suffix=".tar.gz")
        os.close(fd)
        out = Path(name)
    else:
        out = Path(out_path)
    try:
        with (
            out.open("wb") as raw,
            gzip.GzipFile(filename="", fileobj=raw, mode="wb", mtime=0) as gz,
            tarfile.open(fileobj=gz, mode="w", format=tarfile.PAX_FORMAT) as tar,
        ):
            for name in files:
                info = tarfile.TarInfo(name)
                info.size = (src / name).stat().st_size
                info.mode, info.mtime, info.uid, info.gid, info.uname, info.gname = 0o644, 0, 0, 0, "", ""
                with (src / name).open("rb") as data:
                    tar.addfile(info, data)
    except BaseException:
        out.unlink(missing_ok=True)
        raise
    return out


@dataclass
class _MemberWriter:
    """Writes accepted members into dest, counting bytes as they arrive and enforcing the limits."""

    dest: Path
    limits: ArchiveLimits
    archive_bytes: int
    total_bytes: int = 0
    members: int = 0
    top_dir: str | None = None  # "" once files sit at the top level; a name once inside one directory
    written: set[str] = field(default_factory=set)

    def count_member(self) -> None:
        self.members += 1
        if self.members > self.limits.max_members:
            raise AdapterError(f"archive has more than {self.limits.max_members} entries")

    def directory(self, raw_name: str) -> None:
        parts = _safe_parts(raw_name)
        if len(parts) > 1:
            raise AdapterError(f"archive member {raw_name!r}: nested directories are not accepted")
        if parts:
            self._claim_top_dir(parts[0], raw_name)

    def file(self, raw_name: str, chunks: Iterator[bytes]) -> None:
        parts = _safe_parts(raw_name)
        if not parts or len(parts) > 2:
            raise AdapterError(
                f"archive member {raw_name!r}: files must sit at the top level or in one directory"
            )
        self._claim_top_dir(parts[0] if len(parts) == 2 else "", raw_name)
        name = parts[-1]
        if name in PICKLE_WEIGHT_FILES:
            raise AdapterError(
                f"archive member {raw_name!r} is a pickle file, which loraplex never loads; "
                f"upload {ADAPTER_WEIGHTS_FILE}"
            )
        if name not in ACCEPTED_ARCHIVE_FILES:
            raise AdapterError(
                f"archive member {raw_name!r} is not accepted (only {', '.join(ACCEPTED_ARCHIVE_FILES)})"
            )
        if name in self.written:
            raise AdapterError(f"archive holds {name} twice")
        self.written.add(name)
        size = 0
        with (self.dest / name).open("xb") as out:
            for chunk in chunks:
                size += len(chunk)
                self.total_bytes += len(chunk)
                self._check_sizes(raw_name, size)
                out.write(chunk)

    def _check_sizes(self, raw_name: str, size: int) -> None:
        if size > self.limits.max_file_bytes:
            raise AdapterError(
                f"archive member {raw_name!r} unpacks to more than {self.limits.max_file_bytes} bytes"
            )
        if self.total_bytes > self.limits.max_total_bytes:
            raise AdapterError(f"archive unpacks to more than {self.limits.max_total_bytes} bytes")
        if (
            self.total_bytes > self.limits.ratio_floor_bytes
            and self.total_bytes > self.limits.max_compression_ratio * self.archive_bytes
        ):
            raise AdapterError(
                f"archive unpacks to more than {self.limits.max_compression_ratio:g} times its size "
                "(refused as a possible archive bomb)"
            )

    def _claim_top_dir(self, top: str, raw_name: str) -> None:
        if self.top_dir is None:
            self.top_dir = top
        elif self.top_dir != top:
            raise AdapterError(
                "archive must hold the adapter files at its top level or inside one directory "
                f"(found {raw_name!r})"
            )


def _safe_parts(raw_name: str) -> list[str]:
    """Path components of a member name; refuses absolute paths, '..', backslashes and NUL bytes."""
    if "\x00" in raw_name or "\\" in raw_name:
        raise AdapterError(
            f"archive member {raw_name!r}: backslashes and NUL bytes are not accepted in names"
        )
    if raw_name.startswith("/") or (len(raw_name) > 1 and raw_name[1] == ":"):
        raise AdapterError(f"archive member {raw_name!r}: absolute paths are not accepted")
    parts = [p for p in raw_name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise AdapterError(f"archive member {raw_name!r}: '..' path components are not accepted")
    return parts


def _unpack_tar(f: BinaryIO, writer: _MemberWriter, limits: ArchiveLimits) -> None:
    try:
        # "r|*": one forward pass over the stream (gzip or plain); headers are read as members arrive.
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for member in tar:
                writer.count_member()
                if member.issym() or member.islnk():
                    kind = "symlink" if member.issym() else "hardlink"
                    raise AdapterError(
                        f"archive member {member.name!r} is a {kind}; only regular files are accepted"
                    )
                if member.ischr() or member.isblk() or member.isfifo():
                    raise AdapterError(
                        f"archive member {member.name!r} is a device or fifo; only regular files are accepted"
                    )
                if member.isdir():
                    writer.directory(member.name + "/")
                elif member.isreg() and not member.issparse():
                    if member.size > limits.max_file_bytes:
                        raise AdapterError(
                            f"archive member {member.name!r} unpacks to more than "
                            f"{limits.max_file_bytes} bytes"
                        )
                    data = tar.extractfile(member)
                    assert data is not None  # regular members always have data
                    writer.file(member.name, _chunks(data))
                else:
                    raise AdapterError(f"archive member {member.name!r} is not a regular file")
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile) as e:
        raise AdapterError(f"archive is truncated or corrupt ({e or type(e).__name__})") from None


def _unpack_zip(f: BinaryIO, writer: _MemberWriter, limits: ArchiveLimits) -> None:
    try:
        with zipfile.ZipFile(f) as zf:
            infos = zf.infolist()
            if len(infos) > limits.max_members:
                raise AdapterError(f"archive has more than {limits.max_members} entries")
            for info in infos:
                writer.count_member()
                mode = info.external_attr >> 16
                if stat.S_ISLNK(mode):
                    raise AdapterError(
                        f"archive member {info.filename!r} is a symlink; only regular files are accepted"
                    )
                if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode):
                    raise AdapterError(
                        f"archive member {info.filename!r} is a device or fifo; only regular files are accepted"
                    )
                if info.flag_bits & 0x1:
                    raise AdapterError(f"archive member {info.filename!r} is encrypted")
                if info.is_dir():
                    writer.directory(info.filename)
                    continue
                with zf.open(info) as data:
                    writer.file(info.filename, _chunks(data))
    except AdapterError:
        raise
    except (zipfile.BadZipFile, EOFError, zlib.error, NotImplementedError, ValueError) as e:
        raise AdapterError(f"archive is truncated or corrupt ({e or type(e).__name__})") from None


def _chunks(data: IO[bytes]) -> Iterator[bytes]:
    while chunk := data.read(_CHUNK_BYTES):
        yield chunk
