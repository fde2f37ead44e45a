"""Validating rendered objects offline: built-in kinds with kubernetes-validate at pinned Kubernetes versions,
custom resources against the CRD schemas in schemas/ (closed: a misspelt field fails)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

# The oldest Kubernetes these manifests support (preStop sleep, StatefulSet PVC retention, grpc probes) and
# the newest one kubernetes-validate knows, pinned.
KUBERNETES_VERSIONS = ("1.32.0", "1.37.0")
SCHEMAS = Path(__file__).parent / "schemas"
CUSTOM_KINDS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepools.inference.networking.k8s.io.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproutes.gateway.networking.k8s.io.yaml",
    ("monitoring.coreos.com/v1", "ServiceMonitor"): "servicemonitors.monitoring.coreos.com.yaml",
}


def crd_schema(filename: str) -> dict[str, Any]:
    crd = yaml.safe_load((SCHEMAS / filename).read_text())
    [version] = crd["spec"]["versions"]
    return closed(version["schema"]["openAPIV3Schema"])


def closed(schema: dict[str, Any]) -> dict[str, Any]:
    """An openAPIV3Schema as a JSON Schema in which objects with listed properties allow no others (what
    `kubectl apply --validate=strict` does with a CRD's structural schema)."""
    schema = {k: v for k, v in schema.items() if not k.startswith("x-kubernetes-")} | (
        {} if not schema.get("x-kubernetes-preserve-unknown-fields") else {"additionalProperties": True})
    if "properties" in schema:
        schema["properties"] = {k: closed(v) for k, v in schema["properties"].items()}
        schema.setdefault("additionalProperties", False)
    if isinstance(schema.get("additionalProperties"), dict):
        schema["additionalProperties"] = closed(schema["additionalProperties"])
    if "items" in schema:
        schema["items"] = closed(schema["items"])
    return schema


def validate(obj: dict[str, Any]) -> None:
    """Raises kubernetes_validate.ValidationError or jsonschema.ValidationError."""
    key = (obj["apiVersion"], obj["kind"])
    if key in CUSTOM_KINDS:
        jsonschema.validate(obj, crd_schema(CUSTOM_KINDS[key]))
        return
    for version in KUBERNETES_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)
