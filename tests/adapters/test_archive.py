"""adapters.archive: round trips of real adapters, and every archive attack leaves nothing behind."""

from __future__ import annotations

import io
import stat
import tarfile
import zipfile
from pathlib import Path

import pytest

from adapters.archive import ArchiveLimits, pack_adapter_dir, unpack_adapter_archive
from adapters.errors import AdapterError
from adapters.peft_format import validate_peft_adapter
from engine.config import ModelConfig

CONFIG = b'{"r": 4}'
WEIGHTS = bytes(range(256)) * 64


def write_tar(path: Path, members: list[tuple[str, bytes | None, bytes]], mode: str = "w:gz") -> Path:
    """members: (name, data or None for a non-file, tar type); link targets point outside."""
    with tarfile.open(path, mode) as tar:
        for name, data, kind in members:
            info = tarfile.TarInfo(name)
            info.type = kind
            if kind in (tarfile.SYMTYPE, tarfile.LNKTYPE):
                info.linkname = "/etc/passwd"
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def adapter_tar(
    path: Path, prefix: str = "", extra: list[tuple[str, bytes | None, bytes]] = (), mode="w:gz"
) -> Path:
    files = [
        (f"{prefix}adapter_config.json", CONFIG, tarfile.REGTYPE),
        (f"{prefix}adapter_model.safetensors", WEIGHTS, tarfile.REGTYPE),
    ]
    return write_tar(path, [*files, *extra], mode)


def write_zip(path: Path, members: list[tuple[str, bytes, int | None]]) -> Path:
    """members: (name, data, unix mode or None)."""
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as zf:
        for name, data, mode in members:
            info = zipfile.ZipInfo(name)
            info.compress_type = zipfile.ZIP_DEFLATED
            if mode is not None:
                info.external_attr = mode << 16
            zf.writestr(info, data)
    return path


def test_pack_then_unpack_round_trips_a_peft_adapter(make_peft_adapter, llama_dir, tmp_path) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj", "v_proj"])
    archive = pack_adapter_dir(adapter_dir, tmp_path / "bot.tar.gz")
    assert archive.read_bytes() == pack_adapter_dir(adapter_dir, tmp_path / "again.tar.gz").read_bytes()
    out = unpack_adapter_archive(archive, tmp_path / "unpacked")
    assert sorted(p.name for p in out.iterdir()) == [
        "README.md",
        "adapter_config.json",
        "adapter_model.safetensors",
    ]
    config = ModelConfig.from_pretrained(llama_dir)
    assert validate_peft_adapter(out, config, name="a") == validate_peft_adapter(
        adapter_dir, config, name="a"
    )


def test_pack_to_a_temporary_file_and_refuse_pickles(make_peft_adapter, tmp_path) -> None:
    adapter_dir, _ = make_peft_adapter(r=4, target_modules=["q_proj"])
    archive = pack_adapter_dir(adapter_dir)
    try:
        assert archive.name.endswith(".tar.gz") and tarfile.is_tarfile(archive)
    finally:
        archive.unlink()
    (adapter_dir / "adapter_model.safetensors").rename(adapter_dir / "adapter_model.bin")
    with pytest.raises(AdapterError, match="adapter_model.bin is a pickle file"):
        pack_adapter_dir(adapter_dir, tmp_path / "x.tar.gz")
    assert not (tmp_path / "x.tar.gz").exists()


@pytest.mark.parametrize("layout", ["flat", "one-dir", "dot-slash", "plain-tar", "zip", "zip-one-dir"])
def test_accepted_layouts(tmp_path, layout) -> None:
    archive = tmp_path / "a.archive"
    if layout == "flat":
        adapter_tar(archive)
    elif layout == "one-dir":
        adapter_tar(archive, "my-adapter/", extra=[("my-adapter", None, tarfile.DIRTYPE)])
    elif layout == "dot-slash":
        adapter_tar(archive, "./", extra=[(".", None, tarfile.DIRTYPE)])
    elif layout == "plain-tar":
        adapter_tar(archive, mode="w")
    else:
        prefix = "d/" if layout == "zip-one-dir" else ""
        write_zip(
            archive,
            [
                (f"{prefix}adapter_config.json", CONFIG, 0o100644),
                (f"{prefix}adapter_model.safetensors", WEIGHTS, None),
            ],
        )
    out = unpack_adapter_archive(archive, tmp_path / "out")
    assert (out / "adapter_config.json").read_bytes() == CONFIG
    assert (out / "adapter_model.safetensors").read_bytes() == WEIGHTS


REJECTED_TARS = {
    "traversal": (
        lambda p: adapter_tar(p, extra=[("../evil.json", b"x", tarfile.REGTYPE)]),
        r"'\.\.' path components",
    ),
    "traversal-in-dir": (lambda p: adapter_tar(p, "d/../../"), r"'\.\.' path components"),
    "absolute": (lambda p: adapter_tar(p, "/tmp/"), r"absolute paths are not accepted"),
    "symlink": (
        lambda p: adapter_tar(p, extra=[("README.md", None, tarfile.SYMTYPE)]),
        r"'README.md' is a symlink",
    ),
    "hardlink": (
        lambda p: adapter_tar(p, extra=[("README.md", None, tarfile.LNKTYPE)]),
        r"'README.md' is a hardlink",
    ),
    "device": (
        lambda p: adapter_tar(p, extra=[("README.md", None, tarfile.CHRTYPE)]),
        r"is a device or fifo",
    ),
    "fifo": (lambda p: adapter_tar(p, extra=[("README.md", None, tarfile.FIFOTYPE)]), r"is a device or fifo"),
    "other-file": (
        lambda p: adapter_tar(p, extra=[("run.sh", b"#!", tarfile.REGTYPE)]),
        r"'run.sh' is not accepted",
    ),
    "pickle": (
        lambda p: adapter_tar(p, extra=[("adapter_model.bin", b"\x80", tarfile.REGTYPE)]),
        r"is a pickle file",
    ),
    "duplicate": (
        lambda p: adapter_tar(p, extra=[("adapter_config.json", b"{}", tarfile.REGTYPE)]),
        r"holds adapter_config.json twice",
    ),
    "nested-dir": (lambda p: adapter_tar(p, "a/b/"), r"files must sit at the top level or in one directory"),
    "two-top-dirs": (
        lambda p: write_tar(
            p,
            [
                ("a/adapter_config.json", CONFIG, tarfile.REGTYPE),
                ("b/adapter_model.safetensors", WEIGHTS, tarfile.REGTYPE),
            ],
        ),
        r"at its top level or inside one directory \(found 'b/adapter_model.safetensors'\)",
    ),
    "missing-weights": (
        lambda p: write_tar(p, [("adapter_config.json", CONFIG, tarfile.REGTYPE)]),
        r"archive has no adapter_model.safetensors",
    ),
    "too-many-members": (
        lambda p: write_tar(p, [("./", None, tarfile.DIRTYPE)] * 17),
        r"more than 16 entries",
    ),
    "not-an-archive": (lambda p: p.write_bytes(b"just some bytes" * 100), r"unsupported archive format"),
}


@pytest.mark.parametrize("make, message", REJECTED_TARS.values(), ids=REJECTED_TARS.keys())
def test_rejected_archives_leave_nothing(tmp_path, make, message) -> None:
    archive = tmp_path / "upload"
    make(archive)
    with pytest.raises(AdapterError, match=message):
        unpack_adapter_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["upload"]


REJECTED_ZIPS = {
    "symlink": ([("README.md", b"/etc/passwd", stat.S_IFLNK | 0o777)], r"'README.md' is a symlink"),
    "fifo": ([("README.md", b"", stat.S_IFIFO | 0o644)], r"is a device or fifo"),
    "traversal": ([("../../adapter_config.json", CONFIG, None)], r"'\.\.' path components"),
    "absolute": ([("/adapter_config.json", CONFIG, None)], r"absolute paths are not accepted"),
    "windows-absolute": ([("C:/adapter_config.json", CONFIG, None)], r"absolute paths are not accepted"),
    "backslash": ([("d\\adapter_config.json", CONFIG, None)], r"backslashes and NUL bytes"),
}


@pytest.mark.parametrize("members, message", REJECTED_ZIPS.values(), ids=REJECTED_ZIPS.keys())
def test_rejected_zips_leave_nothing(tmp_path, members, message) -> None:
    archive = write_zip(tmp_path / "upload.zip", [("adapter_model.safetensors", WEIGHTS, None), *members])
    with pytest.raises(AdapterError, match=message):
        unpack_adapter_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["tar.gz", "zip"])
def test_compression_bomb_is_stopped_by_ratio(tmp_path, kind) -> None:
    zeros = bytes(8 << 20)  # 8 MiB of zeros packs into a few KiB
    if kind == "zip":
        archive = write_zip(
            tmp_path / "bomb",
            [("adapter_config.json", CONFIG, None), ("adapter_model.safetensors", zeros, None)],
        )
    else:
        archive = write_tar(
            tmp_path / "bomb",
            [
                ("adapter_config.json", CONFIG, tarfile.REGTYPE),
                ("adapter_model.safetensors", zeros, tarfile.REGTYPE),
            ],
        )
    assert archive.stat().st_size < 64 << 10
    with pytest.raises(
        AdapterError, match=r"unpacks to more than 100 times its size \(refused as a possible archive bomb\)"
    ):
        unpack_adapter_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_size_limits_per_file_and_in_total(tmp_path) -> None:
    archive = adapter_tar(tmp_path / "a.tgz", extra=[("README.md", WEIGHTS, tarfile.REGTYPE)])
    with pytest.raises(AdapterError, match=r"'adapter_model.safetensors' unpacks to more than 1000 bytes"):
        unpack_adapter_archive(archive, tmp_path / "out", ArchiveLimits(max_file_bytes=1000))
    with pytest.raises(AdapterError, match=rf"archive unpacks to more than {len(WEIGHTS) + 100} bytes"):
        unpack_adapter_archive(archive, tmp_path / "out", ArchiveLimits(max_total_bytes=len(WEIGHTS) + 100))
    assert not (tmp_path / "out").exists()


def test_zip_header_that_lies_about_sizes_is_caught_while_reading(tmp_path) -> None:
    """A zip whose central directory claims 10 bytes for a bigger member is refused, not half-written."""
    archive = write_zip(
        tmp_path / "liar.zip",
        [("adapter_config.json", CONFIG, None), ("adapter_model.safetensors", WEIGHTS, None)],
    )
    data = bytearray(archive.read_bytes())
    central = data.rindex(b"PK\x01\x02")  # the last central directory entry: adapter_model.safetensors
    data[central + 24 : central + 28] = (10).to_bytes(4, "little")  # uncompressed size field
    archive.write_bytes(bytes(data))
    with pytest.raises(
        AdapterError, match=r"archive is truncated or corrupt \(Bad CRC-32 for file 'adapter_model"
    ):
        unpack_adapter_archive(archive, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["tar.gz", "tar", "zip"])
def test_truncated_archive(tmp_path, kind) -> None:
    path = tmp_path / "full"
    if kind == "zip":
        write_zip(path, [("adapter_config.json", CONFIG, None), ("adapter_model.safetensors", WEIGHTS, None)])
    else:
        adapter_tar(path, mode="w:gz" if kind == "tar.gz" else "w")
    cut = tmp_path / "cut"
    data = path.read_bytes()
    cut.write_bytes(data[: len(data) // 2] if kind != "tar" else data[:2048])
    with pytest.raises(AdapterError, match=r"archive is truncated or corrupt"):
        unpack_adapter_archive(cut, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_destination_must_be_fresh(tmp_path) -> None:
    archive = adapter_tar(tmp_path / "a.tgz")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep").write_text("mine")
    with pytest.raises(FileExistsError):
        unpack_adapter_archive(archive, tmp_path / "out")
    assert (tmp_path / "out" / "keep").read_text() == "mine"
