#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests offline.

Every document of every file (multi-document YAML, e.g. `helm template` output, or
`-` for stdin) is checked against Kubernetes' own JSON schemas, strict mode (unknown
fields are errors), for each Kubernetes version asked for, with the pinned
`kubernetes-validate` package: no cluster, no network. Custom resources that
Kubernetes has no schema for (the Prometheus Operator's ServiceMonitor and
PrometheusRule) are checked against the subset schemas in deploy/schemas/ instead. YAML with duplicate keys is
rejected (PyYAML would silently keep the last one), and so are two objects with the
same kind, namespace and name.

    python deploy/validate_manifests.py rendered.yaml
    helm template x helm/ec-cache | python deploy/validate_manifests.py -k 1.25.0 -k 1.37.0 -

Exit status: 0 when every document is valid, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

DEFAULT_VERSIONS = ("1.25.0", "1.37.0")
SCHEMAS = Path(__file__).resolve().parent / "schemas"
CUSTOM_SCHEMAS = {
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SCHEMAS / "servicemonitor-v1-subset.json",
    ("monitoring.coreos.com/v1", "PrometheusRule"): SCHEMAS / "prometheusrule-v1-subset.json",
}


class UniqueKeyLoader(yaml.SafeLoader):  # type: ignore[misc]
    """SafeLoader that refuses a mapping with the same key twice."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        mapping: dict[Any, Any] = super().construct_mapping(node, deep=deep)
        return mapping


def documents(text: str) -> Iterator[dict[str, Any]]:
    for doc in yaml.load_all(text, Loader=UniqueKeyLoader):
        if doc is None:
            continue
        if not isinstance(doc, dict):
            raise ValueError(f"a document is not a mapping: {doc!r:.80}")
        yield doc


def describe(doc: dict[str, Any]) -> str:
    meta = doc.get("metadata") or {}
    return f"{doc.get('kind')}/{meta.get('name')}"


def validate_doc(doc: dict[str, Any], versions: list[str]) -> list[str]:
    errors: list[str] = []
    key = (doc.get("apiVersion"), doc.get("kind"))
    if key in CUSTOM_SCHEMAS:
        schema = json.loads(CUSTOM_SCHEMAS[key].read_text())
        validator = jsonschema.Draft7Validator(schema)
        for err in sorted(validator.iter_errors(doc), key=lambda e: list(e.path)):
            path = ".".join(str(p) for p in err.path) or "<root>"
            errors.append(f"{describe(doc)}: {path}: {err.message} (subset schema)")
        return errors
    for version in versions:
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as err:
            path = ".".join(str(p) for p in err.path) or "<root>"
            errors.append(f"{describe(doc)}: k8s {version}: {path}: {err.message}")
        except kubernetes_validate.SchemaNotFoundError as err:
            errors.append(f"{describe(doc)}: k8s {version}: no schema: {err}")
    meta = doc.get("metadata") or {}
    if not meta.get("name"):
        errors.append(f"{describe(doc)}: metadata.name is missing")
    return errors


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", help="multi-document YAML files, - for stdin")
    parser.add_argument(
        "-k",
        "--kube-version",
        action="append",
        dest="versions",
        help=f"Kubernetes version to validate against (repeatable; default {DEFAULT_VERSIONS})",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="print failures only")
    args = parser.parse_args(argv)
    versions = args.versions or list(DEFAULT_VERSIONS)

    failures = 0
    total = 0
    for name in args.files:
        text = sys.stdin.read() if name == "-" else Path(name).read_text()
        seen: set[tuple[Any, Any, Any]] = set()
        try:
            docs = list(documents(text))
        except (yaml.YAMLError, ValueError) as err:
            print(f"FAIL {name}: not valid YAML: {err}")
            failures += 1
            continue
        if not docs:
            print(f"FAIL {name}: no Kubernetes objects")
            failures += 1
            continue
        for doc in docs:
            total += 1
            meta = doc.get("metadata") or {}
            ident = (doc.get("kind"), meta.get("namespace"), meta.get("name"))
            errors = validate_doc(doc, versions)
            if ident in seen:
                errors.append(f"{describe(doc)}: rendered twice")
            seen.add(ident)
            if errors:
                failures += 1
                for line in errors:
                    print(f"FAIL {name}: {line}")
            elif not args.quiet:
                print(f"ok   {name}: {describe(doc)}")
    print(f"{total} objects, {failures} invalid (Kubernetes {', '.join(versions)})")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
