"""Content-addressed adapter storage: <root>/<sha256>/{adapter_config.json, adapter_model.safetensors}.

The directory name is the adapter's content digest (adapters.adapter_files.adapter_digest), so a stored
adapter never changes and storing the same content twice is a no-op. Writes go to a temporary directory
inside root (same filesystem) and appear with one os.rename, so readers see a complete adapter or none.
Names, versions and tenants live in the gateway's registry, not here. Files are 0600 and directories
0700 (mkdtemp's own mode, kept by the rename): adapters are tenants' data.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path

from adapters.adapter_files import (
    ADAPTER_CONFIG_FILE,
    ADAPTER_WEIGHTS_FILE,
    REQUIRED_ADAPTER_FILES,
    adapter_digest,
    is_sha256_hex,
)
from adapters.errors import AdapterError

_TEMP_PREFIX = ".tmp-"
_COPY_CHUNK_BYTES = 1 << 20


class AdapterStorage:
    """Stores adapter files by content digest under one root directory.

    Safe for several processes sharing root: a write is invisible until its rename, and two writers of
    the same content both succeed with one copy kept. A writer killed mid-way leaves only a `.tmp-*`
    directory, which no method reports and which the next AdapterStorage on this root removes once it is
    older than `stale_temp_seconds`.
    """

    def __init__(self, root: str | Path, stale_temp_seconds: float = 3600.0) -> None:
        self.root = Path(root)
        self.root.mkdir(mode=0o700, parents=True, exist_ok=True)  # NOTE: owner-only, as every file below it
        self.remove_stale_temporaries(stale_temp_seconds)

    def put(self, adapter_dir: str | Path, expected_sha256: str | None = None) -> str:
        """Copy an adapter directory's two files into storage; return their content digest.

        expected_sha256: the digest validation computed; when the files on disk no longer match it
        (changed since validation), nothing is stored and AdapterError is raised.
        """
        src = Path(adapter_dir)
        for name in REQUIRED_ADAPTER_FILES:
            if not (src / name).is_file():
                raise AdapterError(f"{name} is missing from {src}")
        tmp = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=self.root))
        try:
            config_bytes = (src / ADAPTER_CONFIG_FILE).read_bytes()
            _write_synced(tmp / ADAPTER_CONFIG_FILE, [config_bytes])
            weights_sha256 = _copy_hashing(src / ADAPTER_WEIGHTS_FILE, tmp / ADAPTER_WEIGHTS_FILE)
            digest = adapter_digest(config_bytes, weights_sha256)
            if expected_sha256 is not None and digest != expected_sha256:
                raise AdapterError(
                    f"adapter files changed after validation (expected digest {expected_sha256}, found {digest})"
                )
            _fsync_dir(tmp)
            final = self.root / digest
            if not final.is_dir():
                try:
                    os.rename(tmp, final)
                    _fsync_dir(self.root)
                except OSError as e:
                    # Another writer stored the same content first: keep theirs.
                    if e.errno not in (errno.ENOTEMPTY, errno.EEXIST) or not final.is_dir():
                        raise
            return digest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    def path_for(self, sha256: str) -> Path:
        """Directory holding the adapter with this digest. Raises KeyError when it is not stored."""
        path = self._path(sha256)
        if not path.is_dir():
            raise KeyError(f"adapter {sha256} is not in storage")
        return path

    def exists(self, sha256: str) -> bool:
        return self._path(sha256).is_dir()

    def delete(self, sha256: str) -> bool:
        """Remove a stored adapter; False when it was not stored. It vanishes at once (rename), then is erased."""
        path = self._path(sha256)
        doomed = Path(tempfile.mkdtemp(prefix=_TEMP_PREFIX, dir=self.root)) / "deleted"
        try:
            os.rename(path, doomed)
        except FileNotFoundError:
            return False
        finally:
            shutil.rmtree(doomed.parent, ignore_errors=True)
        return True

    def digests(self) -> list[str]:
        """Digests of every stored adapter, sorted."""
        return sorted(p.name for p in self.root.iterdir() if is_sha256_hex(p.name) and p.is_dir())

    def total_bytes(self) -> int:
        """Bytes of all stored adapter files (temporaries of writes in flight excluded)."""
        return sum(
            f.stat().st_size for sha in self.digests() for f in (self.root / sha).iterdir() if f.is_file()
        )

    def remove_stale_temporaries(self, older_than_seconds: float) -> int:
        """Erase `.tmp-*` directories (left by killed writers) not modified for `older_than_seconds`."""
        cutoff = time.time() - older_than_seconds
        removed = 0
        for entry in self.root.iterdir():
            if entry.name.startswith(_TEMP_PREFIX) and entry.stat().st_mtime <= cutoff:
                shutil.rmtree(entry, ignore_errors=True)
                removed += 1
        return removed

    def _path(self, sha256: str) -> Path:
        if not is_sha256_hex(sha256):
            raise ValueError(f"not an adapter digest (64 lowercase hex digits): {sha256!r}")
        return self.root / sha256


def _copy_hashing(src: Path, dst: Path) -> str:
    digest = hashlib.sha256()

    def chunks():
        with src.open("rb") as f:
            while chunk := f.read(_COPY_CHUNK_BYTES):
                digest.update(chunk)
                yield chunk

    _write_synced(dst, chunks())
    return digest.hexdigest()


def _write_synced(path: Path, chunks) -> None:
    """A new file, owner-only (0600, whatever the umask), with `chunks` written and synced."""
    with open(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as out:
        for chunk in chunks:
            out.write(chunk)
        out.flush()
        os.fsync(out.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
