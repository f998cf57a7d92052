"""The chart's values that are Kubernetes objects passed through to the operator's Deployment (resources,
the security contexts, tolerations, affinity, extra environment): values.schema.json lists their fields,
so a misspelt one fails the install. Without that the key would render into the Deployment and the API
server would drop it with at most a warning: the limit, toleration or security setting the user meant
would silently never apply.

The field lists are Kubernetes' own, compared here with the JSON schemas of the Kubernetes version the
chart's manifests are validated against (kubernetes-validate), so a field Kubernetes adds shows up here.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from helmchart import CHART, helm, one, template_args

KUBERNETES_SCHEMAS = (
    Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema" / "v1.36.0-local-strict"
)
# Each top-level value that is a Kubernetes type, and that type.
KUBERNETES_VALUES = {
    "resources": "ResourceRequirements",
    "podSecurityContext": "PodSecurityContext",
    "containerSecurityContext": "SecurityContext",
    "affinity": "Affinity",
}
# The same for the items of a list value.
KUBERNETES_ITEMS = {"tolerations": "Toleration", "operator.extraEnv": "EnvVar"}


def values_schema() -> dict[str, Any]:
    schema: dict[str, Any] = json.loads((CHART / "values.schema.json").read_text())
    return schema


def kubernetes_type(name: str) -> dict[str, Any]:
    """The JSON schema of the core/v1 type ``name`` (e.g. ``SecurityContext``)."""
    schema: dict[str, Any] = json.loads((KUBERNETES_SCHEMAS / f"{name.lower()}-v1.json").read_text())
    return schema


def resolve(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` with a reference into the chart schema's definitions followed."""
    if "$ref" not in schema:
        return schema
    found: dict[str, Any] = values_schema()["definitions"][schema["$ref"].removeprefix("#/definitions/")]
    return found


def referenced_type(field: dict[str, Any]) -> str | None:
    """The Kubernetes type a field of a Kubernetes schema holds (or holds a list of), if it is one."""
    ref = field.get("$ref") or field.get("items", {}).get("$ref")
    return None if ref is None else str(ref).rsplit(".", 1)[1]


def field_lists(
    ours: dict[str, Any], theirs: dict[str, Any], path: str
) -> list[tuple[str, set[str], set[str]]]:
    """(path, our field names, Kubernetes' field names) for ``ours`` and every object inside it whose
    fields it lists, against the Kubernetes schema ``theirs``."""
    ours = resolve(ours)
    found = [(path, set(ours["properties"]), set(theirs["properties"]))]
    assert ours["additionalProperties"] is False, path
    assert set(ours.get("required", [])) == set(theirs.get("required", [])), path
    for name, field in ours["properties"].items():
        inner = resolve(field)
        inner = (
            resolve(inner["items"]) if "items" in inner and "properties" in resolve(inner["items"]) else inner
        )
        nested = referenced_type(theirs["properties"].get(name, {}))
        if "properties" in inner and nested is not None:
            found += field_lists(inner, kubernetes_type(nested), f"{path}.{name}")
    return found


def chart_value(path: str) -> dict[str, Any]:
    schema = values_schema()
    for key in path.split("."):
        schema = resolve(schema)["properties"][key]
    return schema


@pytest.mark.parametrize("value", [*KUBERNETES_VALUES, *KUBERNETES_ITEMS])
def test_a_kubernetes_value_takes_exactly_the_fields_of_its_kubernetes_type(value: str) -> None:
    schema = chart_value(value)
    if value in KUBERNETES_ITEMS:
        schema, kind = schema["items"], KUBERNETES_ITEMS[value]
    else:
        kind = KUBERNETES_VALUES[value]
    lists = field_lists(schema, kubernetes_type(kind), value)
    for path, ours, theirs in lists:
        assert ours == theirs, (
            f"{path}: missing {sorted(theirs - ours)}, not Kubernetes' {sorted(ours - theirs)}"
        )


@pytest.mark.parametrize(
    ("setting", "where", "key"),
    [
        ("resources.limit.memory=1Gi", "/resources", "limit"),
        (
            "containerSecurityContext.readOnlyRootFileSytem=false",
            "/containerSecurityContext",
            "readOnlyRootFileSytem",
        ),
        ("podSecurityContext.runAsNonroot=false", "/podSecurityContext", "runAsNonroot"),
        ("podSecurityContext.seccompProfile.typ=RuntimeDefault", "/podSecurityContext/seccompProfile", "typ"),
        ("tolerations[0].effects=NoSchedule", "/tolerations/0", "effects"),
        ("affinity.nodeAfinity.x=1", "/affinity", "nodeAfinity"),
        ("operator.extraEnv[0].nme=HTTPS_PROXY", "/operator/extraEnv/0", "nme"),
    ],
)
def test_a_misspelt_field_of_a_kubernetes_value_fails_the_install_naming_it(
    setting: str, where: str, key: str
) -> None:
    result = helm(*template_args(sets=(setting,)), check=False)
    assert result.returncode != 0, "the chart rendered"
    assert f"at '{where}': additional properties '{key}' not allowed" in result.stderr, result.stderr


def test_kubernetes_values_written_correctly_reach_the_deployment(tmp_path: Path) -> None:
    values = {
        "resources": {"requests": {"cpu": "200m", "memory": "256Mi"}, "limits": {"cpu": 2, "memory": "1Gi"}},
        "podSecurityContext": {"fsGroup": 65532, "seccompProfile": {"type": "RuntimeDefault"}},
        "containerSecurityContext": {"capabilities": {"drop": ["ALL"]}, "readOnlyRootFilesystem": True},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "ops", "effect": "NoSchedule"}],
        "affinity": {
            "nodeAffinity": {
                "requiredDuringSchedulingIgnoredDuringExecution": {
                    "nodeSelectorTerms": [
                        {"matchExpressions": [{"key": "pool", "operator": "In", "values": ["ops"]}]}
                    ]
                }
            }
        },
        "operator": {
            "extraEnv": [
                {"name": "HTTPS_PROXY", "value": "http://proxy:3128"},
                {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}},
            ]
        },
    }
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump(values))
    out = helm(*template_args((path,))).stdout
    pod = one([d for d in yaml.safe_load_all(out) if d], "Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert pod["tolerations"] == values["tolerations"] and pod["affinity"] == values["affinity"]
    assert pod["securityContext"]["fsGroup"] == 65532
    assert (
        container["resources"]["limits"]["cpu"] == 2 and container["resources"]["limits"]["memory"] == "1Gi"
    )
    assert {"name": "NODE", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
