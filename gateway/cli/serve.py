"""`loraplex serve`: the gateway plus one supervised local worker (or external workers).

NOTE: the gateway process never imports torch: the demo model is built by a child process
(`python -m demo.checkpoint`), and the local worker is the worker's own command (worker/cli.py).
"""

from __future__ import annotations

import argparse
import logging
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from gateway.cli.errors import CommandError

DEMO_MODEL_NAME = "loraplex-demo"
DEMO_TENANT = "demo"


def ensure_demo_model(data_dir: Path) -> Path:
    """<data_dir>/demo-model (demo.checkpoint.DEMO_SPEC), built once (atomically: a half-written model is
    never picked up) by `python -m demo.checkpoint` in a child process, which loads torch so this one does not."""
    target = data_dir / "demo-model"
    if (target / "config.json").is_file() and any(target.glob("*.safetensors")):
        return target
    print(f"building the demo model in {target} ...", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-model-", dir=data_dir))
    try:
        built = subprocess.run([sys.executable, "-P", "-m", "demo.checkpoint", str(tmp)], check=False)
        if built.returncode != 0:
            raise CommandError(f"building the demo model failed (exit code {built.returncode})")
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
    """The local worker's command line (worker/cli.py flags; its secret goes in the environment)."""
    from gateway.workers.supervisor import worker_argv

    return worker_argv([
        "--model", str(model), "--served-model-name", served_name,
        "--host", "127.0.0.1", "--port", str(port), "--device", args.device,
        "--dtype", args.dtype, "--kv-cache-dtype", args.kv_cache_dtype, "--kv-cache-memory-gb", str(args.kv_cache_memory_gb),
        "--max-num-seqs", str(args.max_num_seqs), "--max-loras", str(args.max_loras),
        "--max-lora-rank", str(args.max_lora_rank),
        "--quantization", args.quantization, "--decode-graphs", args.decode_graphs,
        *(["--threads", str(args.threads)] if args.threads else []),
        *(["--quantization-group-size", str(args.quantization_group_size)] if args.quantization_group_size else []),
        *(["--quantize-lm-head"] if args.quantize_lm_head else []),
        *(["--otlp-endpoint", args.otlp_endpoint] if args.otlp_endpoint else []),
    ])


def run_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from gateway.adapters.registry import AdapterUploadConfig
    from gateway.admission.usage import BatchedUsageReporter
    from gateway.app import build_app
    from gateway.cli.operator import open_cli_store
    from gateway.observability.telemetry import Telemetry, TelemetryConfig
    from gateway.state import GatewayConfig
    from gateway.workers.http_client import HttpEngineClient
    from gateway.workers.supervisor import WorkerLaunch, WorkerSupervisor
    from tokenization.tokenizer import ChatTemplateError, Tokenizer
    from wire.checkpoint import ModelConfig

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for chatty in ("httpx", "httpcore"):  # one INFO line per worker call is a per-request cost
        logging.getLogger(chatty).setLevel(logging.WARNING)
    args.data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    os.chmod(args.data_dir, 0o700)  # NOTE: key hashes, tenants' adapters and usage live here: owner-only
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
    config = GatewayConfig(served_model_name=served_name, adapter_root=args.data_dir / "adapters",
                           tool_call_parser=args.tool_call_parser)
    admission = quota_admission(args)
    uploads = AdapterUploadConfig(ModelConfig.from_pretrained(model), max_lora_rank=args.max_lora_rank)
    try:
        tokenizer = Tokenizer(model, chat_template=args.chat_template,
                              special_tokens_in_content=args.allow_special_tokens_in_content)
    except ChatTemplateError as e:
        raise CommandError(f"--chat-template: {e}") from None
    app = build_app(config, store, client, tokenizer, admission=admission, resources=resources,
                    adapter_uploads=uploads, telemetry=telemetry, usage=BatchedUsageReporter(store))
    port = args.port
    print(f"loraplex gateway on http://{args.host}:{port}/v1 serving '{served_name}'", flush=True)
    try:
        uvicorn.run(app, host=args.host, port=port, log_level="info", timeout_graceful_shutdown=5,
                    access_log=args.access_log)
    finally:
        store.close()
    return 0


def external_worker_client(args: argparse.Namespace, on_decision):
    """(client, resources) for external workers: one `--worker-url` is used directly; several, or
    `--discover-workers` (heartbeats in --redis-url, or dns://HOST:PORT), go through a RoutingEngineClient
    (docs/scaling.md, docs/kubernetes.md). All share the secret in LORAPLEX_WORKER_SECRET."""
    from gateway.workers.heartbeat import check_worker_url
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
    if args.discover_workers == "redis" and not args.redis_url:
        raise CommandError("--discover-workers needs --redis-url (the workers heartbeat there)")
    try:
        directory = worker_directory(args)
    except ValueError as e:
        raise CommandError(str(e)) from None
    try:
        registry = WorkerRegistry(lambda url: HttpEngineClient(url, secret), urls=urls, directory=directory)
    except ValueError as e:
        raise CommandError(str(e)) from None
    router = RoutingEngineClient(registry, RoutingConfig(strategy=args.routing), on_decision=on_decision)
    return router, router.running


def worker_directory(args: argparse.Namespace):
    """Where `--discover-workers` finds workers: Redis heartbeats, a DNS name (dns://HOST:PORT), or None."""
    from gateway.workers.dns_discovery import DnsDiscoveryConfig, DnsWorkerDirectory
    from gateway.workers.heartbeat import RedisWorkerDirectory

    if not args.discover_workers:
        return None
    if args.discover_workers == "redis":
        return RedisWorkerDirectory(args.redis_url)
    return DnsWorkerDirectory(DnsDiscoveryConfig.from_url(args.discover_workers,
                                                          interval_s=args.discovery_interval))


def quota_admission(args: argparse.Namespace):
    """The admission (quota gate, then the fair queue): Redis-backed with --redis-url, else in memory (budget
    ledger in the data dir). The gateway tests build theirs with the same `build_admission`."""
    from gateway.admission.settings import QuotaSettings, build_admission, build_quota_backend

    try:
        workers = max(1, len(getattr(args, "worker_url", None) or []))  # configured; discovered ones: set it
        settings = QuotaSettings(queue_capacity=args.queue_capacity or args.max_num_seqs * workers,
                                 fail_mode=args.quota_fail_mode, lease_ttl_s=args.quota_lease_ttl,
                                 queue_timeout_s=args.queue_timeout)
    except ValueError as e:
        raise CommandError(str(e)) from None
    return build_admission(settings, build_quota_backend(settings, redis_url=args.redis_url, data_dir=args.data_dir))
