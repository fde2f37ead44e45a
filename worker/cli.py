"""`loraplex-worker` (also `python -m worker` and `loraplex worker`): one engine worker as an HTTP service.

The worker serves the protocol of wire/protocol.py to gateways that send the shared secret, which it
reads from LORAPLEX_WORKER_SECRET (never from the command line, where `ps` would show it). Every flag
can also be set with a LORAPLEX_* environment variable (the flag wins): --model (LORAPLEX_MODEL),
--served-model-name (LORAPLEX_SERVED_MODEL_NAME), --host (LORAPLEX_HOST), --port (LORAPLEX_PORT),
--otlp-endpoint (LORAPLEX_OTLP_ENDPOINT), --register-redis-url (LORAPLEX_REGISTER_REDIS_URL),
--advertise-url (LORAPLEX_ADVERTISE_URL), --public-metrics (LORAPLEX_PUBLIC_METRICS=1), --engine-loop
(LORAPLEX_ENGINE_LOOP).

The engine loop runs in a child process of its own by default (engine/core_process.py: the step's Python
never waits on the HTTP side's GIL); `--engine-loop thread` keeps it on a thread of the worker process.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from wire.engine_options import add_engine_options, decode_graphs_value
from worker.registration import HeartbeatConfig, WorkerHeartbeat

SECRET_ENV = "LORAPLEX_WORKER_SECRET"
DEFAULT_PORT = 8001
PROG = "loraplex worker"
ENGINE_LOOPS = ("process", "thread")


class WorkerCommandError(Exception):
    """A problem the operator can fix; printed without a traceback."""


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    parser = argparse.ArgumentParser(
        prog=PROG, description="An engine worker as an internal HTTP service (secret in LORAPLEX_WORKER_SECRET).")
    group = parser.add_argument_group("worker options (also LORAPLEX_* environment variables)")
    group.add_argument("--model", default=env.get("LORAPLEX_MODEL"), help="HF-format model directory")
    group.add_argument("--served-model-name", default=env.get("LORAPLEX_SERVED_MODEL_NAME"),
                       help="the base model's name in the API (default: the model directory's name)")
    group.add_argument("--host", default=env.get("LORAPLEX_HOST", "127.0.0.1"), help="address to listen on")
    group.add_argument("--port", type=int, default=_int_env(env, "LORAPLEX_PORT"),
                       help=f"port to listen on (default {DEFAULT_PORT})")
    group.add_argument("--otlp-endpoint", default=env.get("LORAPLEX_OTLP_ENDPOINT") or None,
                       help="export OpenTelemetry traces over OTLP/HTTP to this collector (e.g. http://host:4318)")
    group.add_argument("--public-metrics", action="store_true",
                       default=env.get("LORAPLEX_PUBLIC_METRICS", "").lower() in ("1", "true", "yes"),
                       help="serve GET /metrics without the worker secret (for an endpoint picker that scrapes "
                            "without credentials; every other route still needs the secret)")
    group.add_argument("--engine-loop", choices=ENGINE_LOOPS, default=env.get("LORAPLEX_ENGINE_LOOP") or "process",
                       help="where the engine loop runs: a child process of its own (default) or a thread of "
                            "the worker process")
    engine = parser.add_argument_group("engine options")
    add_engine_options(engine)
    registration = parser.add_argument_group("registration options (worker discovery through Redis)")
    registration.add_argument("--register-redis-url", default=env.get("LORAPLEX_REGISTER_REDIS_URL") or None,
                              help="heartbeat this worker's URL and state into this Redis")
    registration.add_argument("--advertise-url", default=env.get("LORAPLEX_ADVERTISE_URL") or None,
                              help="the URL gateways use to reach this worker, e.g. http://worker-1:8001")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except KeyboardInterrupt:
        return 130
    except WorkerCommandError as e:
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2


def run(args: argparse.Namespace) -> int:
    """Build the engine and serve it until interrupted."""
    secret = os.environ.get(SECRET_ENV, "")
    if not secret:
        raise WorkerCommandError(f"set the shared secret in {SECRET_ENV} (the gateway sends it with every call)")
    if not args.model:
        raise WorkerCommandError("a worker needs --model (or LORAPLEX_MODEL)")
    heartbeat = registration_heartbeat(args)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s worker %(name)s: %(message)s")
    # NOTE: imported here so that --help and flag errors answer without loading torch.
    from engine.async_llm import AsyncLLM, StreamFront
    from engine.config import EngineConfig, ModelConfig
    from engine.core_process import ProcessAsyncLLM
    from worker.capabilities import WorkerCapabilities
    from worker.server import exit_on_engine_fault, run_worker
    from worker.tracing import build_tracer_provider

    if args.engine_loop not in ENGINE_LOOPS:  # NOTE: argparse checks choices only of a flag given
        raise WorkerCommandError(f"LORAPLEX_ENGINE_LOOP must be one of {', '.join(ENGINE_LOOPS)}")
    try:
        config = EngineConfig(model=str(args.model), device=args.device, dtype=args.dtype,
                              kv_cache_dtype=args.kv_cache_dtype,
                              kv_cache_memory_gb=args.kv_cache_memory_gb, max_num_seqs=args.max_num_seqs,
                              max_loras=args.max_loras, max_lora_rank=args.max_lora_rank,
                              quantization=args.quantization, quantization_group_size=args.quantization_group_size,
                              quantize_lm_head=args.quantize_lm_head,
                              decode_graphs=decode_graphs_value(args.decode_graphs))
        if config.kv_cache_dtype != "auto":  # refuse a cache the compute dtype cannot use before building
            config.kv_cache_torch_dtype(ModelConfig.from_pretrained(config.model))
        tracer_provider = build_tracer_provider(args.otlp_endpoint)
    except ValueError as e:  # CheckpointError too
        raise WorkerCommandError(str(e)) from None
    llm: StreamFront
    if args.engine_loop == "process":
        llm = ProcessAsyncLLM(config, on_fatal=exit_on_engine_fault, threads=args.threads)
    else:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        llm = AsyncLLM.from_config(config, on_fatal=exit_on_engine_fault)
    print(f"{PROG}: compute dtype {config.dtype_reason(llm.model_config)}", file=sys.stderr, flush=True)
    kv_dtype = str(config.kv_cache_torch_dtype(llm.model_config)).removeprefix("torch.")
    print(f"{PROG}: KV cache {kv_dtype}{' (the compute dtype)' if config.kv_cache_dtype == 'auto' else ''}",
          file=sys.stderr, flush=True)
    if config.device == "cpu":
        import torch

        threads = args.threads or torch.get_num_threads()
        print(f"{PROG}: {threads} intra-op CPU threads, engine loop in a {args.engine_loop}", file=sys.stderr,
              flush=True)
    served_name = args.served_model_name or Path(args.model).name
    run_worker(llm, served_name, secret, WorkerCapabilities.of_engine(config), host=args.host,
               port=args.port or DEFAULT_PORT, tracer_provider=tracer_provider,
               background=(lambda service: heartbeat.run(service.state)) if heartbeat else None,
               public_metrics=args.public_metrics)
    return 0


def registration_heartbeat(args: argparse.Namespace) -> WorkerHeartbeat | None:
    """The worker's Redis heartbeat (`--register-redis-url` with `--advertise-url`), or None."""
    if not args.register_redis_url:
        if args.advertise_url:
            raise WorkerCommandError("--advertise-url only matters with --register-redis-url")
        return None
    if not args.advertise_url:
        raise WorkerCommandError("--register-redis-url needs --advertise-url (how gateways reach this worker)")
    try:
        return WorkerHeartbeat(HeartbeatConfig(redis_url=args.register_redis_url, advertise_url=args.advertise_url))
    except ValueError as e:
        raise WorkerCommandError(str(e)) from None


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"{PROG}: error: {name} must be an integer port, got {value!r}") from None
