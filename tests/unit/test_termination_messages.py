"""Why a trainer ended, read from its termination message: the trainer's `[exit N]` tag behind torchrun's
exit code 1, CUDA out-of-memory wording, and log tails ending in torchrun's report (rendezvous, watchdog
aborts, ranks without a message)."""

from __future__ import annotations

import pytest

from sftjob.failures import ExitCode, FailureClass
from sftjob_operator.attempt_end import end_record, peer_never_joined
from sftjob_operator.classify import Outcome
from tests.unit.classify_cases import NOW, RECORD, classify, exited, pod


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
    # A SIGTERM the trainer reports is a preemption only on a pod something asked to stop (test_classify).
    stopped = "PreemptionByScheduler" if expected is FailureClass.PREEMPTED else None
    result = classify(pod("Failed", state=exited(1, message=message + "\n"), disruption=stopped))
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
