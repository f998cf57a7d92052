"""The ``-f`` input of ``sftjob plan``, read as ``kubectl apply -f`` and the API server read it.

Its own module because that takes more than ``yaml.safe_load``, and ``sftjob.cli`` is about planning: the
bytes are decoded by their byte order mark (PowerShell's ``kubectl get -o yaml > f`` writes UTF-16), the
documents of a stream are counted (a trailing ``---`` is an empty one), a duplicate key is refused as
kubectl refuses it, numbers are read as YAML 1.2 reads them, nulls are dropped as the API server prunes
them, and every failure is a one-line :class:`InputError`, never PyYAML's multi-line text or a traceback.
"""

from __future__ import annotations

import codecs
import re
import sys
from pathlib import Path
from typing import Any

import yaml
from yaml.constructor import ConstructorError

from sftjob import constants as c
from sftjob.spec import MAX_JOB_NAME, valid_job_name

STDIN = "-"  # kubectl's name for standard input
GENERATED_SUFFIX = 5  # characters the API server appends to metadata.generateName
# The spec fields the CRD marks nullable: true, whose nulls the API server keeps (it prunes the others').
NULLABLE_SPEC_FIELDS = {("restartPolicy", "stallTimeoutSeconds")}
# PowerShell's `>` writes UTF-16 with a byte order mark; some editors write UTF-8 with one.
BYTE_ORDER_MARKS = {
    codecs.BOM_UTF8: "utf-8",
    codecs.BOM_UTF16_LE: "utf-16-le",
    codecs.BOM_UTF16_BE: "utf-16-be",
}
MERGE_TAG = "tag:yaml.org,2002:merge"  # the `<<` key, which may repeat the keys it merges


class InputError(Exception):
    """Bad command-line or YAML input, with a message naming the flag or the field."""


class _KubectlLoader(yaml.SafeLoader):
    """YAML read into the numbers kubectl sends the API server: ``2e-4`` is a number (YAML 1.2; PyYAML's
    YAML 1.1 wants a dot and makes it a string) and a whole number is an integer (``4096.0`` is sent as
    ``4096``), so the types the spec is then strictly checked for are the ones the API server sees."""


def _number(loader: yaml.SafeLoader, node: yaml.ScalarNode) -> int | float:
    value = loader.construct_yaml_float(node)
    return int(value) if value.is_integer() else value


_KubectlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)
_KubectlLoader.add_constructor("tag:yaml.org,2002:float", _number)


def read_spec(path: str) -> dict[str, Any]:
    """The spec in a YAML file (``-``: standard input) holding a whole SFTJob (its kind, apiVersion and
    name checked as the API server checks them) or just its spec, without the nulls the API server
    prunes."""
    where = source(path)
    try:
        data = sys.stdin.buffer.read() if path == STDIN else Path(path).read_bytes()
    except OSError as e:
        raise InputError(f"cannot read {where}: {e}") from e
    spec: dict[str, Any] = _without_nulls(_spec_of(_one_object(_decode(data, where), where), where), ())
    return spec


def source(path: str) -> str:
    """The name errors give the ``-f`` file."""
    return "stdin" if path == STDIN else path


def _decode(data: bytes, where: str) -> str:
    """The text of ``data``: in the encoding its byte order mark names, otherwise UTF-8."""
    bom, encoding = next(((b, e) for b, e in BYTE_ORDER_MARKS.items() if data.startswith(b)), (b"", "utf-8"))
    body = data[len(bom) :]
    try:
        return body.decode(encoding)
    except UnicodeDecodeError as e:
        line = body[: e.start].decode(encoding, errors="replace").count("\n") + 1
        raise InputError(
            f"{where}: line {line}: {e.reason} in {encoding.upper()}: save the file as UTF-8"
        ) from e


def _one_object(text: str, where: str) -> Any:
    """The one non-empty document of ``text``."""
    loader = _KubectlLoader(text)
    documents = []
    try:
        while loader.check_node():
            node = loader.get_node()
            assert node is not None  # check_node said a document follows
            _refuse_duplicate_keys(node)
            documents.append(loader.construct_document(node))
    except yaml.YAMLError as e:
        raise InputError(f"{where}: {_yaml_problem(e)}") from e
    finally:
        loader.dispose()
    objects = [doc for doc in documents if doc is not None]
    if not objects:
        raise InputError(f"{where}: holds no object: give an SFTJob, or its spec")
    if len(objects) > 1:
        kinds = [str(o.get("kind", "no kind")) if isinstance(o, dict) else _what(o) for o in objects]
        raise InputError(f"{where}: holds {len(objects)} objects ({', '.join(kinds)}): give the SFTJob alone")
    return objects[0]


def _refuse_duplicate_keys(root: yaml.Node) -> None:
    """Raises on a key written twice in one mapping (PyYAML keeps the last; kubectl refuses the file)."""
    checked: set[int] = set()  # an alias names a node already checked
    nodes = [root]
    while nodes:
        node = nodes.pop()
        if id(node) in checked:
            continue
        checked.add(id(node))
        if isinstance(node, yaml.SequenceNode):
            nodes += node.value
        elif isinstance(node, yaml.MappingNode):
            _refuse_a_repeated_key(node)
            nodes += [child for pair in node.value for child in pair]


def _refuse_a_repeated_key(mapping: yaml.MappingNode) -> None:
    first_line: dict[tuple[str, str], int] = {}
    for key, _ in mapping.value:
        if not isinstance(key, yaml.ScalarNode) or key.tag == MERGE_TAG:
            continue
        if (key.tag, key.value) in first_line:
            problem = f'mapping key "{key.value}" already defined at line {first_line[key.tag, key.value]}'
            raise ConstructorError(None, None, problem, key.start_mark)
        first_line[key.tag, key.value] = key.start_mark.line + 1


def _yaml_problem(error: yaml.YAMLError) -> str:
    """PyYAML's error in one line: the problem, where it is, and what it was reading."""
    if not isinstance(error, yaml.MarkedYAMLError) or error.problem_mark is None:
        return str(error).splitlines()[0]
    mark = error.problem_mark
    found = f"line {mark.line + 1}, column {mark.column + 1}: {error.problem}"
    if error.context and error.context_mark is not None:
        found += f" ({error.context} at line {error.context_mark.line + 1})"
    return found


def _spec_of(doc: Any, where: str) -> dict[str, Any]:
    """The spec of a whole SFTJob (of a mapping holding only ``spec:``), or ``doc`` when it is a spec."""
    if not isinstance(doc, dict):
        raise InputError(f"{where}: expected an SFTJob object, not {_what(doc)}")
    whole = "kind" in doc or "apiVersion" in doc
    if whole:
        _check_object(doc, where)
    spec = doc.get("spec") if whole else doc.get("spec", doc)
    if spec is None:  # a whole SFTJob's is required, not the object read as its spec
        raise InputError(f"{where}: the SFTJob has no spec")
    if not isinstance(spec, dict):
        raise InputError(f"{where}: spec: expected a mapping (model: ..., dataset: ...), not {_what(spec)}")
    return spec


def _check_object(doc: dict[str, Any], where: str) -> None:
    """Raises on a kind, apiVersion or name of a whole SFTJob the API server would refuse."""
    api_version = f"{c.API_GROUP}/{c.API_VERSION}"
    if doc.get("kind") != c.KIND or doc.get("apiVersion") != api_version:
        raise InputError(
            f"{where}: kind {doc.get('kind')!r}, apiVersion {doc.get('apiVersion')!r}: expected kind"
            f" {c.KIND}, apiVersion {api_version} (one object per file)"
        )
    metadata = {} if doc.get("metadata") is None else doc["metadata"]
    if not isinstance(metadata, dict):
        raise InputError(f"{where}: metadata: expected a mapping (name: ...), not {_what(metadata)}")
    name = metadata.get("name")
    prefix = metadata.get("generateName")
    if name is None and isinstance(prefix, str):  # the API server appends 5 characters
        name = prefix + "x" * GENERATED_SUFFIX
    if not isinstance(name, str) or not valid_job_name(name):
        raise InputError(
            f"{where}: metadata.name {name!r}: at most {MAX_JOB_NAME} characters, a lowercase letter"
            " first, then lowercase letters, digits and '-' (pods are named <job>-<attempt>-<rank>)"
        )


def _what(value: Any) -> str:
    """A YAML value's kind, in words."""
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, bool):
        return "a boolean"
    return "a number" if isinstance(value, int | float) else type(value).__name__


def _without_nulls(value: Any, path: tuple[str, ...]) -> Any:
    """``value`` without the null fields the API server prunes (a ``training:`` whose children are all
    commented out is no block), keeping those of :data:`NULLABLE_SPEC_FIELDS`; ``path`` is the field's,
    from the spec, items of a list at their list's."""
    if isinstance(value, list):
        return [_without_nulls(item, path) for item in value]
    if not isinstance(value, dict):
        return value
    return {
        key: _without_nulls(item, (*path, str(key)))
        for key, item in value.items()
        if item is not None or (*path, str(key)) in NULLABLE_SPEC_FIELDS
    }
