"""What the Kubernetes manifests ask of loraplex is what the CLI accepts, and their parts agree.

Every loraplex container's args (the image's entrypoint is `loraplex`) are parsed by the CLI's own parser
with the environment the kubelet would give the container (ConfigMaps, Secrets, fieldRefs, `$(VAR)`
expanded). Then: the port the CLI listens on is the containerPort that every probe and Service targets;
Service, PDB, ServiceMonitor and InferencePool selectors match the pods they mean; the NetworkPolicies select
the worker (and Redis) pods and admit the gateway pods; the gateways' DNS name is the workers' headless
Service; adapters are read where gateways write them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from urllib.parse import urlsplit

import pytest

from tests.cli_env import RecordingEnv
from tests.deploy.manifests import (
    OVERLAYS,
    Obj,
    argv,
    container,
    container_port,
    containers,
    find,
    flag,
    one,
    pod_labels,
    probes,
    render,
    selects,
    workloads,
)

LORAPLEX_IMAGE = "loraplex"


def cli(args: list[str], env: Mapping[str, str]):
    """What the container's `loraplex ARGS` parses to, by the parser that parses it there: the gateway's
    for `serve`, the worker's own for `worker` (the entrypoint hands it over). SystemExit on a bad flag.
    Imported at test time: the CLI is what is under test."""
    from gateway.cli.main import WORKER_COMMAND, build_parser
    from worker import cli as worker_cli

    if args[:1] == [WORKER_COMMAND]:
        parsed_args = worker_cli.build_parser(env).parse_args(args[1:])
        parsed_args.command = WORKER_COMMAND
        return parsed_args
    return build_parser(env).parse_args(args)


def env_names_read(command: str) -> set[str]:
    """The LORAPLEX_* variables the parser of `loraplex COMMAND` reads, and the worker secret."""
    from gateway.cli.main import WORKER_COMMAND, build_parser
    from worker import cli as worker_cli

    recorder = RecordingEnv({})
    (worker_cli.build_parser if command == WORKER_COMMAND else build_parser)(recorder)
    return recorder.asked | {worker_cli.SECRET_ENV}


def loraplex_containers(objs: list[Obj]) -> list[tuple[Obj, Obj]]:
    return [(w, c) for w in workloads(objs) for c in containers(w) if c["image"].split(":")[0] == LORAPLEX_IMAGE]


def pod_name(workload: Obj) -> str:
    suffix = "-0" if workload["kind"] == "StatefulSet" else "-7d9f8c6b5-x2x4q"
    return workload["metadata"]["name"] + suffix


def parsed(objs: list[Obj], kind: str, name: str, container_name: str):
    workload, c = container(objs, kind, name, container_name)
    args, env = argv(objs, workload, c, pod_name(workload))
    return workload, c, cli(args, env), env


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def test_every_loraplex_container_command_is_accepted_by_the_cli(overlay):
    objs = render(overlay)
    seen = set()
    for workload, c in loraplex_containers(objs):
        args, env = argv(objs, workload, c, pod_name(workload))
        assert "command" not in c, "keep the image's `loraplex` entrypoint"
        parsed_args = cli(args, env)  # SystemExit on an unknown flag or a bad value
        name = workload["metadata"]["name"]
        seen.add(parsed_args.command)
        assert parsed_args.host == "0.0.0.0" and parsed_args.model == "/models/base", name
        if parsed_args.command == "serve":
            assert str(parsed_args.data_dir) == "/data", name
        unread = {k for k in env if k.startswith("LORAPLEX_")} - env_names_read(parsed_args.command)
        assert not unread, f"{name}: `loraplex {parsed_args.command}` reads no {sorted(unread)}"
    assert seen == {"serve", "worker"}


def test_the_cli_port_is_the_container_port_every_probe_and_service_targets(overlay):
    objs = render(overlay)
    services = find(objs, "Service")
    for workload, c in loraplex_containers(objs):
        args, env = argv(objs, workload, c, pod_name(workload))
        port = cli(args, env).port
        assert container_port(c, "http") == port, workload["metadata"]["name"]
        for kind, probe in probes(c):
            if "exec" in probe:
                script = probe["exec"]["command"][-1]
                compile(script, f"{workload['metadata']['name']} {kind}", "exec")  # the probe is valid Python
                assert {int(p) for p in re.findall(r"127\.0\.0\.1:(\d+)", script)} == {port}, kind
            else:
                handler = probe.get("httpGet") or probe.get("tcpSocket") or probe["grpc"]
                assert container_port(c, handler["port"]) == port, kind
        serving = [s for s in services if selects(s["spec"]["selector"], pod_labels(workload))]
        assert serving, f"no Service selects {workload['metadata']['name']}"
        for service in serving:
            for p in service["spec"]["ports"]:
                assert container_port(c, p["targetPort"]) == port, service["metadata"]["name"]


def test_selectors_match_their_pods_and_nothing_else(overlay):
    objs = render(overlay)
    for workload in workloads(objs):
        labels = pod_labels(workload)
        assert selects(workload["spec"]["selector"], labels), workload["metadata"]["name"]
        others = [w for w in workloads(objs) if w is not workload]
        assert not any(selects(workload["spec"]["selector"], pod_labels(o)) for o in others), "overlapping selectors"
    for kind in ("Service", "PodDisruptionBudget", "NetworkPolicy"):
        for obj in find(objs, kind):
            selector = obj["spec"]["selector"] if kind == "Service" else obj["spec"].get(
                "selector", obj["spec"].get("podSelector"))
            matched = [w["metadata"]["name"] for w in workloads(objs) if selects(selector, pod_labels(w))]
            assert len(matched) == 1, f"{kind} {obj['metadata']['name']} selects {matched}"
    hpa = one(objs, "HorizontalPodAutoscaler")
    assert one(objs, hpa["spec"]["scaleTargetRef"]["kind"], hpa["spec"]["scaleTargetRef"]["name"])
    gateway = one(objs, "Deployment", "loraplex-gateway")
    assert "replicas" not in gateway["spec"], "the HorizontalPodAutoscaler owns the gateway replica count"
    assert hpa["spec"]["minReplicas"] >= 1
    monitor = one(objs, "ServiceMonitor")
    [monitored] = [s for s in find(objs, "Service") if selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
    assert monitored["metadata"]["name"] == "loraplex-gateway"
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= {p["name"] for p in monitored["spec"]["ports"]}
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


def test_the_network_policies_admit_only_gateways_to_workers_and_redis(overlay):
    objs = render(overlay)
    gateway = pod_labels(one(objs, "Deployment", "loraplex-gateway"))
    for policy_name, target, port_name in (("loraplex-workers", "loraplex-worker", "http"),
                                           ("loraplex-redis", "loraplex-redis", "redis")):
        policy = one(objs, "NetworkPolicy", policy_name)
        workload = one(objs, "StatefulSet", target)
        assert selects(policy["spec"]["podSelector"], pod_labels(workload))
        assert policy["spec"]["policyTypes"] == ["Ingress"]
        port = container_port(containers(workload)[0], port_name)
        peers = [peer for rule in policy["spec"]["ingress"] for peer in rule["from"]]
        assert all(p.get("podSelector", {}).get("matchLabels") for p in peers), "a peer that admits everyone"
        assert all(rule["ports"] == [{"protocol": "TCP", "port": port}] for rule in policy["spec"]["ingress"])
        admitted = [p for p in peers if "namespaceSelector" not in p and selects(p["podSelector"], gateway)]
        assert admitted, f"{policy_name} does not admit the gateway pods"
        others = [w for w in workloads(objs) if w["metadata"]["name"] not in ("loraplex-gateway", "loraplex-epp")]
        assert not any(selects(p["podSelector"], pod_labels(w)) for p in peers for w in others), policy_name
    if overlay == "inference-extension":
        epp = pod_labels(one(objs, "Deployment", "loraplex-epp"))
        peers = [peer for rule in one(objs, "NetworkPolicy", "loraplex-workers")["spec"]["ingress"]
                 for peer in rule["from"]]
        assert any(selects(p["podSelector"], epp) for p in peers), "the EPP scrapes the workers' metrics"


def test_gateways_resolve_the_workers_headless_service_in_their_own_namespace():
    for overlay in ("cpu", "gpu"):
        objs = render(overlay)
        gateway, _, args, _ = parsed(objs, "Deployment", "loraplex-gateway", "gateway")
        workers, worker_container, worker_args, _ = parsed(objs, "StatefulSet", "loraplex-worker", "worker")
        source = urlsplit(args.discover_workers)
        assert source.scheme == "dns" and args.worker_url is None, overlay
        service_name, namespace, *rest = source.hostname.split(".")
        service = one(objs, "Service", service_name)
        assert namespace == gateway["metadata"]["namespace"] == service["metadata"]["namespace"] and rest == ["svc"]
        assert service["spec"]["clusterIP"] == "None" and not service["spec"].get("publishNotReadyAddresses")
        assert workers["spec"]["serviceName"] == service_name
        assert selects(service["spec"]["selector"], pod_labels(workers))
        assert source.port == worker_args.port == container_port(worker_container, "http")
        assert worker_args.register_redis_url is None  # DNS, not heartbeats
        # a terminating worker keeps serving until every gateway has re-resolved and polled (1 s)
        prestop = worker_container["lifecycle"]["preStop"]["sleep"]["seconds"]
        assert prestop >= args.discovery_interval + 1 + 1
        assert workers["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] > prestop
        # each gateway may send every worker its full batch at once
        assert args.queue_capacity == workers["spec"]["replicas"] * worker_args.max_num_seqs, overlay


def test_the_gateway_reaches_redis_and_shares_the_worker_secret_with_the_workers(overlay):
    objs = render(overlay)
    _, _, args, gateway_env = parsed(objs, "Deployment", "loraplex-gateway", "gateway")
    _, _, _, worker_env = parsed(objs, "StatefulSet", "loraplex-worker", "worker")
    redis = urlsplit(args.redis_url)
    service = one(objs, "Service", redis.hostname)
    assert redis.scheme == "redis" and redis.port in [p["port"] for p in service["spec"]["ports"]]
    assert args.quota_fail_mode == "closed"
    gateway_secret = one(objs, "Deployment", "loraplex-gateway")["spec"]["template"]["spec"]["containers"][0]
    worker_secret = one(objs, "StatefulSet", "loraplex-worker")["spec"]["template"]["spec"]["containers"][0]

    def secret_ref(c: Obj) -> dict:
        [var] = [v for v in c["env"] if v["name"] == "LORAPLEX_WORKER_SECRET"]
        return var["valueFrom"]["secretKeyRef"]

    assert secret_ref(gateway_secret) == secret_ref(worker_secret)
    assert gateway_env["LORAPLEX_WORKER_SECRET"] == "" == worker_env["LORAPLEX_WORKER_SECRET"], (
        "the committed secret is an empty placeholder, so nothing starts until it is set")


def test_workers_read_adapters_and_the_model_where_gateways_put_them(overlay):
    objs = render(overlay)
    gateway, gateway_container, gateway_args, _ = parsed(objs, "Deployment", "loraplex-gateway", "gateway")
    workers, worker_container, worker_args, _ = parsed(objs, "StatefulSet", "loraplex-worker", "worker")

    def mounts(workload: Obj, c: Obj) -> dict[str, tuple[str, bool]]:
        volumes = {v["name"]: v for v in workload["spec"]["template"]["spec"]["volumes"]}
        out = {}
        for m in c["volumeMounts"]:
            claim = volumes[m["name"]].get("persistentVolumeClaim", {}).get("claimName")
            out[m["mountPath"]] = (claim or m["name"], bool(m.get("readOnly")))
        return out

    at_gateway, at_worker = mounts(gateway, gateway_container), mounts(workers, worker_container)
    adapter_root = f"{gateway_args.data_dir}/adapters"  # GatewayConfig.adapter_root
    assert at_gateway[adapter_root] == ("loraplex-adapters", False) and at_worker[adapter_root] == (
        "loraplex-adapters", True)
    claim = one(objs, "PersistentVolumeClaim", "loraplex-adapters")
    assert claim["spec"]["accessModes"] == ["ReadWriteMany"]
    for args, where in ((gateway_args, at_gateway), (worker_args, at_worker)):
        [models_mount] = [path for path in where if args.model.startswith(path + "/")]
        assert where[models_mount] == ("loraplex-models", True)


@pytest.mark.parametrize("overlay_name,device", [("cpu", "cpu"), ("gpu", "cuda"), ("inference-extension", "cuda")])
def test_workers_get_the_device_their_overlay_names(overlay_name, device):
    objs = render(overlay_name)
    _, c, args, _ = parsed(objs, "StatefulSet", "loraplex-worker", "worker")
    assert args.command == "worker" and args.device == device
    limits = c.get("resources", {}).get("limits", {})
    if device == "cuda":
        assert limits.get("nvidia.com/gpu") == 1 == c["resources"]["requests"]["nvidia.com/gpu"]
    else:
        assert "nvidia.com/gpu" not in limits and args.dtype == "float32"
    assert "memory" in limits and "cpu" in c["resources"]["requests"]


def test_the_worker_probes_present_the_secret_header_the_worker_checks():
    from wire.protocol import WORKER_SECRET_HEADER

    _, c = container(render("gpu"), "StatefulSet", "loraplex-worker", "worker")
    for kind in ("readinessProbe", "livenessProbe"):
        script = c[kind]["exec"]["command"][-1]
        assert f'"{WORKER_SECRET_HEADER}": os.environ["LORAPLEX_WORKER_SECRET"]' in script, kind


def test_behind_an_inference_pool_the_gateway_sends_to_the_gateway_and_the_pool_holds_the_workers():
    objs = render("inference-extension")
    _, _, args, _ = parsed(objs, "Deployment", "loraplex-gateway", "gateway")
    workers, worker_container, worker_args, _ = parsed(objs, "StatefulSet", "loraplex-worker", "worker")
    assert args.discover_workers is None and len(args.worker_url) == 1
    assert urlsplit(args.worker_url[0]).scheme == "http"
    assert args.queue_capacity == workers["spec"]["replicas"] * worker_args.max_num_seqs
    pool = one(objs, "InferencePool", "loraplex-workers")
    assert selects(pool["spec"]["selector"], pod_labels(workers))
    assert [p["number"] for p in pool["spec"]["targetPorts"]] == [container_port(worker_container, "http")]
    ref = pool["spec"]["endpointPickerRef"]
    epp_service = one(objs, "Service", ref["name"])
    epp, epp_container = container(objs, "Deployment", "loraplex-epp", "epp")
    assert selects(epp_service["spec"]["selector"], pod_labels(epp))
    [picker_port] = [p for p in epp_service["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert container_port(epp_container, picker_port["targetPort"]) == int(flag(epp_container["args"], "--grpc-port"))
    for _, probe in probes(epp_container):
        assert probe["grpc"]["port"] == int(flag(epp_container["args"], "--grpc-health-port"))
    assert flag(epp_container["args"], "--pool-name") == pool["metadata"]["name"]
    assert flag(epp_container["args"], "--pool-group") == pool["apiVersion"].split("/")[0]
    # the EPP reads a config file that the mounted ConfigMap holds
    config_path = flag(epp_container["args"], "--config-file")
    [mount] = [m for m in epp_container["volumeMounts"] if config_path.startswith(m["mountPath"] + "/")]
    [volume] = [v for v in epp["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    config_map = [o for o in objs if o["kind"] == "ConfigMap" and o["metadata"]["name"] == volume["configMap"]["name"]]
    assert config_path.removeprefix(mount["mountPath"] + "/") in config_map[0]["data"]
    role = one(objs, "Role", "loraplex-epp")
    granted = {(g, r) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]}
    assert {("", "pods"), ("inference.networking.k8s.io", "inferencepools")} <= granted
    binding = one(objs, "RoleBinding", "loraplex-epp")
    assert binding["subjects"][0]["name"] == epp["spec"]["template"]["spec"]["serviceAccountName"]
    route = one(objs, "HTTPRoute", "loraplex-workers")
    [backend] = [b for rule in route["spec"]["rules"] for b in rule["backendRefs"]]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io", "InferencePool", pool["metadata"]["name"])


def test_the_check_would_catch_a_wrong_flag_or_an_undefined_variable():
    objs = render("gpu")
    workload, c = container(objs, "StatefulSet", "loraplex-worker", "worker")
    args, env = argv(objs, workload, c, pod_name(workload))
    with pytest.raises(SystemExit):
        cli([*args, "--no-such-flag"], env)
    c["args"] = [*c["args"], "--advertise-url", "http://$(POD_NAME).loraplex-workers:8001"]
    with pytest.raises(AssertionError, match="undefined variables"):
        argv(objs, workload, c, pod_name(workload))
