"""The CRD and the pydantic models describe the same API: same field names, same enums, same defaults;
and the CRD meets the bar users see in `kubectl explain` and at admission (descriptions, bounds)."""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Annotated, Any, Literal

import annotated_types
import pytest
import yaml
from pydantic import BaseModel, StringConstraints, ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from sftjob import constants as c
from sftjob.job_status import SFTJobStatus
from sftjob.kube_names import (
    LABEL_KEY,
    LABEL_KEY_RULE,
    LABEL_VALUE,
    LABEL_VALUE_RULE,
    POSITIVE_QUANTITY,
    QUANTITY_RULE,
)
from sftjob.spec import SFTJobSpec

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "sftjob.io_sftjobs.yaml"
# Model fields the API does not expose: filled in by the operator, never by users.
INTERNAL = {"spec.model.architecture": {"name", "experts"}}
Schema = dict[str, Any]


@pytest.fixture(scope="module")
def crd() -> Schema:
    return dict(yaml.safe_load(CRD_PATH.read_text()))


@pytest.fixture(scope="module")
def schema(crd: Schema) -> Schema:
    (version,) = crd["spec"]["versions"]
    return dict(version["schema"]["openAPIV3Schema"])


def _strip(annotation: Any) -> Any:
    """The annotation without Optional/Annotated wrappers."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is typing.Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (typing.Union, types.UnionType):
            args = [a for a in typing.get_args(annotation) if a is not type(None)]
            models = [a for a in args if _is_model(_strip(a))]
            annotation = models[0] if models else args[0]
        else:
            return annotation


def _pattern(field: FieldInfo) -> str | None:
    """The regex of a field's StringConstraints (pydantic keeps an Optional field's inside its annotation)."""
    optional = [
        a.__metadata__ for a in typing.get_args(field.annotation) if typing.get_origin(a) is Annotated
    ]
    for meta in [*field.metadata, *(m for metadata in optional for m in metadata)]:
        if isinstance(meta, StringConstraints) and meta.pattern is not None:
            return str(meta.pattern)
    return None


def _bounds(field: FieldInfo) -> Schema:
    """A field's numeric bounds in the CRD's words (minimum, maximum, exclusiveMinimum/Maximum)."""
    optional = [
        a.__metadata__ for a in typing.get_args(field.annotation) if typing.get_origin(a) is Annotated
    ]
    out: Schema = {}
    for meta in [*field.metadata, *(m for metadata in optional for m in metadata)]:
        if isinstance(meta, annotated_types.Ge):
            out["minimum"] = meta.ge
        elif isinstance(meta, annotated_types.Gt):
            out |= {"minimum": meta.gt, "exclusiveMinimum": True}
        elif isinstance(meta, annotated_types.Le):
            out["maximum"] = meta.le
        elif isinstance(meta, annotated_types.Lt):
            out |= {"maximum": meta.lt, "exclusiveMaximum": True}
    return out


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _pairs(model: type[BaseModel], node: Schema, where: str) -> Iterator[tuple[str, type[BaseModel], Schema]]:
    """Every (path, model, schema) pair reachable from ``model`` at ``node``."""
    yield where, model, node
    for name, field in model.model_fields.items():
        alias = field.alias or name
        child = node.get("properties", {}).get(alias)
        annotation = _strip(field.annotation)
        if typing.get_origin(annotation) is list and child is not None:
            annotation, child = _strip(typing.get_args(annotation)[0]), child.get("items", {})
        if _is_model(annotation) and child is not None:
            yield from _pairs(annotation, child, f"{where}.{alias}")


def _walk(node: Schema, where: str) -> Iterator[tuple[str, Schema]]:
    yield where, node
    for name, child in node.get("properties", {}).items():
        yield from _walk(child, f"{where}.{name}")
    if "items" in node:
        yield from _walk(node["items"], f"{where}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from _walk(node["additionalProperties"], f"{where}{{}}")


def test_the_crd_names_the_sftjob_kind_as_the_operator_expects(crd: Schema) -> None:
    names = crd["spec"]["names"]
    assert crd["spec"]["group"] == c.API_GROUP and names["kind"] == c.KIND and names["plural"] == c.PLURAL
    assert names["shortNames"] == ["sft"] and crd["metadata"]["name"] == f"{c.PLURAL}.{c.API_GROUP}"
    (version,) = crd["spec"]["versions"]
    assert version["name"] == c.API_VERSION and version["subresources"] == {"status": {}}


@pytest.mark.parametrize(("model", "part"), [(SFTJobSpec, "spec"), (SFTJobStatus, "status")])
def test_the_crd_and_the_models_have_the_same_field_names(
    schema: Schema, model: type[BaseModel], part: str
) -> None:
    for where, m, node in _pairs(model, schema["properties"][part], part):
        fields = {f.alias or n for n, f in m.model_fields.items()} - INTERNAL.get(where, set())
        assert set(node.get("properties", {})) == fields, where


def test_the_crd_and_the_models_agree_on_enums_and_defaults(schema: Schema) -> None:
    for where, m, node in _pairs(SFTJobSpec, schema["properties"]["spec"], "spec"):
        for name, field in m.model_fields.items():
            prop = node.get("properties", {}).get(field.alias or name)
            if prop is None:
                continue
            literal = _strip(field.annotation)
            if typing.get_origin(literal) is Literal and "enum" in prop:
                assert set(prop["enum"]) == set(typing.get_args(literal)), f"{where}.{name}"
            if (
                "default" in prop
                and field.default is not PydanticUndefined
                and not isinstance(field.default, BaseModel)
            ):
                assert prop["default"] == field.default or prop["default"] == {}, f"{where}.{name}"


def test_the_crd_and_the_models_agree_on_string_patterns(schema: Schema) -> None:
    compared = 0
    for where, m, node in _pairs(SFTJobSpec, schema["properties"]["spec"], "spec"):
        for name, field in m.model_fields.items():
            prop = node.get("properties", {}).get(field.alias or name, {})
            pattern = _pattern(field)
            if pattern is not None:
                assert prop.get("pattern") == pattern, f"{where}.{name}"
                compared += 1
    assert compared >= 8


def test_the_crd_and_the_models_agree_on_numeric_bounds(schema: Schema) -> None:
    """Same minimum, maximum and exclusiveness, so `sftjob plan -f` refuses what admission refuses."""
    compared = 0
    for where, m, node in _pairs(SFTJobSpec, schema["properties"]["spec"], "spec"):
        for name, field in m.model_fields.items():
            prop = node.get("properties", {}).get(field.alias or name, {})
            if prop.get("type") in ("integer", "number"):
                keys = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")
                crd = {k: prop[k] for k in keys if k in prop and prop[k] is not False}
                assert _bounds(field) == crd, f"{where}.{name}"
                compared += 1
    spec = _walk(schema["properties"]["spec"], "spec")
    assert compared == sum(1 for _, node in spec if node.get("type") in ("integer", "number"))


def _numbers(node: Schema, path: tuple[str, ...]) -> Iterator[tuple[tuple[str, ...], Schema]]:
    if node.get("type") in ("integer", "number"):
        yield path, node
    for name, child in node.get("properties", {}).items():
        yield from _numbers(child, (*path, name))


ARCHITECTURE = {
    "layers": 2,
    "hiddenSize": 64,
    "heads": 4,
    "kvHeads": 2,
    "intermediateSize": 128,
    "vocabSize": 320,
}


def test_the_models_refuse_every_number_just_outside_the_crds_bounds(schema: Schema) -> None:
    refused = 0
    for path, node in _numbers(schema["properties"]["spec"], ()):
        outside = [
            node["minimum"] - (0 if node.get("exclusiveMinimum") else 1),
            node["maximum"] + (0 if node.get("exclusiveMaximum") else 1),
        ]
        for value in outside:
            doc: Schema = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "dataset": {"name": "x"}}
            if path[:2] == ("model", "architecture"):
                doc["model"]["architecture"] = dict(ARCHITECTURE)
            block = doc
            for part in path[:-1]:
                block = block.setdefault(part, {})
            block[path[-1]] = value
            with pytest.raises(ValidationError):
                SFTJobSpec.model_validate(doc)
            refused += 1
    assert refused >= 60


def test_label_keys_and_values_are_checked_with_the_models_patterns_and_words(schema: Schema) -> None:
    """The toleration and nodeSelector CEL rules hold the regexes and wording of sftjob.spec."""
    spec = schema["properties"]["spec"]["properties"]
    toleration = spec["tolerations"]["items"]["properties"]
    rules = [
        *toleration["key"]["x-kubernetes-validations"],
        *toleration["value"]["x-kubernetes-validations"],
        *spec["nodeSelector"]["x-kubernetes-validations"][1:],
        *spec["nodeSelector"]["additionalProperties"]["x-kubernetes-validations"],
    ]
    regexes = {r for rule in rules for r in re.findall(r"matches\('([^']*)'\)", rule["rule"])}
    assert regexes == {LABEL_KEY, LABEL_VALUE}
    words = " ".join(rule.get("message", rule.get("messageExpression", "")) for rule in rules)
    words = words.replace("\\'", "'")
    assert words.count(LABEL_KEY_RULE) == 2 and words.count(LABEL_VALUE_RULE) == 2


def test_every_field_has_a_description(schema: Schema) -> None:
    missing = [
        w for w, node in _walk(schema, "") if "description" not in node and not w.endswith(("[]", "{}"))
    ]
    assert missing == [".metadata"]  # metadata is the API machinery's


def test_every_number_string_and_list_in_the_spec_is_bounded(schema: Schema) -> None:
    for where, node in _walk(schema["properties"]["spec"], "spec"):
        kind = node.get("type")
        if kind in ("integer", "number"):
            assert "minimum" in node and "maximum" in node, where
        elif kind == "string":
            assert "maxLength" in node or "enum" in node, where
        elif kind == "array":
            assert "maxItems" in node, where


def test_the_printer_columns_show_gpu_phase_progress_loss_throughput_restarts_and_age(
    schema: Schema, crd: Schema
) -> None:
    columns = {col["name"]: col for col in crd["spec"]["versions"][0]["additionalPrinterColumns"]}
    default = [name for name, col in columns.items() if not col.get("priority")]
    assert default == ["GPU", "Phase", "Progress", "Loss", "Tok/s", "Restarts", "Age"]
    status = schema["properties"]["status"]["properties"]
    for name in ("GPU", "Phase", "Progress", "Loss", "Tok/s", "Restarts"):
        path = columns[name]["jsonPath"].removeprefix(".status.").split(".")
        node = {"properties": status}
        for part in path:
            node = node["properties"][part]
        assert node["type"] in ("string", "number", "integer"), name


def test_printer_columns_use_only_jsonpath_the_api_server_evaluates(crd: Schema) -> None:
    """client-go's jsonpath has no && or || in filters: the API server drops a column using them."""
    columns = crd["spec"]["versions"][0]["additionalPrinterColumns"]
    for column in columns:
        assert "&&" not in column["jsonPath"] and "||" not in column["jsonPath"], column["name"]
    reason = next(col for col in columns if col["name"] == "Reason")
    assert reason["jsonPath"] == '.status.conditions[?(@.type=="Running")].reason'


def test_conditions_are_a_map_keyed_by_type(schema: Schema) -> None:
    conditions = schema["properties"]["status"]["properties"]["conditions"]
    assert conditions["x-kubernetes-list-type"] == "map" and conditions["x-kubernetes-list-map-keys"] == [
        "type"
    ]


def test_quantities_are_numbers_or_strings_checked_with_the_models_pattern_and_words(schema: Schema) -> None:
    """``cpu: 16`` unquoted is admitted as Kubernetes admits it in a pod; its text is what the rule checks."""
    spec = schema["properties"]["spec"]["properties"]
    fields = [spec["checkpoints"]["properties"]["size"], *spec["resources"]["properties"].values()]
    for field in fields:
        assert field["x-kubernetes-int-or-string"] is True and "type" not in field
        assert field["maxLength"] == 32  # checks the strings; a number that long is no quantity anyway
        rule = field["x-kubernetes-validations"][0]
        assert rule["rule"] == f"string(self).matches(r'{POSITIVE_QUANTITY}')"
        assert rule["message"] == f"must be {QUANTITY_RULE}"


def test_pod_memory_below_the_models_minimum_is_refused_by_a_rule_naming_the_unit(schema: Schema) -> None:
    from sftjob.spec import MIN_POD_MEMORY

    memory = schema["properties"]["spec"]["properties"]["resources"]["properties"]["memory"]
    _, rule = memory["x-kubernetes-validations"]
    assert f"quantity(string(self)).compareTo(quantity('{MIN_POD_MEMORY}')) >= 0" in rule["rule"]
    assert (
        rule["message"].startswith(f"must be at least {MIN_POD_MEMORY}")
        and "without a unit" in rule["message"]
    )


def test_the_output_path_rule_holds_the_checkpoint_volumes_names(schema: Schema) -> None:
    rules = schema["properties"]["spec"]["properties"]["output"]["x-kubernetes-validations"]
    assert any(f"self.path.matches(r'{c.CHECKPOINT_VOLUME_NAMES}')" in r["rule"] for r in rules)


def test_the_crd_reserves_every_env_name_and_prefix_the_spec_model_does(schema: Schema) -> None:
    from sftjob.pod_settings import RESERVED_ENV_NAMES, RESERVED_ENV_PREFIXES

    env = schema["properties"]["spec"]["properties"]["env"]
    rules = " ".join(rule["rule"] for rule in env["items"]["x-kubernetes-validations"])
    assert all(f"'{name}'" in rules for name in RESERVED_ENV_NAMES), rules
    assert all(f"!self.name.startsWith('{prefix}')" in rules for prefix in RESERVED_ENV_PREFIXES), rules
    described = " ".join(env["description"].replace(",", " ").split())
    assert all(name in described.split() for name in RESERVED_ENV_NAMES)


def test_the_crd_refuses_the_pod_annotations_the_spec_model_does(schema: Schema) -> None:
    from sftjob.pod_settings import KUEUE_ANNOTATION, RESERVED_ANNOTATION, SECURITY_PROFILE_ANNOTATION

    rules = schema["properties"]["spec"]["properties"]["podAnnotations"]["x-kubernetes-validations"]
    for pattern in (RESERVED_ANNOTATION, KUEUE_ANNOTATION, SECURITY_PROFILE_ANNOTATION):
        assert any(f"self.all(k, !k.matches('{pattern}'))" == r["rule"] for r in rules), pattern


def test_the_crd_refuses_all_linear_beside_other_target_modules_with_the_models_words(schema: Schema) -> None:
    targets = schema["properties"]["spec"]["properties"]["lora"]["properties"]["targetModules"]
    (rule,) = targets["x-kubernetes-validations"]
    assert rule["rule"] == "!self.exists(m, m == 'all-linear') || self.size() == 1"
    with pytest.raises(ValidationError, match=re.escape(rule["message"])):
        SFTJobSpec.model_validate(
            {
                "model": {"name": "a/b"},
                "dataset": {"name": "c/d"},
                "lora": {"targetModules": ["all-linear", "q"]},
            }
        )
    assert "[all-linear]" in targets["description"]


def test_merging_the_adapter_of_a_full_fine_tune_is_refused_by_the_crd_and_the_model_alike(
    schema: Schema,
) -> None:
    spec = schema["properties"]["spec"]
    rule = "self.method != 'full' || !has(self.output.mergeAdapter) || !self.output.mergeAdapter"
    assert rule in [r["rule"] for r in spec["x-kubernetes-validations"]]
    assert spec["properties"]["output"]["properties"]["mergeAdapter"]["type"] == "boolean"
    body = {"model": {"name": "a/b"}, "dataset": {"name": "c/d"}, "output": {"mergeAdapter": True}}
    with pytest.raises(ValidationError, match=r"spec\.method full writes the whole model already"):
        SFTJobSpec.model_validate(body | {"method": "full"})
    assert SFTJobSpec.model_validate(body | {"method": "qlora"}).output.merge_adapter


@pytest.mark.parametrize(("block", "what"), [("model", "model"), ("dataset", "dataset")])
def test_a_revision_beside_a_path_is_refused_by_the_crd_and_the_model_alike(
    schema: Schema, block: str, what: str
) -> None:
    rules = schema["properties"]["spec"]["properties"][block]["x-kubernetes-validations"]
    message = f"{block}.revision pins a hub {what}; it needs {block}.name, not path"
    assert {"rule": "!has(self.revision) || has(self.name)", "message": message} in rules
    volume = {"persistentVolumeClaim": {"claimName": "files"}}
    body = {"model": {"name": "a/b"}, "dataset": {"name": "c/d"}}
    body[block] = {"path": "p", "volume": volume, "revision": "v1.0"}
    with pytest.raises(ValidationError, match=rf"spec\.{block}\.revision pins a hub {what}: it needs"):
        SFTJobSpec.model_validate(body)


def test_the_architecture_description_says_a_mixture_of_experts_is_sized_by_parameters_alone(
    schema: Schema,
) -> None:
    from sftjob.model_shapes import PARAMETERS_TOLERANCE

    model = schema["properties"]["spec"]["properties"]["model"]["properties"]
    described = " ".join(model["architecture"]["description"].split())
    assert "cannot describe a mixture-of-experts model" in described and "give parameters alone" in described
    assert f"must not count more than {PARAMETERS_TOLERANCE:.0%} fewer weights" in described
    assert "counts every expert" in " ".join(model["parameters"]["description"].split())
