"""Every failure class from realistic pod and node objects, as the API server returns them."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import pytest

from sftjob.attempts import AttemptRecord
from sftjob.failures import ExitCode, FailureClass
from sftjob_operator.classify import (
    ROOT_CAUSE_ORDER,
    Classification,
    Outcome,
    classify_attempt,
    classify_pod,
    describe_failure,
    end_record,
    peer_never_joined,
)

NOW = datetime(2026, 5, 1, 12, 0, 0, tzinfo=UTC)
NODE = "gpu-a800-0"
RECORD = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))


def ts(seconds_ago: float) -> str:
    return (NOW - timedelta(seconds=seconds_ago)).isoformat().replace("+00:00", "Z")


def node(ready: str = "True", since_seconds: float = 3600) -> dict[str, Any]:
    return {
        "metadata": {"name": NODE},
        "status": {
            "conditions": [{"type": "Ready", "status": ready, "lastTransitionTime": ts(since_seconds)}]
        },
    }


def pod(
    phase: str = "Running",
    *,
    state: dict[str, Any] | None = None,
    reason: str | None = None,
    message: str | None = None,
    disruption: str | None = None,
    deleting: bool = False,
    init_state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    status: dict[str, Any] = {
        "phase": phase,
        "conditions": [{"type": "Ready", "status": "True" if phase == "Running" else "False"}],
        "containerStatuses": [
            {"name": "trainer", "image": "ghcr.io/sftjob/trainer:0.1.0", "state": state or {}}
        ],
    }
    if reason:
        status["reason"] = reason
    if message:
        status["message"] = message
    if disruption:
        status["conditions"].append({"type": "DisruptionTarget", "status": "True", "reason": disruption})
    if init_state:
        status["initContainerStatuses"] = [{"name": "fetch", "image": "busybox", "state": init_state}]
    metadata: dict[str, Any] = {"name": "job-1-0", "namespace": "default"}
    if deleting:
        metadata["deletionTimestamp"] = ts(5)
    return {"metadata": metadata, "spec": {"nodeName": NODE}, "status": status}


def running(started_seconds_ago: float = 60) -> dict[str, Any]:
    return {"running": {"startedAt": ts(started_seconds_ago)}}


def exited(code: int, reason: str = "Error", message: str = "") -> dict[str, Any]:
    terminated: dict[str, Any] = {"exitCode": code, "reason": reason, "finishedAt": ts(1)}
    if message:
        terminated["message"] = message
    return {"terminated": terminated}


def waiting(reason: str, message: str = "") -> dict[str, Any]:
    return {"waiting": {"reason": reason, "message": message}}


def classify(p: dict[str, Any] | None, n: dict[str, Any] | None = None, **kw: Any) -> Classification:
    return classify_pod(p, node() if n is None else n, now=NOW, **kw)


@pytest.mark.parametrize(
    ("exit_code", "expected"),
    [
        (ExitCode.CONFIG_ERROR, FailureClass.CONFIG_ERROR),
        (ExitCode.DATA_ERROR, FailureClass.DATA_ERROR),
        (ExitCode.MODEL_LOAD_ERROR, FailureClass.MODEL_LOAD_ERROR),
        (ExitCode.GPU_UNAVAILABLE, FailureClass.GPU_UNAVAILABLE),
        (ExitCode.DRIVER_MISMATCH, FailureClass.DRIVER_MISMATCH),
        (ExitCode.CUDA_OOM, FailureClass.CUDA_OOM),
        (ExitCode.COMMUNICATION_ERROR, FailureClass.COMMUNICATION_ERROR),
        (ExitCode.STORAGE_ERROR, FailureClass.STORAGE_ERROR),
        (ExitCode.NETWORK_ERROR, FailureClass.NETWORK_ERROR),
        (ExitCode.PREEMPTED, FailureClass.PREEMPTED),
    ],
)
def test_documented_trainer_exit_codes_map_to_their_class(exit_code: int, expected: FailureClass) -> None:
    result = classify(pod("Failed", state=exited(exit_code, message="line one\nthe reason")))
    assert result.outcome is Outcome.FAILED
    assert result.failure_class is expected
    assert result.exit_code == exit_code
    assert result.message == "the reason"
    assert result.node == NODE


def test_a_completed_pod_succeeds() -> None:
    result = classify(pod("Succeeded", state=exited(0, "Completed")))
    assert result == Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    assert result.over


def test_a_running_pod_with_recent_progress_is_not_over() -> None:
    result = classify(
        pod(state=running(3000)), last_progress=NOW - timedelta(seconds=20), stall_timeout_seconds=600
    )
    assert result.outcome is Outcome.RUNNING
    assert not result.over


def test_oomkilled_container_is_host_oom() -> None:
    result = classify(pod("Failed", state=exited(137, "OOMKilled")))
    assert (result.failure_class, result.exit_code) == (FailureClass.HOST_OOM, 137)


def test_an_unknown_exit_code_is_unknown_and_names_the_code() -> None:
    result = classify(pod("Failed", state=exited(3)))
    assert result.failure_class is FailureClass.UNKNOWN
    assert "3" in result.message


def test_exit_code_one_is_read_from_the_termination_message() -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"
    assert classify(pod("Failed", state=exited(1, message=oom))).failure_class is FailureClass.CUDA_OOM
    nccl = "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp, unhandled system error"
    assert (
        classify(pod("Failed", state=exited(1, message=nccl))).failure_class
        is FailureClass.COMMUNICATION_ERROR
    )
    disk = "OSError: [Errno 28] No space left on device"
    assert classify(pod("Failed", state=exited(1, message=disk))).failure_class is FailureClass.STORAGE_ERROR
    worker = "RuntimeError: DataLoader worker (pid 4242) is killed by signal: Killed."
    assert classify(pod("Failed", state=exited(1, message=worker))).failure_class is FailureClass.HOST_OOM


@pytest.mark.parametrize(
    "message",
    [
        "torch.AcceleratorError: CUDA error: out of memory",
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:3356, unhandled cuda error;"
        " ncclUnhandledCudaError: Call to CUDA function failed. Last error: Cuda failure 'out of memory'",
    ],
)
def test_cuda_out_of_memory_outside_the_caching_allocator_is_cuda_oom_even_in_nccl(message: str) -> None:
    assert classify(pod("Failed", state=exited(1, message=message))).failure_class is FailureClass.CUDA_OOM


# The trainer's own messages for each documented failure, as ``write_termination_message`` writes them.
TAGGED_MESSAGES = [
    (
        "[exit 10] invalid trainer configuration: 1 validation error for TrainerConfig",
        FailureClass.CONFIG_ERROR,
    ),
    ("[exit 11] dataset /data/train.jsonl is empty", FailureClass.DATA_ERROR),
    ("[exit 12] could not load model meta-llama/Llama-3.1-8B: gated repo", FailureClass.MODEL_LOAD_ERROR),
    ("[exit 13] no NVIDIA GPU or driver is visible to the trainer", FailureClass.GPU_UNAVAILABLE),
    ("[exit 14] NVIDIA driver 535 is older than the image's CUDA 13.2 needs", FailureClass.DRIVER_MISMATCH),
    ("[exit 14] GPU is 'NVIDIA A40', the plan was made for A800", FailureClass.DRIVER_MISMATCH),
    ("[exit 15] CUDA out of memory: Tried to allocate 2.00 GiB", FailureClass.CUDA_OOM),
    (
        "[exit 16] communication error between ranks: DistStoreError: timed out",
        FailureClass.COMMUNICATION_ERROR,
    ),
    ("[exit 17] storage error: PermissionError: [Errno 13] Permission denied", FailureClass.STORAGE_ERROR),
    (
        "[exit 18] hub or network unavailable while loading the model from org/model: 503",
        FailureClass.NETWORK_ERROR,
    ),
    ("[exit 20] preempted (SIGTERM): checkpoint saved at step 1200", FailureClass.PREEMPTED),
]


@pytest.mark.parametrize(("message", "expected"), TAGGED_MESSAGES)
def test_behind_torchruns_exit_code_one_the_trainers_tagged_code_decides(
    message: str, expected: FailureClass
) -> None:
    result = classify(pod("Failed", state=exited(1, message=message + "\n")))
    assert result.failure_class is expected
    tag, reason = message.split("] ", 1)
    assert result.exit_code == int(tag.removeprefix("[exit "))
    assert result.message == reason


def test_a_preempted_trainer_killed_after_saving_is_still_preempted_with_its_own_code() -> None:
    message = "[exit 20] preempted (SIGTERM): checkpoint saved at step 40"
    result = classify(pod("Failed", state=exited(137, message=message), disruption="PreemptionByScheduler"))
    assert (result.failure_class, result.exit_code) == (FailureClass.PREEMPTED, ExitCode.PREEMPTED)


def test_an_unexpected_error_tagged_one_is_still_matched_against_the_signatures() -> None:
    message = (
        "[exit 1] unexpected error: RuntimeError: NCCL error in: ProcessGroupNCCL.cpp, remote process exited"
    )
    result = classify(pod("Failed", state=exited(1, message=message)))
    assert (result.failure_class, result.exit_code) == (FailureClass.COMMUNICATION_ERROR, 1)
    assert result.message.startswith("unexpected error")


def test_a_success_message_left_by_one_rank_does_not_make_a_failed_pod_succeed() -> None:
    result = classify(pod("Failed", state=exited(1, message="completed 200 steps, final loss 1.2345")))
    assert (result.outcome, result.failure_class) == (Outcome.FAILED, FailureClass.UNKNOWN)


def torchrun_tail(last_words: str, rank: int, exitcode: int, detail: str) -> str:
    """The end of a trainer pod's log when a rank dies without a termination message: its last words,
    then torchrun's log, traceback and report (torch.distributed.elastic.multiprocessing.errors)."""
    site = "/usr/local/lib/python3.12/site-packages/torch/distributed"
    glog = "torch/distributed/elastic/multiprocessing/api.py"
    signal_name = f"  ({detail.split('(')[1].split(')')[0]})" if exitcode < 0 else ""
    rule, section = "=" * 60, "-" * 60
    return "\n".join(
        [
            last_words,
            f"W0501 12:00:00.100000 1 {glog}:1028] Sending process 41 closing signal SIGTERM",
            f"E0501 12:00:00.200000 1 {glog}:1002] failed (exitcode: {exitcode}) local_rank: {rank} (pid: 42)"
            " of binary: /usr/bin/python3",
            "Traceback (most recent call last):",
            f'  File "{site}/run.py", line 1138, in main',
            "    run(args)",
            f'  File "{site}/launcher/api.py", line 386, in launch_agent',
            "    raise ChildFailedError(",
            "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
            rule,
            "sftjob_trainer.train FAILED",
            section,
            "Failures:",
            "[1]:",
            "  time      : 2026-05-01_12:00:00",
            "  host      : llama-sft-1-0",
            "  rank      : 0 (local_rank: 0)",
            "  exitcode  : -15 (pid: 41)  (SIGTERM)",
            "  error_file: <N/A>",
            "  traceback : Signal 15 (SIGTERM) received by PID 41",
            section,
            "Root Cause (first observed failure):",
            "[0]:",
            "  time      : 2026-05-01_12:00:00",
            "  host      : llama-sft-1-0",
            f"  rank      : {rank} (local_rank: {rank})",
            f"  exitcode  : {exitcode} (pid: 42){signal_name}",
            "  error_file: <N/A>",
            f"  traceback : {detail}",
            rule,
            "",
        ]
    )


def test_a_log_tail_is_matched_whole_and_summed_up_from_above_torchruns_report() -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.15 GiB"
    tail = torchrun_tail(
        oom, 1, 1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.exit_code) == (FailureClass.CUDA_OOM, 1)
    assert result.message == f"rank 1 exited with code 1: {oom}"


def test_an_nccl_watchdog_abort_is_a_communication_error_named_by_its_signal() -> None:
    watchdog = (
        "[rank3]:[E501 11:59:59.000000000 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective"
        " operation timeout: WorkNCCL(SeqNum=42, OpType=ALLREDUCE) ran for 600000 milliseconds"
    )
    tail = torchrun_tail(watchdog, 3, -6, "Signal 6 (SIGABRT) received by PID 42")
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert result.failure_class is FailureClass.COMMUNICATION_ERROR
    assert result.message.startswith("rank 3 killed by SIGABRT: [rank3]:[E501")


# torchrun's own traceback when its static rendezvous gives up (torch 2.15, `--nnodes=2`, one node only).
_ELASTIC = "/opt/conda/lib/python3.11/site-packages/torch/distributed/elastic"
RENDEZVOUS_TRACEBACK = f"""\
  File "{_ELASTIC}/agent/server/api.py", line 527, in _rendezvous
    rdzv_info = spec.rdzv_handler.next_rendezvous()
                ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "{_ELASTIC}/rendezvous/static_tcp_rendezvous.py", line 67, in next_rendezvous
    self._store = TCPStore(  # type: ignore[call-arg]
                  ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
"""


@pytest.mark.parametrize(
    "error",
    [
        "torch.distributed.DistStoreError: Timed out after 86401 seconds waiting for clients."
        " 1/2 clients joined.",
        "torch.distributed.DistNetworkError: The client socket has timed out after 86400000ms while trying to"
        " connect to (llama-3-0.llama, 29500).",
    ],
)
def test_a_rendezvous_that_gave_up_on_a_peer_is_a_communication_error_of_nobodys_links(error: str) -> None:
    result = classify(pod("Failed", state=exited(1, message=RENDEZVOUS_TRACEBACK + error + "\n")))
    assert (result.failure_class, result.message) == (FailureClass.COMMUNICATION_ERROR, error)
    assert peer_never_joined(
        end_record(RECORD, result, end_time=NOW, progress_step=None, checkpoint_step=None)
    )


def test_an_nccl_error_is_not_a_peer_that_never_joined() -> None:
    watchdog = "[Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=42) ran for 600000 ms"
    result = classify(
        pod(
            "Failed",
            state=exited(1, message=torchrun_tail(watchdog, 3, -6, "Signal 6 (SIGABRT) received by PID 42")),
        )
    )
    record = end_record(RECORD, result, end_time=NOW, progress_step=None, checkpoint_step=None)
    assert record.reason is FailureClass.COMMUNICATION_ERROR and not peer_never_joined(record)


def test_a_tail_that_holds_only_torchruns_report_names_the_root_causes_rank_and_signal() -> None:
    tail = torchrun_tail("", 1, -11, "Signal 11 (SIGSEGV) received by PID 42")
    report = tail[tail.index("====") :]  # the kubelet keeps only the log's last 2048 bytes
    result = classify(pod("Failed", state=exited(1, message=report)))
    assert (result.failure_class, result.message) == (FailureClass.UNKNOWN, "rank 1 killed by SIGSEGV")


def test_a_rank_that_exited_with_a_documented_code_but_wrote_no_message_is_classified_by_it() -> None:
    tail = torchrun_tail("OSError: could not write /dev/termination-log", 0, 11, "<N/A>")
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.exit_code) == (FailureClass.DATA_ERROR, ExitCode.DATA_ERROR)


def test_sigterm_with_a_scheduler_preemption_is_preempted() -> None:
    result = classify(pod("Failed", state=exited(143), disruption="PreemptionByScheduler"))
    assert result.failure_class is FailureClass.PREEMPTED
    assert "PreemptionByScheduler" in result.message and "SIGTERM" in result.message


def test_sigkill_after_a_drain_is_preempted_not_host_oom() -> None:
    result = classify(pod("Failed", state=exited(137), disruption="EvictionByEvictionAPI"))
    assert result.failure_class is FailureClass.PREEMPTED


def test_the_trainers_own_exit_code_wins_over_a_disruption() -> None:
    result = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM), disruption="PreemptionByScheduler"))
    assert result.failure_class is FailureClass.CUDA_OOM


def test_sigkill_without_oom_or_disruption_is_unknown() -> None:
    result = classify(pod("Failed", state=exited(137)))
    assert result.failure_class is FailureClass.UNKNOWN
    assert "SIGKILL" in result.message


def test_node_pressure_eviction_for_memory_is_host_oom() -> None:
    message = "The node was low on resource: memory. Threshold quantity: 100Mi, available: 12Mi."
    result = classify(pod("Failed", reason="Evicted", message=message, disruption="TerminationByKubelet"))
    assert result.failure_class is FailureClass.HOST_OOM


def test_eviction_for_disk_is_preempted() -> None:
    message = "The node was low on resource: ephemeral-storage."
    result = classify(pod("Failed", reason="Evicted", message=message))
    assert result.failure_class is FailureClass.PREEMPTED


def test_node_shutdown_is_preempted() -> None:
    result = classify(
        pod(
            "Failed", reason="Terminated", message="Pod was terminated in response to imminent node shutdown."
        )
    )
    assert result.failure_class is FailureClass.PREEMPTED


def test_gpu_admission_failure_is_gpu_unavailable() -> None:
    result = classify(
        pod("Failed", reason="UnexpectedAdmissionError", message="Allocate failed due to no healthy devices")
    )
    assert result.failure_class is FailureClass.GPU_UNAVAILABLE


@pytest.mark.parametrize("reason", ["ImagePullBackOff", "InvalidImageName"])
def test_an_image_that_cannot_be_pulled_ends_the_attempt(reason: str) -> None:
    result = classify(pod("Pending", state=waiting(reason, 'Back-off pulling image "nope:1"')))
    assert (result.outcome, result.failure_class) == (Outcome.FAILED, FailureClass.IMAGE_PULL_ERROR)
    assert "nope:1" in result.message


def test_a_first_image_pull_error_is_given_the_kubelets_retry() -> None:
    assert classify(pod("Pending", state=waiting("ErrImagePull"))).outcome is Outcome.RUNNING


def test_an_init_container_image_pull_failure_counts_too() -> None:
    result = classify(
        pod("Pending", state=waiting("PodInitializing"), init_state=waiting("ImagePullBackOff"))
    )
    assert result.failure_class is FailureClass.IMAGE_PULL_ERROR


def test_a_missing_secret_key_is_a_config_error() -> None:
    message = "couldn't find key token in Secret default/hf-token"
    result = classify(pod("Pending", state=waiting("CreateContainerConfigError", message)))
    assert result.failure_class is FailureClass.CONFIG_ERROR
    assert "hf-token" in result.message


def test_a_running_pod_on_a_deleted_node_is_node_lost() -> None:
    result = classify_pod(pod(state=running()), None, now=NOW)
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, NODE)


def test_a_node_notready_past_the_grace_loses_its_pods() -> None:
    result = classify(pod(state=running()), node("Unknown", since_seconds=300), node_lost_grace_seconds=120)
    assert result.failure_class is FailureClass.NODE_LOST


def test_a_brief_notready_blip_does_not_end_the_attempt() -> None:
    assert classify(pod(state=running()), node("False", since_seconds=30)).outcome is Outcome.RUNNING


def test_a_vanished_pod_whose_node_is_gone_is_node_lost() -> None:
    result = classify_pod(None, None, now=NOW, node_name=NODE)
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, NODE)


def test_a_vanished_pod_on_a_healthy_node_was_deleted_and_counts_as_preempted() -> None:
    assert classify_pod(None, node(), now=NOW, node_name=NODE).failure_class is FailureClass.PREEMPTED


def test_a_vanished_pod_that_was_never_scheduled_was_deleted() -> None:
    assert classify_pod(None, None, now=NOW).failure_class is FailureClass.PREEMPTED


def test_taint_manager_deletion_on_an_unreachable_node_is_node_lost() -> None:
    p = pod("Failed", disruption="DeletionByTaintManager")
    assert classify(p, node("Unknown", since_seconds=600)).failure_class is FailureClass.NODE_LOST


def test_a_pod_being_deleted_is_not_over_until_the_trainer_exits() -> None:
    p = pod(state=running(), disruption="PreemptionByScheduler", deleting=True)
    assert classify(p, stall_timeout_seconds=60).outcome is Outcome.RUNNING


def test_no_progress_for_longer_than_the_stall_timeout_is_stalled() -> None:
    result = classify(
        pod(state=running(4000)), last_progress=NOW - timedelta(seconds=700), stall_timeout_seconds=600
    )
    assert result.failure_class is FailureClass.STALLED
    assert "700 s" in result.message


def test_a_trainer_that_never_reported_is_stalled_counting_from_its_start() -> None:
    assert classify(pod(state=running(601)), stall_timeout_seconds=600).failure_class is FailureClass.STALLED
    assert classify(pod(state=running(599)), stall_timeout_seconds=600).outcome is Outcome.RUNNING


def test_stall_detection_is_off_without_a_timeout() -> None:
    assert classify(pod(state=running(10**6))).outcome is Outcome.RUNNING


def test_long_termination_messages_become_one_trimmed_line() -> None:
    result = classify(pod("Failed", state=exited(ExitCode.DATA_ERROR, message="x" * 5000)))
    assert len(result.message) == 300 and "\n" not in result.message


def test_a_multi_node_attempt_takes_the_root_cause_not_the_peers_nccl_errors() -> None:
    peer = classify(pod("Failed", state=exited(ExitCode.COMMUNICATION_ERROR)))
    lost = classify_pod(None, None, now=NOW, node_name="gpu-a800-1")
    result = classify_attempt([peer, lost, Classification(Outcome.RUNNING)])
    assert (result.failure_class, result.node) == (FailureClass.NODE_LOST, "gpu-a800-1")


def test_a_multi_node_attempt_succeeds_only_when_every_pod_does() -> None:
    done = Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    assert classify_attempt([done, Classification(Outcome.RUNNING)]).outcome is Outcome.RUNNING
    assert classify_attempt([done, done]).outcome is Outcome.SUCCEEDED
    assert classify_attempt([]).outcome is Outcome.RUNNING


def test_ending_a_record_counts_the_steps_since_the_last_checkpoint() -> None:
    record = AttemptRecord(attempt=2, node=NODE, start_time=NOW - timedelta(hours=1), resumed_from_step=100)
    failed = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM, message="CUDA out of memory")))
    ended = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=150)
    assert (ended.reason, ended.exit_code, ended.lost_steps, ended.end_time) == (
        FailureClass.CUDA_OOM,
        15,
        30,
        NOW,
    )
    no_checkpoint = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=None)
    assert no_checkpoint.lost_steps == 80


def test_a_succeeded_attempt_loses_no_steps_and_says_so_by_leaving_them_unset() -> None:
    record = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))
    done = Classification(Outcome.SUCCEEDED, exit_code=0, node=NODE)
    ended = end_record(record, done, end_time=NOW, progress_step=200, checkpoint_step=150)
    assert ended.succeeded and ended.lost_steps is None


def test_an_ended_record_round_trips_through_status_json_in_camel_case() -> None:
    record = AttemptRecord(attempt=1, node=NODE, start_time=NOW - timedelta(hours=1))
    ended = end_record(
        record,
        classify(pod("Failed", state=exited(143), disruption="PreemptionByScheduler")),
        end_time=NOW,
        progress_step=10,
        checkpoint_step=10,
    )
    wire = ended.model_dump(mode="json", by_alias=True, exclude_none=True)
    assert wire["reason"] == "Preempted" and wire["exitCode"] == 143 and wire["lostSteps"] == 0
    assert AttemptRecord.model_validate(wire) == ended


def test_a_failed_attempt_is_described_in_one_line_for_its_event() -> None:
    record = AttemptRecord(attempt=3, node=NODE, start_time=NOW - timedelta(hours=1))
    failed = classify(pod("Failed", state=exited(ExitCode.CUDA_OOM, message="CUDA out of memory")))
    ended = end_record(record, failed, end_time=NOW, progress_step=180, checkpoint_step=150)
    assert describe_failure(ended) == (
        f"attempt 3 on {NODE} failed with CudaOOM (exit code 15): CUDA out of memory;"
        " 30 step(s) since the last checkpoint"
    )


def test_every_failure_class_has_a_place_in_the_root_cause_order() -> None:
    assert set(ROOT_CAUSE_ORDER) == set(FailureClass) and len(ROOT_CAUSE_ORDER) == len(FailureClass)
