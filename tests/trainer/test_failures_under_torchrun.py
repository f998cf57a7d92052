"""What the operator learns from a trainer that fails under torchrun, the container's PID 1.

torchrun exits 1 whatever its ranks exited with, so the trainer starts its termination message with its
own code (``[exit 11] ...``) and the operator's classifier reads it from there. These tests run the
trainer as a pod runs it and hand the operator the container status the kubelet would report.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from sftjob.failures import ExitCode, FailureClass, TrainerError
from sftjob_operator.classify import classify_pod
from sftjob_trainer.failures import classify, write_termination_message
from tests.trainer.runs import RANKS, MakeConfig, torchrun

pytestmark = pytest.mark.trainer

NODE = "gpu-a800-0"
KUBELET_MESSAGE_BYTES = 4096  # the kubelet keeps the last 4096 bytes of the termination message file
KUBELET_LOG_BYTES, KUBELET_LOG_LINES = 2048, 80  # and of the log, when the container wrote no message
TWO_RANKS = {
    "distributed": {"nprocPerNode": RANKS, "sharding": "ddp"},
    "training": {"microBatchSize": 2, "gradientAccumulationSteps": 2},
}


# A rank that dies of a signal without writing a termination message (a segfault, NCCL's watchdog abort).
ABORT_ON_LAST_RANK = """
import os, time
if int(os.environ["RANK"]) == int(os.environ["WORLD_SIZE"]) - 1:
    os.abort()
time.sleep(60)  # torchrun stops this rank when its peer fails
"""


def kubelet_message(termination_log: Path) -> str:
    return termination_log.read_bytes()[-KUBELET_MESSAGE_BYTES:].decode(errors="replace")


def operator_view(exit_code: int, message: str) -> tuple[FailureClass | None, int | None, str]:
    """The class, exit code and message the operator records for a pod whose container ended so."""
    terminated = {"exitCode": exit_code, "reason": "Error", "message": message}
    pod: dict[str, Any] = {
        "metadata": {"name": "tiny-1-0", "namespace": "default"},
        "spec": {"nodeName": NODE},
        "status": {
            "phase": "Failed",
            "containerStatuses": [{"name": "trainer", "state": {"terminated": terminated}}],
        },
    }
    node = {"metadata": {"name": NODE}, "status": {"conditions": [{"type": "Ready", "status": "True"}]}}
    result = classify_pod(pod, node, now=datetime.now(UTC))
    return result.failure_class, result.exit_code, result.message


def test_an_empty_dataset_under_torchrun_reaches_the_operator_as_a_data_error(
    trainer_config: MakeConfig, termination_log: Path
) -> None:
    config = trainer_config(name="empty", **TWO_RANKS)
    Path(json.loads(config.read_text())["dataset"]["path"]).write_text("")
    code = torchrun(config, termination_log)
    assert code == 1  # torchrun's own code for any failed rank: the 11 is only in the message
    failure_class, exit_code, message = operator_view(code, kubelet_message(termination_log))
    assert (failure_class, exit_code) == (FailureClass.DATA_ERROR, ExitCode.DATA_ERROR), message
    assert "empty" in message and "[exit" not in message


def test_an_invalid_config_under_torchrun_reaches_the_operator_as_a_config_error(
    tmp_path: Path, termination_log: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"model": {"path": "/m"}, "dataset": {"path": "/d"}, "method": "dpo"}))
    code = torchrun(config, termination_log)
    assert code == 1
    failure_class, exit_code, message = operator_view(code, kubelet_message(termination_log))
    assert (failure_class, exit_code) == (FailureClass.CONFIG_ERROR, ExitCode.CONFIG_ERROR), message
    assert "method" in message and "[exit" not in message


def test_a_failure_message_starts_with_its_exit_code_and_a_success_has_none(termination_log: Path) -> None:
    code, reason = classify(TrainerError(ExitCode.PREEMPTED, "preempted (SIGTERM): checkpoint saved"))
    write_termination_message(reason, code)
    assert termination_log.read_text() == "[exit 20] preempted (SIGTERM): checkpoint saved\n"
    write_termination_message("completed 12 steps")
    assert termination_log.read_text() == "completed 12 steps\n"


def test_the_tag_survives_the_kubelets_cut_of_a_long_message(termination_log: Path) -> None:
    write_termination_message("dataset row 🙂" * 2000, ExitCode.DATA_ERROR)
    assert len(termination_log.read_bytes()) <= KUBELET_MESSAGE_BYTES
    assert operator_view(1, kubelet_message(termination_log))[:2] == (
        FailureClass.DATA_ERROR,
        ExitCode.DATA_ERROR,
    )


def test_a_rank_that_crashes_without_a_message_is_named_with_its_signal_not_torchruns_rules(
    tmp_path: Path, termination_log: Path
) -> None:
    config = tmp_path / "config.json"
    config.write_text("{}")
    script = tmp_path / "abort_on_last_rank.py"
    script.write_text(ABORT_ON_LAST_RANK)
    code = torchrun(config, termination_log, [str(script)])
    assert code == 1 and not termination_log.exists()
    log = (tmp_path / "trainer.log").read_bytes()[-KUBELET_LOG_BYTES:].decode(errors="replace")
    tail = "\n".join(log.splitlines()[-KUBELET_LOG_LINES:])  # FallbackToLogsOnError
    failure_class, exit_code, message = operator_view(code, tail)
    assert (failure_class, exit_code, message) == (FailureClass.UNKNOWN, 1, "rank 1 killed by SIGABRT"), tail
