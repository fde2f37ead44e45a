"""The `loraplex` command: serve, worker, tenants, keys, adapters.

Flags shared by every subcommand come from one parent parser and each can also be set with a
LORAPLEX_* environment variable (the flag wins): --model (LORAPLEX_MODEL), --served-model-name
(LORAPLEX_SERVED_MODEL_NAME), --host (LORAPLEX_HOST), --port (LORAPLEX_PORT), --data-dir
(LORAPLEX_DATA_DIR), --redis-url (LORAPLEX_REDIS_URL). Operator commands open the same store the
gateway uses: Redis when --redis-url is set, else <data-dir>/store.db.

`loraplex worker ...` is the engine worker's own command (worker/cli.py, also `loraplex-worker` and
`python -m worker`): this process execs it with the same arguments, so the gateway's code never imports
the worker's and the worker's flags are parsed by the worker's parser.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import NoReturn

from gateway.cli.adapters import add_adapters_parser
from gateway.cli.errors import CommandError
from wire.engine_options import add_engine_options

DEFAULT_DATA_DIR = Path.home() / ".loraplex"
DEFAULT_GATEWAY_PORT = 8000
WORKER_COMMAND = "worker"


def common_parser(env: Mapping[str, str]) -> argparse.ArgumentParser:
    """The flags every subcommand shares (defaults from the environment)."""
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("shared options (also LORAPLEX_* environment variables)")
    group.add_argument("--model", default=env.get("LORAPLEX_MODEL"),
                       help="HF-format model directory (serve without it builds a small demo model)")
    group.add_argument("--served-model-name", default=env.get("LORAPLEX_SERVED_MODEL_NAME"),
                       help="the base model's name in the API (default: the model directory's name)")
    group.add_argument("--host", default=env.get("LORAPLEX_HOST", "127.0.0.1"), help="address to listen on")
    group.add_argument("--port", type=int, default=_int_env(env, "LORAPLEX_PORT"),
                       help=f"port to listen on (serve: {DEFAULT_GATEWAY_PORT})")
    group.add_argument("--data-dir", type=Path, default=Path(env.get("LORAPLEX_DATA_DIR", DEFAULT_DATA_DIR)),
                       help="store, adapters and the demo model live here")
    group.add_argument("--redis-url", default=env.get("LORAPLEX_REDIS_URL"),
                       help="use Redis (shared by gateway replicas) instead of <data-dir>/store.db")
    group.add_argument("--otlp-endpoint", default=env.get("LORAPLEX_OTLP_ENDPOINT") or None,
                       help="export OpenTelemetry traces over OTLP/HTTP to this collector (e.g. http://host:4318)")
    return common


def engine_options(parser: argparse.ArgumentParser) -> None:
    """The local worker's engine (`serve` passes them on to `loraplex worker`, which has the same flags)."""
    group = parser.add_argument_group("engine options (of the local worker)")
    add_engine_options(group)


def chat_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Chat prompts and tool calls of `serve` (docs/gateway.md, "Chat templates" and "Tools")."""
    from tokenization.tool_formats import FORMATS  # stdlib only: cheap to parse with

    group = parser.add_argument_group("chat options")
    group.add_argument("--chat-template", type=Path, metavar="FILE", default=env.get("LORAPLEX_CHAT_TEMPLATE") or None,
                       help="a Jinja chat template that replaces the checkpoint's (also LORAPLEX_CHAT_TEMPLATE)")
    group.add_argument("--tool-call-parser", choices=sorted(FORMATS), metavar="NAME",
                       default=env.get("LORAPLEX_TOOL_CALL_PARSER") or None,
                       help="the tool call format: " + ", ".join(sorted(FORMATS)) + " (default: the one the chat "
                            "template shows; also LORAPLEX_TOOL_CALL_PARSER)")
    group.add_argument("--allow-special-tokens-in-content", action="store_true",
                       default=_bool_env(env, "LORAPLEX_ALLOW_SPECIAL_TOKENS_IN_CONTENT"),
                       help="let message text spell control tokens (<|eot_id|>, ...) that the model reads as "
                            "markup; by default they are tokenized as text (also "
                            "LORAPLEX_ALLOW_SPECIAL_TOKENS_IN_CONTENT=1)")


def quota_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Quotas and the fair queue of `serve` (docs/gateway.md, "Quotas and priorities")."""
    group = parser.add_argument_group("quota and queue options")
    group.add_argument("--quota-fail-mode", choices=("open", "closed"),
                       default=env.get("LORAPLEX_QUOTA_FAIL_MODE", "closed"),
                       help="with --redis-url, while Redis is unreachable: closed answers 503 (default), open "
                            "enforces limits per replica (also LORAPLEX_QUOTA_FAIL_MODE)")
    group.add_argument("--quota-lease-ttl", type=float, default=30.0,
                       help="seconds until a dead gateway's concurrency leases expire (default 30)")
    group.add_argument("--queue-capacity", type=int, default=None,
                       help="requests sent to the worker at once (default: --max-num-seqs)")
    group.add_argument("--queue-timeout", type=float, default=30.0,
                       help="seconds a request may wait in the gateway queue before 503 (default 30)")
    group.add_argument("--worker-url", action="append", default=None,
                       help="use this running worker (secret in LORAPLEX_WORKER_SECRET) instead of starting one; "
                            "repeat it to route across several (docs/scaling.md)")


def routing_options(parser: argparse.ArgumentParser, env: Mapping[str, str]) -> None:
    """Several workers behind one gateway (docs/scaling.md)."""
    group = parser.add_argument_group("routing options (several workers)")
    group.add_argument("--routing", choices=("cache_aware", "round_robin", "least_loaded"),
                       default=env.get("LORAPLEX_ROUTING", "cache_aware"),
                       help="how requests are spread over workers (default cache_aware; also LORAPLEX_ROUTING)")
    group.add_argument("--discover-workers", nargs="?", const="redis", type=_discovery_source, metavar="SOURCE",
                       default=_discovery_env(env, "LORAPLEX_DISCOVER_WORKERS"),
                       help="route to discovered workers: redis (the default when the flag stands alone: workers that "
                            "heartbeat in --redis-url) or dns://HOST:PORT (the addresses of a Kubernetes headless "
                            "Service, e.g. dns://loraplex-workers.NAMESPACE.svc:8001); also LORAPLEX_DISCOVER_WORKERS "
                            "(1/yes/redis or dns://...)")
    group.add_argument("--discovery-interval", type=float,
                       default=_float_env(env, "LORAPLEX_DISCOVERY_INTERVAL", 5.0),
                       help="seconds between two DNS resolutions with --discover-workers dns://... (default 5; also "
                            "LORAPLEX_DISCOVERY_INTERVAL)")


def build_parser(env: Mapping[str, str] | None = None) -> argparse.ArgumentParser:
    env = os.environ if env is None else env
    common = common_parser(env)
    parser = argparse.ArgumentParser(prog="loraplex", description="Multi-tenant multi-LoRA LLM serving.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    serve = sub.add_parser("serve", parents=[common], help="gateway plus one supervised local engine worker")
    engine_options(serve)
    serve.add_argument("--worker-port", type=int, default=None, help="loopback port of the worker (default: free)")
    serve.add_argument("--access-log", action="store_true", default=_bool_env(env, "LORAPLEX_ACCESS_LOG"),
                       help="log one line per HTTP request (off by default: it costs the gateway CPU on every "
                            "request; also LORAPLEX_ACCESS_LOG=1)")
    chat_options(serve, env)
    quota_options(serve, env)
    routing_options(serve, env)
    serve.set_defaults(handler=_run_serve, port=_int_env(env, "LORAPLEX_PORT") or DEFAULT_GATEWAY_PORT)

    # Listed for --help only: main() hands `loraplex worker ...` to the worker's own command unparsed.
    sub.add_parser(WORKER_COMMAND, add_help=False,
                   help="an engine worker as an internal HTTP service (secret in LORAPLEX_WORKER_SECRET); "
                        "its flags: loraplex worker --help")

    tenants = sub.add_parser("tenants", help="create, list and show tenants")
    tsub = tenants.add_subparsers(dest="action", required=True, metavar="ACTION")
    create = tsub.add_parser("create", parents=[common], help="create a tenant")
    create.add_argument("name")
    create.add_argument("--shared", action="store_true", help="its adapters are visible to every tenant")
    create.add_argument("--policy", default=None, help="tenant policy as a JSON object")
    tsub.add_parser("list", parents=[common], help="list tenants")
    show = tsub.add_parser("show", parents=[common], help="a tenant, its keys and today's usage")
    show.add_argument("tenant", help="tenant name or id")
    requests = tsub.add_parser("requests", parents=[common], help="a tenant's latest requests, newest first")
    requests.add_argument("tenant", help="tenant name or id")
    requests.add_argument("--user", default=None, help="only the requests of this end user (the request's `user`)")
    requests.add_argument("--limit", type=int, default=20, help="how many (1-1000, default 20)")
    tenants.set_defaults(handler=_run_tenants)

    keys = sub.add_parser("keys", help="create, list and revoke API keys")
    ksub = keys.add_subparsers(dest="action", required=True, metavar="ACTION")
    kcreate = ksub.add_parser("create", parents=[common],
                              help="create a key; the key alone is printed on the last line")
    target = kcreate.add_mutually_exclusive_group(required=True)
    target.add_argument("--tenant", help="tenant name or id")
    target.add_argument("--admin", action="store_true",
                        help="an operator key (scope admin) of the 'operators' tenant, created if needed")
    kcreate.add_argument("--name", default="", help="a label for the key")
    kcreate.add_argument("--expires-in", default=None, help="lifetime such as 3600, 90m, 12h or 30d")
    klist = ksub.add_parser("list", parents=[common], help="list keys (never their plaintext)")
    klist.add_argument("--tenant", default=None, help="only this tenant's keys")
    krevoke = ksub.add_parser("revoke", parents=[common], help="revoke a key for good")
    krevoke.add_argument("key_id")
    keys.set_defaults(handler=_run_keys)
    add_adapters_parser(sub, env)  # tenants: loraplex adapters upload|list|show|delete
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == [WORKER_COMMAND]:
        exec_worker(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return int(args.handler(args) or 0)
    except KeyboardInterrupt:
        return 130
    except CommandError as e:
        print(f"loraplex: error: {e}", file=sys.stderr)
        return 2


def exec_worker(argv: Sequence[str]) -> NoReturn:
    """Become the worker's command with these flags (same process id, environment and signals: a
    container's PID 1 stays the worker)."""
    from gateway.workers.supervisor import worker_argv

    command = worker_argv(argv)
    os.execv(command[0], command)


# The handlers import their modules when they run, so `loraplex keys ...` does not load the gateway app.
def _run_serve(args: argparse.Namespace) -> int:
    from gateway.cli.serve import run_serve

    return run_serve(args)


def _run_tenants(args: argparse.Namespace) -> int:
    from gateway.cli.operator import run_tenants

    return run_tenants(args)


def _run_keys(args: argparse.Namespace) -> int:
    from gateway.cli.operator import run_keys

    return run_keys(args)


def _bool_env(env: Mapping[str, str], name: str) -> bool:
    value = env.get(name, "").strip().lower()
    if value in ("", "0", "false", "no"):
        return False
    if value in ("1", "true", "yes"):
        return True
    raise SystemExit(f"loraplex: error: {name} must be 1/true/yes or 0/false/no, got {value!r}")


def _int_env(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise SystemExit(f"loraplex: error: {name} must be an integer port, got {value!r}") from None


def _float_env(env: Mapping[str, str], name: str, default: float) -> float:
    value = env.get(name, "").strip()
    if value == "":
        return default
    try:
        return float(value)
    except ValueError:
        raise SystemExit(f"loraplex: error: {name} must be a number of seconds, got {value!r}") from None


def _discovery_source(value: str) -> str:
    """A `--discover-workers` value: "redis", or a dns://HOST:PORT URL (checked here)."""
    if value.strip().lower() == "redis":
        return "redis"
    if value.startswith("dns://"):
        from gateway.workers.dns_discovery import parse_dns_url  # stdlib only: cheap to parse with

        try:
            parse_dns_url(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        return value
    raise argparse.ArgumentTypeError(f"expected redis or dns://HOST:PORT, got {value!r}")


def _discovery_env(env: Mapping[str, str], name: str) -> str | None:
    """LORAPLEX_DISCOVER_WORKERS: off (unset, 0/false/no), Redis (1/true/yes/redis) or dns://HOST:PORT."""
    value = env.get(name, "").strip()
    if value.lower() in ("", "0", "false", "no"):
        return None
    if value.lower() in ("1", "true", "yes"):
        return "redis"
    try:
        return _discovery_source(value)
    except argparse.ArgumentTypeError as e:
        raise SystemExit(f"loraplex: error: {name} must be 1/true/yes/redis, 0/false/no or dns://HOST:PORT: {e}"
                         ) from None


if __name__ == "__main__":
    sys.exit(main())
