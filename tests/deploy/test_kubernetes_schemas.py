"""Every overlay in deploy/kubernetes/ renders, and every object it renders is valid, offline.

Built-in kinds are validated by kubernetes-validate against pinned Kubernetes versions (strict: an unknown
field fails); the custom resources (InferencePool, HTTPRoute, ServiceMonitor) against the CRD schemas in
schemas/ (closed objects: a misspelt field fails), plus the rules their references state in CEL; the EPP's
EndpointPickerConfig files against schemas/endpointpickerconfig.schema.yaml and llm-d router's plugin types.
"""

from __future__ import annotations

import copy

import jsonschema
import kubernetes_validate
import pytest
import yaml

from tests.deploy.manifests import KUSTOMIZE_ROOT, OVERLAYS, find, one, render, render_path
from tests.deploy.validation import CUSTOM_KINDS, KUBERNETES_VERSIONS, SCHEMAS, crd_schema, validate

# llm-d router (v0.9.0) plugin types the EndpointPickerConfigs here may name, and which of them are parsers.
EPP_PLUGIN_TYPES = {"passthrough-parser", "openai-parser", "metrics-data-source", "core-metrics-extractor",
                    "queue-scorer", "kv-cache-utilization-scorer", "active-request-scorer", "prefix-cache-scorer",
                    "lora-affinity-scorer", "max-score-picker"}
EPP_PARSER_TYPES = {"passthrough-parser", "openai-parser"}
EPP_CONFIGS = sorted((KUSTOMIZE_ROOT / "overlays" / "inference-extension").glob("epp-*.yaml"))


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request) -> str:
    return request.param


def test_every_overlay_renders_the_objects_of_its_topology(overlay):
    objs = render(overlay)
    kinds = {o["kind"] for o in objs}
    assert {"Deployment", "StatefulSet", "Service", "PodDisruptionBudget", "HorizontalPodAutoscaler",
            "PersistentVolumeClaim", "Secret", "ConfigMap", "NetworkPolicy", "ServiceMonitor"} <= kinds
    assert {o["metadata"]["name"] for o in find(objs, "StatefulSet")} == {"loraplex-worker", "loraplex-redis"}
    assert all(o["metadata"].get("namespace") == "loraplex" for o in objs)
    if overlay == "inference-extension":
        assert {"InferencePool", "HTTPRoute"} <= kinds and one(objs, "Deployment", "loraplex-epp")


def test_every_object_is_valid_for_the_pinned_kubernetes_versions(overlay):
    for obj in render(overlay):
        validate(obj)


def test_the_crd_schemas_are_themselves_valid_custom_resource_definitions():
    for filename in CUSTOM_KINDS.values():
        crd = yaml.safe_load((SCHEMAS / filename).read_text())
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(crd, version, strict=True)
        jsonschema.Draft202012Validator.check_schema(crd_schema(filename))


def test_custom_resources_keep_the_rules_their_references_state_in_cel():
    objs = render("inference-extension")
    for pool in find(objs, "InferencePool"):
        numbers = [p["number"] for p in pool["spec"]["targetPorts"]]
        assert len(set(numbers)) == len(numbers), "targetPorts must be unique"
        ref = pool["spec"]["endpointPickerRef"]
        assert ref.get("kind", "Service") != "Service" or "port" in ref, "a Service endpointPickerRef needs a port"
    for route in find(objs, "HTTPRoute"):
        for rule in route["spec"]["rules"]:
            timeouts = rule.get("timeouts", {})
            assert "backendRequest" not in timeouts or "request" in timeouts


@pytest.mark.parametrize("path", EPP_CONFIGS, ids=lambda p: p.name)
def test_endpoint_picker_configs_are_valid_and_refer_to_their_own_plugins(path):
    config = yaml.safe_load(path.read_text())
    jsonschema.validate(config, yaml.safe_load((SCHEMAS / "endpointpickerconfig.schema.yaml").read_text()))
    declared = {p.get("name", p["type"]): p["type"] for p in config["plugins"]}
    assert len(declared) == len(config["plugins"]), "two plugins share a name"
    assert set(declared.values()) <= EPP_PLUGIN_TYPES, set(declared.values()) - EPP_PLUGIN_TYPES
    refs = [p["pluginRef"] for profile in config["schedulingProfiles"] for p in profile["plugins"]]
    parsers = [p["pluginRef"] for p in config.get("requestHandler", {}).get("parsers", [])]
    assert set(refs + parsers) <= set(declared), set(refs + parsers) - set(declared)
    assert all(declared[p] in EPP_PARSER_TYPES for p in parsers) and parsers, "requestHandler.parsers"
    # a parser that claims no path (passthrough) is a fallback: registration stops there, so it goes last
    assert "passthrough-parser" not in [declared[p] for p in parsers[:-1]]
    assert [declared[p] for p in parsers] != ["openai-parser"], "loraplex's wire protocol needs the passthrough"


def test_the_checks_would_catch_a_misspelt_field_or_a_bad_value():
    objs = render("gpu")
    gateway = copy.deepcopy(one(objs, "Deployment", "loraplex-gateway"))
    gateway["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/health"}}
    with pytest.raises(kubernetes_validate.ValidationError):
        validate(gateway)
    monitor = copy.deepcopy(one(objs, "ServiceMonitor"))
    monitor["spec"]["endpoints"][0]["intervall"] = "15s"
    with pytest.raises(jsonschema.ValidationError):
        validate(monitor)
    pool = copy.deepcopy(one(render("inference-extension"), "InferencePool"))
    pool["spec"]["endpointPickerRef"]["failureMode"] = "FailSometimes"
    with pytest.raises(jsonschema.ValidationError):
        validate(pool)


def test_an_overlay_that_does_not_render_fails_loudly(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    with pytest.raises(AssertionError, match="kubectl kustomize"):
        render_path(tmp_path)
