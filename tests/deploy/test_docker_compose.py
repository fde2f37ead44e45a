"""docker-compose.yml for real: build the image, bring up the CPU topology, serve through the load balancer.

    .venv/bin/python -m pytest -m docker tests/deploy/test_docker_compose.py

Left out of the default run (marker `docker`: minutes, root, network). What it does is what an operator
does on a machine that reaches Debian's mirror and PyPI but no image registry (README, "Docker"):
scripts/docker/dockerd.sh starts a daemon of its own when none answers (and stops it at the end),
scripts/docker/build-offline.sh builds a debootstrapped Debian base, the redis/nginx stand-in and
loraplex:latest (`docker-compose build`, with the CPU torch wheel pip finds here), then
`docker-compose --profile cpu up -d` of redis, two gateways, two CPU workers and the load balancer with
the demo checkpoint (demo/checkpoint.py) as the model, a tenant and keys made with `docker-compose run`,
completions through the load balancer and through each gateway, and `docker-compose down -v`.

Skips (with the reason) where docker, docker-compose or debootstrap is missing, or no daemon answers
and none can be started (not root). Caches under bench/.cache/docker (images in the daemon's data root,
the debootstrap tarball, the demo model), so a second run only rebuilds what changed.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port

pytestmark = [pytest.mark.docker, pytest.mark.timeout(3600)]

REPO = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("LORAPLEX_DOCKER_CACHE", REPO / "bench/.cache/docker"))
DOCKERD_RUN = Path(os.environ.get("LORAPLEX_DOCKERD_RUN", "/tmp/loraplex-dockerd"))
SERVICES = ["redis", "gateway-1", "gateway-2", "worker-1-cpu", "worker-2-cpu", "load-balancer"]
GATEWAYS, WORKERS = ["gateway-1", "gateway-2"], ["worker-1-cpu", "worker-2-cpu"]
WORKER_SECRET_HEADER = "x-loraplex-worker-secret"  # wire.protocol.WORKER_SECRET_HEADER
READY_TIMEOUT_S = 600.0


def daemon_answers(env: dict[str, str]) -> bool:
    done = subprocess.run(["docker", "version", "--format", "{{.Server.Version}}"], env=env,
                          capture_output=True, text=True, timeout=30)
    return done.returncode == 0


@pytest.fixture(scope="session")
def docker_env() -> Iterator[dict[str, str]]:
    """The environment of every docker command: a daemon that answers (DOCKER_HOST's or the system's), or one
    started by scripts/docker/dockerd.sh (stopped again at the end unless it ran already)."""
    for tool in ("docker", "docker-compose", "debootstrap"):
        if shutil.which(tool) is None:
            pytest.skip(f"no {tool} on PATH (scripts/docker/install-docker.sh installs Debian's)")
    env = dict(os.environ)
    if env.get("DOCKER_HOST") and daemon_answers(env):
        yield env
        return
    if not env.get("DOCKER_HOST") and Path("/var/run/docker.sock").exists() and daemon_answers(env):
        yield env
        return
    env["DOCKER_HOST"] = f"unix://{DOCKERD_RUN / 'docker.sock'}"
    env.setdefault("LORAPLEX_DOCKER_CACHE", str(CACHE))
    env.setdefault("LORAPLEX_DOCKERD_RUN", str(DOCKERD_RUN))
    ran_already = daemon_answers(env)
    if not ran_already:
        started = subprocess.run([REPO / "scripts/docker/dockerd.sh", "start"], env=env, capture_output=True,
                                 text=True, timeout=120)
        if started.returncode != 0:
            pytest.skip(f"no Docker daemon could start: {started.stderr.strip()[-600:]}")
    try:
        yield env
    finally:
        if not ran_already:
            subprocess.run([REPO / "scripts/docker/dockerd.sh", "stop"], env=env, timeout=60, check=False)


def demo_model() -> Path:
    """The demo checkpoint (built once into the cache by the host's Python), readable by the image's user."""
    target = CACHE / "demo-model"
    if not (target / "config.json").is_file():
        tmp = CACHE / "demo-model.part"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        subprocess.run([sys.executable, "-P", "-m", "demo.checkpoint", str(tmp)], cwd=REPO, check=True,
                       capture_output=True, timeout=300)
        os.rename(tmp, target)
    for path in [target, *target.iterdir()]:
        path.chmod(0o755 if path.is_dir() else 0o644)  # the containers run as uid 10001
    return target


class Compose:
    """`docker-compose --env-file ... -p ... --profile cpu` of this test's project."""

    def __init__(self, env: dict[str, str], env_file: Path, project: str) -> None:
        self.env, self.env_file, self.project = env, env_file, project

    def argv(self, *args: str) -> list[str]:
        return ["docker-compose", "--env-file", str(self.env_file), "-p", self.project, "--profile", "cpu", *args]

    def __call__(self, *args: str, timeout: float = 600) -> str:
        done = subprocess.run(self.argv(*args), cwd=REPO, env=self.env, capture_output=True, text=True,
                              timeout=timeout)
        assert done.returncode == 0, f"docker-compose {' '.join(args)}: {done.stderr[-3000:]}"
        return done.stdout

    def container_ip(self, service: str) -> str:
        cid = self("ps", "-q", service).strip()
        assert cid, f"{service} has no container"
        inspect = subprocess.run(["docker", "inspect", cid], env=self.env, capture_output=True, text=True,
                                 check=True)
        networks = json.loads(inspect.stdout)[0]["NetworkSettings"]["Networks"]
        return next(n["IPAddress"] for n in networks.values() if n["IPAddress"])

    def logs(self) -> str:
        done = subprocess.run(self.argv("logs", "--no-color", "--tail", "30"), cwd=REPO, env=self.env,
                              capture_output=True, text=True, timeout=120)
        return done.stdout[-6000:]


@pytest.fixture(scope="module")
def stack(docker_env) -> Iterator[dict]:
    """The CPU topology up, with a tenant key and an operator key made through `docker-compose run`."""
    env = dict(docker_env)
    env_file = CACHE / "offline.env"
    build = subprocess.run([REPO / "scripts/docker/build-offline.sh", str(env_file)], cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=3000)
    assert build.returncode == 0, f"build-offline.sh failed: {build.stdout[-2000:]}{build.stderr[-3000:]}"
    port = free_port()
    env.update({
        "LORAPLEX_WORKER_SECRET": secrets.token_hex(32),
        "LORAPLEX_MODEL_DIR": str(demo_model()),
        "LORAPLEX_OTLP_ENDPOINT": "",  # no collector in this run (its image is not built here)
        "LORAPLEX_PORT": str(port),
        "LORAPLEX_ROUTING": "round_robin",
    })
    compose = Compose(env, env_file, project=f"loraplex-test-{os.getpid()}")
    try:
        compose("up", "-d", *SERVICES)
        base = f"http://127.0.0.1:{port}"
        wait_until_healthy(compose, base)
        tenant_id = last_line(compose("run", "--rm", "-T", "gateway-1", "tenants", "create", "acme"))
        assert tenant_id.startswith("ten_")
        key = last_line(compose("run", "--rm", "-T", "gateway-2", "keys", "create", "--tenant", "acme"))
        admin = last_line(compose("run", "--rm", "-T", "gateway-1", "keys", "create", "--admin"))
        yield {"compose": compose, "base": base, "key": key, "admin": admin, "tenant_id": tenant_id}
    finally:
        subprocess.run(compose.argv("down", "-v", "--remove-orphans"), cwd=REPO, env=env, capture_output=True,
                       timeout=300, check=False)


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1].strip()


def wait_until_healthy(compose: Compose, base: str) -> None:
    """Until the load balancer's /health is ok (a gateway that reaches a worker) and both workers answer."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    secret = compose.env["LORAPLEX_WORKER_SECRET"]
    while True:
        try:
            ok = httpx.get(f"{base}/health", timeout=5).status_code == 200 and all(
                httpx.get(f"http://{compose.container_ip(w)}:8001/health", headers={WORKER_SECRET_HEADER: secret},
                          timeout=5).status_code == 200 for w in WORKERS)
        except httpx.HTTPError:
            ok = False
        if ok:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"the topology was not healthy within {READY_TIMEOUT_S:.0f} s; logs:\n{compose.logs()}")
        time.sleep(2)


def complete(base: str, key: str, prompt: str) -> dict:
    r = httpx.post(f"{base}/v1/completions", headers={"authorization": f"Bearer {key}"},
                   json={"model": "base", "prompt": prompt, "max_tokens": 4, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def served_requests(url: str, admin: str, tenant: str) -> float:
    """A gateway's loraplex_requests_total for this tenant's answered (200) requests."""
    r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {admin}"}, timeout=30)
    assert r.status_code == 200, r.text
    return sum(sample.value for family in text_string_to_metric_families(r.text)
               if family.name == "loraplex_requests"
               for sample in family.samples
               if sample.name == "loraplex_requests_total" and sample.labels.get("tenant") == tenant
               and sample.labels.get("status") == "200")


def test_requests_through_the_load_balancer_reach_both_gateways(stack):
    compose, base = stack["compose"], stack["base"]
    gateways = {g: f"http://{compose.container_ip(g)}:8000" for g in GATEWAYS}
    before = {g: served_requests(url, stack["admin"], "acme") for g, url in gateways.items()}
    n = 6
    for i in range(n):
        body = complete(base, stack["key"], f"hello from the load balancer, request {i}")
        assert body["object"] == "text_completion" and body["model"] == "base"
        assert isinstance(body["choices"][0]["text"], str)
        assert 1 <= body["usage"]["completion_tokens"] <= 4
    after = {g: served_requests(url, stack["admin"], "acme") for g, url in gateways.items()}
    delta = {g: after[g] - before[g] for g in GATEWAYS}
    assert sum(delta.values()) == n, delta
    assert all(d >= 1 for d in delta.values()), f"the load balancer did not use both gateways: {delta}"


def test_each_gateway_serves_directly_and_refuses_without_a_key(stack):
    compose = stack["compose"]
    for g in GATEWAYS:
        url = f"http://{compose.container_ip(g)}:8000"
        assert complete(url, stack["key"], f"hello {g}")["choices"][0]["finish_reason"] in ("length", "stop")
        models = httpx.get(f"{url}/v1/models", headers={"authorization": f"Bearer {stack['key']}"}, timeout=30)
        assert models.status_code == 200 and "base" in [m["id"] for m in models.json()["data"]]
    refused = httpx.post(f"{stack['base']}/v1/completions", json={"model": "base", "prompt": "hi"}, timeout=30)
    assert refused.status_code == 401
    assert set(refused.json()["error"]) == {"message", "type", "param", "code"}


def test_both_workers_registered_and_serve(stack):
    """Both CPU workers heartbeat into Redis under their service names, and each answers a request sent to it
    through the gateways (round robin over the two)."""
    compose = stack["compose"]
    members = compose("exec", "-T", "redis", "redis-cli", "smembers", "loraplex:workers:members").split()
    assert sorted(members) == ["http://worker-1-cpu:8001", "http://worker-2-cpu:8001"]
    secret = compose.env["LORAPLEX_WORKER_SECRET"]
    workers = {w: f"http://{compose.container_ip(w)}:8001" for w in WORKERS}

    def prompt_tokens(url: str) -> float:
        r = httpx.get(f"{url}/metrics", headers={"authorization": f"Bearer {secret}"}, timeout=30)
        assert r.status_code == 200
        return sum(s.value for f in text_string_to_metric_families(r.text) for s in f.samples
                   if s.name == "loraplex_worker_prefix_cache_queries_total")

    before = {w: prompt_tokens(url) for w, url in workers.items()}
    long_prompt = "the model serves many tenants with their own adapters and a shared base " * 4  # whole KV blocks
    for i in range(4):
        complete(stack["base"], stack["key"], f"{long_prompt}{i}")
    grew = [w for w, url in workers.items() if prompt_tokens(url) > before[w]]
    assert grew == WORKERS, f"requests reached only {grew}"


def test_down_removes_containers_and_volumes(stack):
    compose = stack["compose"]
    compose("down", "-v")
    assert compose("ps", "-q").strip() == ""
    volumes = subprocess.run(["docker", "volume", "ls", "-q", "--filter", f"name={compose.project}_"],
                             env=compose.env, capture_output=True, text=True, check=True).stdout.split()
    assert volumes == []
