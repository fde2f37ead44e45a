"""`loraplex serve` (gateway + one supervised local worker) and `loraplex worker`."""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import socket
import sys
import tempfile
from pathlib import Path

from gateway.cli.main import DEFAULT_GATEWAY_PORT, DEFAULT_WORKER_PORT, CommandError

DEMO_MODEL_NAME = "loraplex-demo"
DEMO_TENANT = "demo"


def demo_model_spec():
    """Small but not trivial: 4 layers, GQA 8/4 heads, hidden 256, llama3 rope (about 2.4 M parameters)."""
    from demo.checkpoint import FAMILIES, TinyModelSpec

    llama = FAMILIES["llama"]
    return TinyModelSpec(**{**llama.__dict__, "hidden_size": 256, "intermediate_size": 704,
                            "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4})


def ensure_demo_model(data_dir: Path) -> Path:
    """<data_dir>/demo-model, built once (atomically: a half-written model is never picked up)."""
    target = data_dir / "demo-model"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    from demo.checkpoint import make_checkpoint

    print(f"building the demo model in {target} ...", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=data_dir))
    try:
        make_checkpoint(tmp, demo_model_spec())
        if target.exists():
            shutil.rmtree(target)
        os.rename(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def ensure_demo_tenant(store) -> None:
    """Create the demo tenant and print its key once; later runs only say how to make another key."""
    if store.get_tenant_by_name(DEMO_TENANT) is not None:
        print(f"demo tenant '{DEMO_TENANT}' exists; make a new key with: loraplex keys create --tenant {DEMO_TENANT}",
              flush=True)
        return
    tenant = store.create_tenant(DEMO_TENANT)
    plaintext, key = store.create_api_key(tenant.id, name="demo")
    store.append_audit("cli", "key.create", key.id, after={"tenant": tenant.id, "scopes": ["tenant"]})
    print(f"created demo tenant '{DEMO_TENANT}' with API key (shown once, store it now):", flush=True)
    print(plaintext, flush=True)


def free_loopback_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_command(args: argparse.Namespace, model: Path, served_name: str, port: int) -> list[str]:
    return [
        sys.executable, "-m", "gateway.cli.main", "worker", "--model", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(args.data_dir), "--device", args.device,
        "--dtype", args.dtype, "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
        "--max-num-seqs", str(args.max_num_seqs), "--max-loras", str(args.max_loras),
        "--max-lora-rank", str(args.max_lora_rank),
        *(["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []),
    ]


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from engine.config import ModelConfig
    from gateway.adapters.registry import AdapterUploadConfig
    from gateway.admission.usage import BatchedUsageReporter
    from gateway.app import build_app
    from gateway.cli.operator import open_cli_store
    from gateway.observability.telemetry import Telemetry, TelemetryConfig
    from gateway.state import GatewayConfig
    from gateway.workers.http_client import HttpEngineClient
    from gateway.workers.supervisor import WorkerLaunch, WorkerSupervisor
    from tokenization.tokenizer import Tokenizer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # one INFO line per worker call is a per-request cost
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args.data_dir.mkdir(parents=True, exist_ok=True)
    store = open_cli_store(args)
    if args.model:
        model = Path(args.model)
        if not (model / "config.json").is_file():
            raise CommandError(f"--model {model} is not a model directory (config.json is missing)")
    else:
        model = ensure_demo_model(args.data_dir)
        ensure_demo_tenant(store)
    served_name = args.served_model_name or (model.name if args.model else DEMO_MODEL_NAME)
    telemetry = Telemetry(TelemetryConfig(otlp_endpoint=args.otlp_endpoint))
    if args.worker_url or args.discover_workers:  # external workers: nothing to supervise
        client, resources = external_worker_client(args, telemetry.metrics.record_routing_decision)
    else:
        secret = secrets.token_urlsafe(32)
        worker_port = args.worker_port or free_loopback_port()
        client = HttpEngineClient(f"http://127.0.0.1:{worker_port}", secret)
        supervisor = WorkerSupervisor(WorkerLaunch(
            command=worker_command(args, model, served_name, worker_port), health_client=client, secret=secret,
            pid_file=args.data_dir / "worker.pid",
        ))
        resources = supervisor.running
    config = GatewayConfig(served_model_name=served_name, adapter_root=args.data_dir / "adapters")
    admission = quota_admission(args)
    uploads = AdapterUploadConfig(ModelConfig.from_pretrained(model), max_lora_rank=args.max_lora_rank)
    app = build_app(config, store, client, Tokenizer(model), admission=admission, resources=resources,
                    adapter_uploads=uploads, telemetry=telemetry, usage=BatchedUsageReporter(store))
    port = args.port or DEFAULT_GATEWAY_PORT
    print(f"loraplex gateway on http://{args.host}:{port}/v1 serving '{served_name}'", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=port, log_level="info", timeout_graceful_shutdown=5,
                    access_log=args.access_log)
    finally:
        store.close()
    return 0


def external_worker_client(args: argparse.Namespace, on_decision):
    """(client, resources) for external workers: one `--worker-url` is used directly; several, or
    `--discover-workers` (heartbeats in --redis-url), go through a RoutingEngineClient (docs/scaling.md).
    All share the secret in LORAPLEX_WORKER_SECRET."""
    from gateway.workers.heartbeat import RedisWorkerDirectory, check_worker_url
    from gateway.workers.http_client import HttpEngineClient
    from gateway.workers.registry import WorkerRegistry
    from gateway.workers.router import RoutingEngineClient
    from gateway.workers.routing_policy import RoutingConfig
    from gateway.workers.supervisor import SECRET_ENV

    urls = args.worker_url or []
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise CommandError(f"external workers need their shared secret in {SECRET_ENV}")
    try:
        urls = [check_worker_url(url, "--worker-url") for url in urls]
    except ValueError as e:
        raise CommandError(str(e)) from None
    if len(urls) == 1 and not args.discover_workers:
        return HttpEngineClient(urls[0], secret), None
    if args.discover_workers and not args.redis_url:
        raise CommandError("--discover-workers needs --redis-url (the workers heartbeat there)")
    directory = RedisWorkerDirectory(args.redis_url) if args.discover_workers else None
    try:
        registry = WorkerRegistry(lambda url: HttpEngineClient(url, secret), urls=urls, directory=directory)
    except ValueError as e:
        raise CommandError(str(e)) from None
    router = RoutingEngineClient(registry, RoutingConfig(strategy=args.routing), on_decision=on_decision)
    return router, router.running


def quota_admission(args: argparse.Namespace):
    """Quotas and the fair queue: Redis-backed with --redis-url, else in memory (ledger in the data dir)."""
    from gateway.admission.settings import QuotaSettings, build_quota_admission

    try:
        workers = max(1, len(getattr(args, "worker_url", None) or []))  # configured; discovered ones: set it
        settings = QuotaSettings(queue_capacity=args.queue_capacity or args.max_num_seqs * workers,
                                 fail_mode=args.quota_fail_mode, lease_ttl_s=args.quota_lease_ttl,
                                 queue_timeout_s=args.queue_timeout)
    except ValueError as e:
        raise CommandError(str(e)) from None
    return build_quota_admission(settings, redis_url=args.redis_url, data_dir=args.data_dir)


def run_worker_command(args: argparse.Namespace) -> int:
    from engine.async_llm import AsyncLLM
    from engine.config import EngineConfig
    from gateway.workers.supervisor import SECRET_ENV
    from worker.server import run_worker

    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise CommandError(f"set the shared secret in {SECRET_ENV} (the gateway sends it with every call)")
    if not args.model:
        raise CommandError("loraplex worker needs --model (or LORAPLEX_MODEL)")
    heartbeat = registration_heartbeat(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    config = EngineConfig(model=str(args.model), device=args.device, dtype=args.dtype,
                          kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
                          max_loras=args.max_loras, max_lora_rank=args.max_lora_rank)
    llm = AsyncLLM.from_config(config)
    served_name = args.served_model_name or Path(args.model).name
    from gateway.observability.tracing import WORKER_SERVICE_NAME, build_tracer_provider

    run_worker(llm, served_name, secret, host=args.host, port=args.port or DEFAULT_WORKER_PORT,
               tracer_provider=build_tracer_provider(WORKER_SERVICE_NAME, args.otlp_endpoint),
               background=(lambda service: heartbeat.run(service.state)) if heartbeat else None)
    return 0


def registration_heartbeat(args: argparse.Namespace):
    """The worker's Redis heartbeat (`--register-redis-url` with `--advertise-url`), or None."""
    from gateway.workers.heartbeat import HeartbeatConfig, WorkerHeartbeat

    if not args.register_redis_url:
        if args.advertise_url:
            raise CommandError("--advertise-url only matters with --register-redis-url")
        return None
    if not args.advertise_url:
        raise CommandError("--register-redis-url needs --advertise-url (how gateways reach this worker)")
    try:
        return WorkerHeartbeat(HeartbeatConfig(redis_url=args.register_redis_url, advertise_url=args.advertise_url))
    except ValueError as e:
        raise CommandError(str(e)) from None
