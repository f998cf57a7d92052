"""An SFTJob's life through the operator: KWOK-steered outcomes, progress, suspend, deadlines, deletion."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from operator_harness import Jobs, Operator, sftjob, wait_for

pytestmark = pytest.mark.e2e


def when(stamp: str) -> datetime:
    return datetime.fromisoformat(stamp.replace("Z", "+00:00"))


def conditions(status: dict[str, object]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]}  # type: ignore[attr-defined]


def test_a_pod_that_succeeds_makes_the_job_succeeded_with_timestamps(jobs: Jobs) -> None:
    jobs.apply(sftjob("ok"))
    (pod,) = jobs.running_pods("ok")
    jobs.steer(pod["metadata"]["name"], outcome="succeed")
    status = jobs.wait_phase("ok", "Succeeded")
    got = conditions(status)
    assert got["Succeeded"] == ("True", "Completed")
    assert got["Failed"][0] == got["Running"][0] == "False"
    assert got["Admitted"] == ("True", "ValidSpec") and got["Planned"][0] == "True"
    assert when(status["startTime"]) <= when(status["completionTime"])
    (attempt,) = status["attempts"]
    assert attempt["succeeded"] and attempt["exitCode"] == 0 and attempt["node"] == pod["spec"]["nodeName"]
    assert all(c["observedGeneration"] == 1 for c in status["conditions"])


def test_a_pod_that_fails_makes_the_job_failed_with_its_exit_code_and_message(jobs: Jobs) -> None:
    jobs.apply(sftjob("broken"))
    (pod,) = jobs.running_pods("broken")
    jobs.steer(pod["metadata"]["name"], outcome="fail", exit_code="11", message="DataError: no rows parsed")
    status = jobs.wait_phase("broken", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["status"] == "True" and failed["reason"] == "DataError"
    assert "exit code 11" in failed["message"] and "no rows parsed" in failed["message"]
    (attempt,) = status["attempts"]
    assert attempt["exitCode"] == 11 and attempt["reason"] == "DataError" and attempt["endTime"]
    assert status["completionTime"] and conditions(status)["Succeeded"][0] == "False"


def test_the_trainers_progress_annotations_show_in_status(jobs: Jobs) -> None:
    jobs.apply(sftjob("talkative"))
    (pod,) = jobs.running_pods("talkative")
    run_page = "https://wandb.ai/my-team/support-bot/runs/uid-1"  # spec.tracking's run, kept by the schema
    progress = {"step": 120, "totalSteps": 1000, "epoch": 0.12, "loss": 1.2345, "learningRate": 2e-4,
                "tokensPerSecond": 5120.5, "etaSeconds": 3600, "updated": "2026-01-01T00:00:00Z",
                "trackingUrls": {"wandb": run_page}}  # fmt: skip
    checkpoint = {"step": 100, "path": "/checkpoints/checkpoint-100", "time": "2026-01-01T00:00:00Z"}
    jobs.kubectl(
        "annotate", "pod", pod["metadata"]["name"],
        f"sftjob.io/progress={json.dumps(progress)}", f"sftjob.io/last-checkpoint={json.dumps(checkpoint)}",
    )  # fmt: skip
    status = wait_for("progress in status", lambda: (s := jobs.status("talkative")).get("progress") and s, 30)
    assert status["progress"]["summary"] == "120/1000" and status["progress"]["loss"] == pytest.approx(1.2345)
    assert status["lastCheckpoint"]["step"] == 100
    assert status["progress"]["trackingUrls"] == {"wandb": run_page}
    printed = jobs.kubectl("get", "sft", "talkative").stdout
    assert "120/1000" in printed and "1.2345" in printed


def test_suspending_deletes_the_pods_and_keeps_the_checkpoints_and_resuming_starts_a_new_attempt(
    jobs: Jobs,
) -> None:
    jobs.apply(sftjob("pausable"))
    jobs.running_pods("pausable")
    jobs.kubectl("patch", "sft", "pausable", "--type=merge", "-p", '{"spec":{"suspend":true}}')
    status = jobs.wait_phase("pausable", "Suspended")
    assert conditions(status)["Suspended"] == ("True", "SuspendedBySpec")
    wait_for("the pods to go", lambda: not jobs.pods("pausable"))
    jobs.kubectl("get", "pvc", "pausable-checkpoints")
    jobs.kubectl("patch", "sft", "pausable", "--type=merge", "-p", '{"spec":{"suspend":false}}')
    (pod,) = jobs.running_pods("pausable")
    assert pod["metadata"]["labels"]["sftjob.io/attempt"] == "2"
    status = jobs.wait_phase("pausable", "Running")
    assert [a["attempt"] for a in status["attempts"]] == [1, 2] and status["restarts"] == 0


def test_a_job_past_its_active_deadline_fails_with_deadline_exceeded(jobs: Jobs) -> None:
    jobs.apply(sftjob("hurried", activeDeadlineSeconds=3))
    jobs.running_pods("hurried")
    status = jobs.wait_phase("hurried", "Failed", timeout=20)
    assert conditions(status)["Failed"] == ("True", "DeadlineExceeded")
    wait_for(
        "the pods to go", lambda: not [p for p in jobs.pods("hurried") if p["status"]["phase"] == "Running"]
    )


def test_a_finished_job_is_deleted_after_its_ttl(jobs: Jobs) -> None:
    jobs.apply(sftjob("fleeting", ttlSecondsAfterFinished=2))
    (pod,) = jobs.running_pods("fleeting")
    jobs.steer(pod["metadata"]["name"], outcome="succeed")
    jobs.wait_phase("fleeting", "Succeeded")
    gone = jobs.kubectl("get", "sft", "fleeting", check=False)
    wait_for(
        "the job to be deleted",
        lambda: jobs.kubectl("get", "sft", "fleeting", check=False).returncode != 0,
        20,
    )
    assert gone.returncode == 0


def test_a_model_that_cannot_fit_fails_at_once_with_the_planners_explanation(jobs: Jobs) -> None:
    jobs.apply(sftjob("huge", model={"name": "meta-llama/Llama-3.1-70B"}, method="full", gpu={"type": "A40"}))
    status = jobs.wait_phase("huge", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "DoesNotFit" and "GiB" in failed["message"]
    assert conditions(status)["Planned"] == ("False", "DoesNotFit")
    assert not jobs.pods("huge")


def test_a_checkpoint_claim_too_small_for_the_run_fails_at_once_with_the_size_to_ask_for(jobs: Jobs) -> None:
    full = {
        "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
        "method": "full",
        "gpu": {"type": "A800", "count": 8},
    }
    jobs.apply(sftjob("cramped", checkpoints={"size": "50Gi"}, **full))
    status = jobs.wait_phase("cramped", "Failed")
    failed = next(c for c in status["conditions"] if c["type"] == "Failed")
    assert failed["reason"] == "CheckpointVolumeTooSmall" and "Gi or more" in failed["message"]
    assert not jobs.pods("cramped")
    claims = jobs.kubectl("get", "pvc", "-o", "name").stdout
    assert "cramped-checkpoints" not in claims


def test_deleting_a_job_removes_its_children_and_the_claim_it_made(jobs: Jobs) -> None:
    jobs.apply(sftjob("doomed", gpu={"type": "A800", "count": 2, "nodes": 2}))
    jobs.running_pods("doomed", count=2)
    for kind in (
        "configmap/doomed-config",
        "service/doomed",
        "pvc/doomed-checkpoints",
        "serviceaccount/doomed-trainer",
    ):
        jobs.kubectl("get", kind)
    jobs.kubectl("delete", "sft", "doomed", "--wait=true", "--timeout=30s")
    selector = "sftjob.io/job=doomed"
    wait_for(
        "garbage collection",
        lambda: not jobs.kubectl("get", "pods,configmaps,services,pvc,serviceaccounts,roles", "-l", selector,
                                 "-o", "name").stdout.strip(),
    )  # fmt: skip


def test_a_claim_marked_keep_on_delete_outlives_its_job(jobs: Jobs) -> None:
    jobs.apply(sftjob("keeper", checkpoints={"keepOnDelete": True}))
    jobs.running_pods("keeper")
    jobs.kubectl("delete", "sft", "keeper", "--wait=true", "--timeout=30s")
    wait_for("the pod to go", lambda: not jobs.pods("keeper"))
    claim = json.loads(jobs.kubectl("get", "pvc", "keeper-checkpoints", "-o", "json").stdout)
    assert not claim["metadata"].get("ownerReferences")


def pods_created(metrics: str) -> float:
    line = next(
        line for line in metrics.splitlines() if line.startswith("sftjob_operator_pods_created_total ")
    )
    return float(line.split()[1])


def test_the_operator_serves_its_metrics_and_counts_what_it_did(jobs: Jobs, operator: Operator) -> None:
    before = pods_created(operator.metrics())  # the counter is the session operator's, over every test
    jobs.apply(sftjob("counted"))
    jobs.running_pods("counted")
    jobs.wait_phase("counted", "Running")
    text = operator.metrics()
    assert pods_created(text) == before + 1  # the job's one pod
    assert 'sftjob_operator_reconcile_total{result="success"}' in text
    assert 'sftjob_jobs{gpu_type="L40S",phase="Running"}' in text
