"""docker-compose.yml parses, and what it asks of loraplex is what the CLI accepts.

Docker is not needed: every gateway and worker `command:` is parsed, with that service's environment,
by the parser that will parse it in the container: `gateway.cli.main.build_parser()` for `serve`, and
`worker.cli.build_parser()` for `worker` (the `loraplex` entrypoint hands `worker ...` to the worker's
own command). Every LORAPLEX_* variable of a service must be one its parser (or the worker secret) reads. The topology the issue asks for is checked too: redis, two gateways behind one
published port, two GPU workers with a CPU fallback profile, a collector, Prometheus with a scrape
config, and volumes for the data dir and adapter storage shared at the same path.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path

import pytest
import yaml

from gateway.cli.main import WORKER_COMMAND, build_parser
from gateway.workers.supervisor import SECRET_ENV
from tests.cli_env import RecordingEnv
from worker import cli as worker_cli

REPO = Path(__file__).resolve().parents[1]
DEFAULTS_FOR_REQUIRED = {"LORAPLEX_WORKER_SECRET": "compose-test-secret", "LORAPLEX_MODEL_DIR": "/srv/model"}
VARIABLE = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(value: str) -> str:
    """Compose's ${VAR}, ${VAR:-default}, ${VAR:?error}, with the required ones given test values."""
    def one(match: re.Match) -> str:
        name, op, arg = match.group(1), match.group(2), match.group(3)
        if op and op.endswith("-"):
            return arg
        if op and op.endswith("?"):
            return DEFAULTS_FOR_REQUIRED[name]
        raise AssertionError(f"${{{name}}} has neither a default nor a required-message")
    return VARIABLE.sub(one, value)


@pytest.fixture(scope="module")
def compose() -> dict:
    with open(REPO / "docker-compose.yml") as f:
        return yaml.safe_load(f)


def environment(service: dict) -> dict[str, str]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: interpolate(str(v)) for k, v in env.items()}


def mounts(service: dict) -> dict[str, str]:
    """Mount point → source (a named volume or a host path), after interpolation."""
    pairs = [interpolate(v).split(":")[:2] for v in service.get("volumes", [])]
    return {target: source for source, target in pairs}


def loraplex_services(compose: dict, command: str) -> dict[str, dict]:
    return {name: s for name, s in compose["services"].items()
            if s.get("image") == "loraplex:latest" and s.get("command", ["serve"])[0] == command}


def parse_command(command: list[str], env: Mapping[str, str]):
    """What the container's `loraplex COMMAND...` parses to (SystemExit on any bad flag)."""
    if command[:1] == [WORKER_COMMAND]:
        args = worker_cli.build_parser(env).parse_args(command[1:])
        args.command = WORKER_COMMAND
        return args
    return build_parser(env).parse_args(command)


def known_env_names(command: str) -> set[str]:
    """The LORAPLEX_* variables the parser of `loraplex COMMAND` reads, and the worker secret."""
    recorder = RecordingEnv({})
    if command == WORKER_COMMAND:
        worker_cli.build_parser(recorder)
        assert worker_cli.SECRET_ENV == SECRET_ENV  # the gateway sets what the worker reads
    else:
        build_parser(recorder)
    return recorder.asked | {SECRET_ENV}


def test_the_topology_the_issue_asks_for(compose):
    services = compose["services"]
    assert {"redis", "otel-collector", "prometheus"} <= set(services)
    gateways, workers = loraplex_services(compose, "serve"), loraplex_services(compose, "worker")
    assert len(gateways) == 2
    published = [name for name, s in services.items() if s.get("ports") and name not in ("prometheus",)]
    assert published == ["load-balancer"] and not any(g.get("ports") for g in gateways.values())
    nginx = (REPO / "deploy/nginx.conf").read_text()
    assert all(f"server {name}:8000" in nginx for name in gateways)
    gpu = {n: w for n, w in workers.items() if w.get("profiles") == ["gpu"]}
    cpu = {n: w for n, w in workers.items() if w.get("profiles") == ["cpu"]}
    assert len(gpu) == 2 and len(cpu) == 2
    for w in gpu.values():
        devices = w["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    assert len({tuple(w["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]) for w in gpu.values()}) == 2
    assert {"loraplex-data", "loraplex-adapters"} <= set(compose["volumes"])
    prometheus = yaml.safe_load((REPO / "deploy/prometheus.yml").read_text())
    targets = prometheus["scrape_configs"][0]["static_configs"][0]["targets"]
    assert sorted(targets) == sorted(f"{g}:8000" for g in gateways)
    collector = yaml.safe_load((REPO / "deploy/otel-collector.yaml").read_text())
    assert collector["service"]["pipelines"]["traces"]["receivers"] == ["otlp"]
    build = services["gateway-1"]["build"]
    assert build["context"] == "." and interpolate(build["network"]) == "default"
    # the image's base and torch source are build arguments, today's defaults for real deployments
    assert {k: interpolate(v) for k, v in build["args"].items()} == {"BASE_IMAGE": "python:3.11-slim",
                                                                    "TORCH_INDEX_URL": ""}
    dockerfile = (REPO / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["loraplex"]' in dockerfile
    assert all(f"ARG {name}" in dockerfile for name in build["args"])
    # the stand-ins for a machine without a registry are opt-in: the defaults are the upstream images
    assert interpolate(services["redis"]["image"]) == "redis:7-alpine"
    assert interpolate(services["load-balancer"]["image"]) == "nginx:1.27-alpine"
    assert "name" not in compose  # Debian's docker-compose 1.29 rejects a top-level name


def test_every_loraplex_variable_is_one_the_cli_reads(compose):
    assert {"LORAPLEX_ROUTING", "LORAPLEX_DISCOVER_WORKERS"} <= known_env_names("serve")
    assert "LORAPLEX_REGISTER_REDIS_URL" in known_env_names(WORKER_COMMAND)
    for name, service in compose["services"].items():
        if service.get("image") != "loraplex:latest":
            continue
        known = known_env_names(service.get("command", ["serve"])[0])
        unknown = {k for k in environment(service) if k.startswith("LORAPLEX_")} - known
        assert not unknown, f"{name}: the CLI reads no {sorted(unknown)}"


def test_gateway_commands_parse_and_discover_the_workers(compose):
    for name, service in loraplex_services(compose, "serve").items():
        env = environment(service)
        args = parse_command(service["command"], env)
        assert args.command == "serve", name
        assert args.redis_url == "redis://redis:6379/0" and args.discover_workers, name
        assert args.routing == "cache_aware" and args.host == "0.0.0.0" and args.port == 8000, name
        assert str(args.data_dir) == "/data" and args.model == "/models/base", name
        assert args.otlp_endpoint == "http://otel-collector:4318", name
        assert env[SECRET_ENV], name
        where = mounts(service)
        assert where["/data/adapters"] == "loraplex-adapters" and where["/models/base"] == "/srv/model", name


def test_worker_commands_parse_and_advertise_their_own_service(compose):
    gateway_mounts = mounts(compose["services"]["gateway-1"])
    for name, service in loraplex_services(compose, "worker").items():
        env = environment(service)
        args = parse_command(service["command"], env)
        assert args.command == "worker", name
        assert args.register_redis_url == "redis://redis:6379/0", name
        assert args.advertise_url == f"http://{name}:{args.port}", name  # gateways reach it by service name
        assert args.host == "0.0.0.0" and args.model == "/models/base", name
        assert args.device == ("cuda" if service["profiles"] == ["gpu"] else "cpu"), name
        assert env[SECRET_ENV] == environment(compose["services"]["gateway-1"])[SECRET_ENV], name
        # adapters are read at the path the gateways stored them under, from the same volume
        assert mounts(service)["/data/adapters"] == gateway_mounts["/data/adapters"] == "loraplex-adapters", name
        assert mounts(service)["/models/base"] == gateway_mounts["/models/base"], name


def test_the_check_would_catch_a_wrong_flag_or_variable(compose):
    service = compose["services"]["worker-1"]
    with pytest.raises(SystemExit):
        parse_command([*service["command"], "--no-such-flag"], environment(service))
    with pytest.raises(SystemExit):
        parse_command([*service["command"], "--discover-workers"], environment(service))  # a gateway flag
    assert "LORAPLEX_NO_SUCH_SETTING" not in known_env_names(WORKER_COMMAND) | known_env_names("serve")


def test_the_image_copies_every_package():
    """The Dockerfile copies each top-level package that pyproject.toml installs (a new one is not forgotten)."""
    import tomllib

    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = set(re.findall(r"^COPY (\w+) \./\1$", (REPO / "Dockerfile").read_text(), re.MULTILINE))
    assert packages <= copied, f"the Dockerfile does not copy {sorted(packages - copied)}"
    # .dockerignore is an allow-list: everything the Dockerfile copies from the context must be let in
    allowed = {line[1:].rstrip("/") for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.startswith("!")}
    sources = {src.rstrip("/") for src in re.findall(r"^COPY (?!--from)(\S+(?: \S+)*) \S+$",
                                                   (REPO / "Dockerfile").read_text(), re.MULTILINE)
               for src in src.split()}
    assert sources and sources <= allowed, f".dockerignore leaves out {sorted(sources - allowed)}"
