"""``sftjob plan -f``: the file read as ``kubectl apply -f`` and the API server read it, every failure one
line of error and exit 2."""

import codecs
import io
import json
import sys
from pathlib import Path

import pytest
import yaml

from sftjob.cli_input import NULLABLE_SPEC_FIELDS, read_spec
from tests.unit.test_cli import JOB, _plan_file, run

CRD_PATH = Path(__file__).resolve().parents[2] / "crds" / "sftjob.io_sftjobs.yaml"


def _refused(tmp_path, capsys, document: str | bytes) -> str:
    """The one line of error a file admission would refuse gets."""
    job = tmp_path / "job.yaml"
    job.write_bytes(document if isinstance(document, bytes) else document.encode())
    code, out, err = run(capsys, "plan", "-f", str(job))
    assert code == 2 and out == "" and err.count("\n") == 1 and err.startswith("sftjob: error: "), err
    return err


@pytest.mark.parametrize(
    "data",
    [JOB.encode("utf-8-sig"), JOB.encode("utf-16"), codecs.BOM_UTF16_BE + JOB.encode("utf-16-be")],
    ids=["utf-8", "utf-16", "utf-16-be"],
)
def test_a_file_with_a_byte_order_mark_is_read_in_the_encoding_it_names(tmp_path, capsys, data):
    job = tmp_path / "job.yaml"
    job.write_bytes(data)
    code, _, err = run(capsys, "plan", "-f", str(job))
    assert code == 0, err


def test_bytes_that_are_not_utf_8_are_an_input_error_naming_their_line(tmp_path, capsys):
    err = _refused(tmp_path, capsys, JOB.replace("name: demo", "name: démo").encode("latin-1"))
    assert "job.yaml: line 4: invalid continuation byte in UTF-8: save the file as UTF-8" in err


@pytest.mark.parametrize("metadata", ["metadata: demo", "metadata: [demo]"])
def test_a_metadata_that_is_not_a_mapping_is_an_input_error(tmp_path, capsys, metadata):
    err = _refused(tmp_path, capsys, JOB.replace("metadata: {name: demo}", metadata))
    assert "job.yaml: metadata: expected a mapping (name: ...), not a " in err


def test_a_key_written_twice_is_an_input_error_naming_it_and_its_lines(tmp_path, capsys):
    err = _refused(tmp_path, capsys, JOB + "  gpu: {type: A40, count: 2}\n")
    assert 'job.yaml: line 12, column 3: mapping key "gpu" already defined at line 10' in err


def test_keys_merged_from_an_anchor_may_be_set_again(tmp_path, capsys):
    document = JOB.replace("metadata: {name: demo}", "metadata: {name: demo, labels: &labels {team: a}}")
    code, _, err = _plan_file(tmp_path, capsys, document + "  nodeSelector: {<<: *labels, team: b}\n")
    assert code == 0, err


def test_empty_documents_around_the_job_are_skipped(tmp_path, capsys):
    code, _, err = _plan_file(tmp_path, capsys, "---\n" + JOB + "---\n")
    assert code == 0, err


@pytest.mark.parametrize(
    ("document", "words"),
    [
        (
            "apiVersion: v1\nkind: Secret\n---" + JOB,
            "holds 2 objects (Secret, SFTJob): give the SFTJob alone",
        ),
        ("---\n# all commented out\n---\n", "holds no object"),
    ],
)
def test_a_file_of_several_objects_or_none_is_an_input_error_saying_what_it_holds(
    tmp_path, capsys, document, words
):
    assert words in _refused(tmp_path, capsys, document)


def test_a_yaml_syntax_error_is_one_line_with_its_line_and_column(tmp_path, capsys):
    err = _refused(tmp_path, capsys, JOB.replace("method: lora", "method: [lora"))
    assert "job.yaml: line 9, column 7: expected ',' or ']', but got ':'" in err
    assert "(while parsing a flow sequence at line 8)" in err


def test_null_blocks_are_dropped_as_the_api_server_prunes_them(tmp_path, capsys):
    document = JOB.replace("alpha: 32", "alpha: ~").replace(
        "  training: {globalBatchSize: 16, learningRate: 0.0001}\n",
        "  training:\n    # globalBatchSize: 16\n  resources:\n  env:\n",
    )
    code, out, err = _plan_file(tmp_path, capsys, document)
    assert code == 0 and out, err


def test_a_null_of_a_field_the_crd_lets_be_null_is_kept(tmp_path):
    job = tmp_path / "job.yaml"
    job.write_text(JOB + "  restartPolicy: {stallTimeoutSeconds: null, maxRestarts: null}\n")
    assert read_spec(str(job))["restartPolicy"] == {"stallTimeoutSeconds": None}


def test_the_nulls_kept_are_those_of_the_spec_fields_the_crd_marks_nullable():
    crd = yaml.safe_load(CRD_PATH.read_text())
    (version,) = crd["spec"]["versions"]
    nullable: set[tuple[str, ...]] = set()

    def walk(schema: dict, path: tuple[str, ...]) -> None:
        if schema.get("nullable"):
            nullable.add(path)
        for name, field in schema.get("properties", {}).items():
            walk(field, (*path, name))
        for child in ("items", "additionalProperties"):
            if isinstance(schema.get(child), dict):
                walk(schema[child], path)

    walk(version["schema"]["openAPIV3Schema"]["properties"]["spec"], ())
    assert nullable == NULLABLE_SPEC_FIELDS


@pytest.mark.parametrize("spec", ["", "spec:\n"])
def test_a_whole_sftjob_without_a_spec_is_an_input_error_saying_so(tmp_path, capsys, spec):
    document = JOB[: JOB.index("spec:")] + spec
    assert "job.yaml: the SFTJob has no spec" in _refused(tmp_path, capsys, document)


def _stdin(monkeypatch, document: str) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(document.encode())))


def test_a_dash_reads_the_job_from_standard_input(monkeypatch, capsys):
    _stdin(monkeypatch, JOB)
    code, out, err = run(capsys, "plan", "-f", "-", "-o", "json")
    assert code == 0 and [p["gpu"] for p in json.loads(out)] == ["L40S"], err


def test_errors_about_standard_input_call_it_stdin(monkeypatch, capsys):
    _stdin(monkeypatch, JOB.replace("globalBatchSize: 16", "globalBatchSize: 0"))
    code, _, err = run(capsys, "plan", "-f", "-")
    assert code == 2 and err.startswith("sftjob: error: stdin: spec.training.globalBatchSize: ")
