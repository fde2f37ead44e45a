"""`loraplex` operator commands on the gateway's store, the shared flag parser, and the hand-off of
`loraplex worker` to the worker's own command."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gateway.cli.main import build_parser, main
from gateway.store import open_store
from gateway.workers.supervisor import worker_argv
from worker import cli as worker_cli


def run(capsys, data_dir: Path, *argv: str) -> tuple[int, list[str]]:
    code = main([*argv, "--data-dir", str(data_dir)])
    out = capsys.readouterr().out.strip().splitlines()
    return code, out


def test_shared_flags_read_environment_and_flags_win():
    env = {"LORAPLEX_MODEL": "/models/x", "LORAPLEX_PORT": "9100", "LORAPLEX_REDIS_URL": "redis://r:6379/0",
           "LORAPLEX_SERVED_MODEL_NAME": "base", "LORAPLEX_HOST": "0.0.0.0", "LORAPLEX_DATA_DIR": "/var/lpx"}
    parser = build_parser(env)
    for command in (["serve"], ["tenants", "list"], ["keys", "list"]):
        args = parser.parse_args(command)
        assert (args.model, args.port, args.redis_url, args.served_model_name, args.host, args.data_dir) == (
            "/models/x", 9100, "redis://r:6379/0", "base", "0.0.0.0", Path("/var/lpx"))
        assert callable(args.handler)  # dispatch by function, never by a module-name string
    assert parser.parse_args(["serve", "--port", "8080"]).port == 8080
    assert build_parser({}).parse_args(["serve"]).port == 8000
    worker = worker_cli.build_parser(env).parse_args([])
    assert (worker.model, worker.port, worker.served_model_name, worker.host) == ("/models/x", 9100, "base", "0.0.0.0")
    assert worker_cli.build_parser({}).parse_args([]).port is None
    assert worker_cli.build_parser({}).parse_args([]).engine_loop == "process"  # the engine in a child process
    assert worker_cli.build_parser({"LORAPLEX_ENGINE_LOOP": "thread"}).parse_args([]).engine_loop == "thread"
    with pytest.raises(SystemExit):
        worker_cli.build_parser({}).parse_args(["--engine-loop", "fork"])
    with pytest.raises(SystemExit):
        parser.parse_args(["keys", "create"])  # --tenant or --admin is required


def test_tenants_and_keys_lifecycle(capsys, tmp_path):
    code, out = run(capsys, tmp_path, "tenants", "create", "acme", "--policy", '{"max_priority": 4}')
    assert code == 0 and out[-1].startswith("ten_")
    tenant_id = out[-1]
    code, out = run(capsys, tmp_path, "keys", "create", "--tenant", "acme", "--name", "ci", "--expires-in", "2h")
    assert code == 0 and out[-1].startswith("lpx-") and " " not in out[-1]
    key = out[-1]
    with open_store(tmp_path / "store.db") as store:
        found = store.authenticate(key)
        assert found is not None and found.tenant.id == tenant_id and found.key.expires_at is not None
        key_id = found.key.id
        assert key not in (tmp_path / "store.db").read_bytes().decode("latin-1")  # only the hash is stored
    code, out = run(capsys, tmp_path, "keys", "list", "--tenant", "acme")
    assert any(key_id in line and "active" in line for line in out) and not any(key in line for line in out)
    code, out = run(capsys, tmp_path, "tenants", "show", "acme")
    assert code == 0 and any('"max_priority": 4' in line for line in out) and any(key_id in line for line in out)
    code, out = run(capsys, tmp_path, "keys", "revoke", key_id)
    assert code == 0
    with open_store(tmp_path / "store.db") as store:
        assert store.authenticate(key) is None
    code, out = run(capsys, tmp_path, "tenants", "list")
    assert any("acme" in line for line in out)


def test_admin_key_goes_to_the_operators_tenant(capsys, tmp_path):
    code, out = run(capsys, tmp_path, "keys", "create", "--admin")
    assert code == 0
    with open_store(tmp_path / "store.db") as store:
        found = store.authenticate(out[-1])
        assert found.tenant.name == "operators" and found.key.scopes == frozenset({"admin"})


def test_operator_mistakes_are_clear_errors(capsys, tmp_path):
    assert main(["keys", "create", "--tenant", "nobody", "--data-dir", str(tmp_path)]) == 2
    assert "no tenant named 'nobody'" in capsys.readouterr().err
    assert main(["keys", "revoke", "key_missing", "--data-dir", str(tmp_path)]) == 2
    assert main(["tenants", "create", "bad name!", "--data-dir", str(tmp_path)]) == 2
    assert "invalid" in capsys.readouterr().err
    main(["tenants", "create", "dup", "--data-dir", str(tmp_path)])
    assert main(["tenants", "create", "dup", "--data-dir", str(tmp_path)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert main(["keys", "create", "--tenant", "dup", "--expires-in", "soon", "--data-dir", str(tmp_path)]) == 2


@pytest.mark.redis
def test_operator_commands_work_on_redis(capsys, redis_server, tmp_path):
    code, out = run(capsys, tmp_path, "tenants", "create", "acme", "--redis-url", redis_server.url)
    code, out = run(capsys, tmp_path, "keys", "create", "--tenant", "acme", "--redis-url", redis_server.url)
    with open_store(redis_server.url) as store:
        assert store.authenticate(out[-1]).tenant.name == "acme"
    assert not (tmp_path / "store.db").exists()


def test_loraplex_worker_is_the_worker_command():
    """`loraplex worker ARGS` execs `python -m worker ARGS` (the supervisor starts its worker the same way),
    so the worker's parser answers: its --help, and its errors, without a model or torch."""
    assert worker_argv(["--port", "1"]) == [sys.executable, "-P", "-m", "worker", "--port", "1"]
    helped = subprocess.run([sys.executable, "-m", "gateway.cli.main", "worker", "--help"], capture_output=True,
                            text=True, timeout=60)
    assert helped.returncode == 0 and helped.stdout.startswith("usage: loraplex worker")
    assert "--register-redis-url" in helped.stdout and "--kv-cache-memory-gb" in helped.stdout
    refused = subprocess.run([sys.executable, "-m", "gateway.cli.main", "worker", "--model", "/nowhere"],
                             capture_output=True, text=True, timeout=60, env={"PATH": "/usr/bin:/bin"})
    assert refused.returncode == 2 and "LORAPLEX_WORKER_SECRET" in refused.stderr


def test_serve_passes_engine_flags_to_its_worker():
    """`loraplex serve`'s engine flags reach the worker it starts, and the worker's parser reads them back."""
    from gateway.cli.serve import worker_command

    args = build_parser({}).parse_args(["serve", "--threads", "3", "--decode-graphs", "on", "--quantization", "int8",
                                        "--kv-cache-dtype", "int8", "--quantize-lm-head"])
    argv = worker_command(args, Path("/models/m"), "m", 8123)
    parsed = worker_cli.build_parser({}).parse_args(argv[argv.index("worker") + 1:])
    assert (parsed.threads, parsed.decode_graphs, parsed.quantization, parsed.kv_cache_dtype, parsed.port,
            parsed.quantize_lm_head) == (3, "on", "int8", "int8", 8123, True)
    assert build_parser({}).parse_args(["serve"]).kv_cache_dtype == "auto"
    assert not build_parser({}).parse_args(["serve"]).quantize_lm_head
    assert build_parser({}).parse_args(["serve"]).threads is None  # torch's default unless asked
    with pytest.raises(SystemExit):
        build_parser({}).parse_args(["serve", "--threads", "0"])
