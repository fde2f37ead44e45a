"""The manifests docs/kubernetes.md tells operators to write render and validate, and do what it says."""

from __future__ import annotations

import os
import re

import kubernetes_validate
import yaml

from tests.deploy.manifests import KUSTOMIZE_ROOT, REPO, one, render_path
from tests.deploy.validation import KUBERNETES_VERSIONS, validate

DOC = REPO / "docs" / "kubernetes.md"
OVERLAY_IN_DOC = "../loraplex/deploy/kubernetes/overlays/gpu"


def yaml_blocks() -> list[dict]:
    """The ```yaml blocks of the page (indented inside list items or not), parsed."""
    blocks = re.findall(r"^( *)```yaml\n(.*?)^\1```", DOC.read_text(), flags=re.S | re.M)
    return [yaml.safe_load("\n".join(line[len(indent):] for line in body.splitlines())) for indent, body in blocks]


def test_the_operators_overlay_renders_with_their_image_secret_and_storage_class(tmp_path):
    [kustomization] = [b for b in yaml_blocks() if b.get("kind") == "Kustomization"]
    assert kustomization["resources"] == [OVERLAY_IN_DOC]
    kustomization["resources"] = [os.path.relpath(KUSTOMIZE_ROOT / "overlays" / "gpu", tmp_path)]  # no absolute
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(kustomization))
    (tmp_path / "worker-secret.env").write_text("LORAPLEX_WORKER_SECRET=0123456789abcdef\n")
    objs = render_path(tmp_path)
    for obj in objs:
        validate(obj)
    [secret] = [o for o in objs if o["kind"] == "Secret" and o["metadata"]["name"].startswith("loraplex-worker-secret")]
    assert secret["data"]["LORAPLEX_WORKER_SECRET"] == "MDEyMzQ1Njc4OWFiY2RlZg=="  # base64 of the file's value
    for kind, name in (("Deployment", "loraplex-gateway"), ("StatefulSet", "loraplex-worker")):
        [c] = one(objs, kind, name)["spec"]["template"]["spec"]["containers"]
        assert c["image"] == "registry.example.com/loraplex:0.1.0"
        [ref] = [v["valueFrom"]["secretKeyRef"] for v in c["env"] if v["name"] == "LORAPLEX_WORKER_SECRET"]
        assert ref["name"] == secret["metadata"]["name"]
    for claim in ("loraplex-adapters", "loraplex-models"):
        assert one(objs, "PersistentVolumeClaim", claim)["spec"]["storageClassName"] == "nfs-client"


def test_every_complete_object_on_the_page_is_valid():
    objects = [b for b in yaml_blocks() if b.get("kind") not in (None, "Kustomization")]
    assert [o["kind"] for o in objects] == ["Pod"]
    for obj in objects:
        for version in KUBERNETES_VERSIONS:
            kubernetes_validate.validate(obj, version, strict=True)
    assert objects[0]["spec"]["volumes"][0]["persistentVolumeClaim"]["claimName"] == "loraplex-models"
