"""SQLite backend specifics: WAL mode, several processes on one file, schema and path checks."""

from __future__ import annotations

import sqlite3
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gateway.store import SqliteOptions, SqliteStore, UsageTotals

REPO_ROOT = Path(__file__).resolve().parents[2]
T0 = 1_700_000_000.0

# Each child process opens the same file, says "ready", waits for the start file (so all of them run at
# once), then adds adapter versions of one name and bumps one usage counter, interleaved with its siblings.
CHILD = textwrap.dedent(
    """
    import hashlib, os, sys, time
    from gateway.store import open_store
    path, tenant_id, worker, start_file = sys.argv[1:5]
    with open_store(path) as store:
        print("ready", flush=True)
        while not os.path.exists(start_file):
            time.sleep(0.005)
        for n in range(15):
            sha = hashlib.sha256(f"{worker}-{n}".encode()).hexdigest()
            v = store.add_adapter_version(tenant_id, "bot", sha, rank=4, target_modules=["q_proj"], size_bytes=1)
            store.record_usage(tenant_id, 1_700_000_000.0, 1, 10, 1, 0)
            print(v.version, flush=True)
    """
)


def test_file_is_in_wal_mode(tmp_path: Path) -> None:
    path = tmp_path / "nested" / "dir" / "store.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
        assert conn.execute("PRAGMA user_version").fetchone()[0] == 1


def test_several_processes_share_one_file(tmp_path: Path) -> None:
    path, start_file = tmp_path / "store.db", tmp_path / "go"
    with SqliteStore(path) as store:
        tenant = store.create_tenant("acme")
    children = [
        subprocess.Popen([sys.executable, "-c", CHILD, str(path), tenant.id, str(i), str(start_file)],
                         cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for i in range(3)
    ]
    for child in children:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready", child.stderr
    start_file.touch()
    versions: list[int] = []
    for child in children:
        out, err = child.communicate(timeout=60)
        assert child.returncode == 0, err
        versions += [int(line) for line in out.split()]
    assert sorted(versions) == list(range(1, 46))
    with SqliteStore(path) as store:
        assert [r.version for r in store.list_adapters(tenant.id)] == list(range(1, 46))
        assert store.day_totals(tenant.id, T0) == UsageTotals(45, 450, 45, 0)


def test_newer_schema_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "store.db"
    SqliteStore(path).close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA user_version = 99")
    with pytest.raises(RuntimeError, match="schema version 99 is newer"):
        SqliteStore(path)


def test_bad_paths_and_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="is a directory"):
        SqliteStore(tmp_path)
    with pytest.raises(ValueError, match="synchronous"):
        SqliteOptions(synchronous="SOMETIMES")
    with pytest.raises(ValueError, match="busy_timeout_s"):
        SqliteOptions(busy_timeout_s=0)


def test_closed_store_refuses_calls(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "store.db", SqliteOptions(synchronous="FULL"))
    store.ping()
    store.close()
    with pytest.raises(RuntimeError, match="is closed"):
        store.list_tenants()


def test_failed_write_rolls_back_and_connection_stays_usable(tmp_path: Path) -> None:
    with SqliteStore(tmp_path / "store.db") as store:
        store.create_tenant("acme")
        with pytest.raises(Exception, match="already exists"):
            store.create_tenant("acme")
        assert [t.name for t in store.list_tenants()] == ["acme"]
        store.create_tenant("globex")
        assert len(store.list_tenants()) == 2
