"""Why a trainer ended, read from its termination message: the trainer's `[exit N]` tag behind torchrun's
exit code 1, CUDA out-of-memory wording, and log tails ending in torchrun's report (rendezvous, watchdog
aborts, ranks without a message)."""

from __future__ import annotations

import pytest

from sftjob.failures import ExitCode, FailureClass
from sftjob_operator.attempt_end import end_record, peer_never_joined
from sftjob_operator.classify import Outcome
from tests.torchrun_output import report_block
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


# What PyTorch raises when NCCL runs out of GPU memory: its "Last error" is NCCL's last WARN
# (NVIDIA/nccl src/debug.cc), which for an allocation is one of
#   CUCHECK (src/include/cudawrap.h), cuMemCreate on the cuMem path:
#     WARN("Cuda failure %d '%s'", err, errStr);
#   CUDACHECK (src/include/checks.h), cudaMalloc:  WARN("Cuda failure '%s'", cudaGetErrorString(err));
#   ncclCudaCalloc/ncclCudaMalloc (src/include/alloc.h), after either of those:
#     WARN("Failed to CUDA calloc %ld bytes", ...);  WARN("Failed to CUDA malloc %ld bytes", ...);
NCCL_OUT_OF_MEMORY = [
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/NCCLUtils.cpp"
    ":77, unhandled cuda error (run with NCCL_DEBUG=INFO for details), NCCL version 2.27.3\n"
    f"ncclUnhandledCudaError: Call to CUDA function failed.\nLast error:\n{last}"
    for last in (
        "Cuda failure 2 'out of memory'",
        "Cuda failure 'out of memory'",
        "Failed to CUDA calloc 6291456 bytes",
        "Failed to CUDA malloc 2097152 bytes",
    )
]


@pytest.mark.parametrize(
    "message", ["torch.AcceleratorError: CUDA error: out of memory", *NCCL_OUT_OF_MEMORY]
)
def test_cuda_out_of_memory_outside_the_caching_allocator_is_cuda_oom_even_in_nccl(message: str) -> None:
    assert classify(pod("Failed", state=exited(1, message=message))).failure_class is FailureClass.CUDA_OOM


@pytest.mark.parametrize("message", NCCL_OUT_OF_MEMORY)
def test_an_oom_in_nccl_that_an_older_trainer_tagged_a_communication_error_is_cuda_oom(message: str) -> None:
    tagged = f"[exit 16] communication error between ranks: {' '.join(message.split())}"
    result = classify(pod("Failed", state=exited(1, message=tagged)))
    assert (result.failure_class, result.exit_code) == (FailureClass.CUDA_OOM, ExitCode.COMMUNICATION_ERROR)


def test_the_trainers_failed_start_up_probe_stays_a_communication_error_whatever_allocation_nccl_failed() -> (
    None
):
    # The probe runs right after preflight found the plan's memory free: "Failed to CUDA calloc" follows any
    # cudaMalloc error there (a faulted GPU, an unsupported cuMem call), and the trainer judged it on purpose.
    tagged = (
        "[exit 16] the first collective between the 16 ranks (a 1 MiB all-reduce) failed (DistBackendError:"
        " NCCL error: unhandled cuda error, Last error: Failed to CUDA calloc 6291456 bytes) on 2 nodes"
    )
    result = classify(pod("Failed", state=exited(1, message=tagged)))
    assert result.failure_class is FailureClass.COMMUNICATION_ERROR


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


# torchrun's own output after a rank failed (torch 2.x, python 3.12): a SIGTERM line per other local rank of
# the pod, the failure, torchrun's whole traceback and its report (torch.distributed.elastic.multiprocessing).
_TORCH = "/usr/local/lib/python3.12/site-packages/torch"
_GLOG = f"{_TORCH}/distributed/elastic/multiprocessing/api.py"


def torchrun_tail(last_words: str, rank: int, exitcode: int, detail: str, *, local_ranks: int = 1) -> str:
    """The termination message of a trainer pod whose rank ``rank`` (one of the pod's ``local_ranks``) died
    without one: its ``last_words``, then torchrun's output, as the kubelet keeps it
    (:func:`kubelet_tail`)."""
    local = rank % local_ranks
    closing = [
        f"W0501 12:00:00.100000 1 {_GLOG}:900] Sending process {40 + r} closing signal SIGTERM"
        for r in range(local_ranks)
        if r != local
    ]
    torchrun = [
        *closing,
        f"E0501 12:00:00.200000 1 {_GLOG}:874] failed (exitcode: {exitcode}) local_rank: {local}"
        f" (pid: {40 + local}) of binary: /usr/bin/python3",
        "Traceback (most recent call last):",
        '  File "/usr/local/bin/torchrun", line 8, in <module>',
        "    sys.exit(main())",
        "             ^^^^^^",
        f'  File "{_TORCH}/distributed/elastic/multiprocessing/errors/__init__.py", line 355, in wrapper',
        "    return f(*args, **kwargs)",
        "           ^^^^^^^^^^^^^^^^^^",
        f'  File "{_TORCH}/distributed/run.py", line 918, in main',
        "    run(args)",
        f'  File "{_TORCH}/distributed/run.py", line 909, in run',
        "    elastic_launch(",
        f'  File "{_TORCH}/distributed/launcher/api.py", line 138, in __call__',
        "    return launch_agent(self._config, self._entrypoint, list(args))",
        "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^",
        f'  File "{_TORCH}/distributed/launcher/api.py", line 269, in launch_agent',
        "    raise ChildFailedError(",
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        *report_block(rank, exitcode, local_rank=local, detail=detail),
        "",
    ]
    return kubelet_tail("\n".join([last_words, *torchrun]))


def kubelet_tail(log: str) -> str:
    """What the kubelet makes the termination message of a container that wrote none
    (FallbackToLogsOnError): the log's last 80 lines, cut to their last 2048 bytes."""
    kept = "\n".join(log.split("\n")[-80:]).encode()
    return kept[-2048:].decode(errors="replace")


# What a rank the NCCL watchdog aborts prints (torch 2.x): the watchdog's lines, then the C++ exception that
# takes the process down, with its backtrace.
_LIB = f"{_TORCH}/lib/libtorch_cuda.so"
WATCHDOG = "\n".join(
    [
        "[rank3]:[E501 11:59:59.000000000 ProcessGroupNCCL.cpp:632] [Rank 3] Watchdog caught collective"
        " operation timeout: WorkNCCL(SeqNum=4242, OpType=ALLREDUCE, NumelIn=1, NumelOut=1,"
        " Timeout(ms)=600000) ran for 600012 milliseconds before timing out.",
        "[rank3]:[E501 11:59:59.000000000 ProcessGroupNCCL.cpp:695] [Rank 3] To avoid data inconsistency, we"
        " are taking the entire process down.",
        "terminate called after throwing an instance of 'c10::DistBackendError'",
        "  what():  [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread terminated with"
        " exception: [Rank 3] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=4242,"
        " OpType=ALLREDUCE) ran for 600012 milliseconds before timing out.",
        "Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:635"
        " (most recent call first):",
        f"frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98 (0x7f3c1c0f5e78 in {_LIB})",
        f"frame #1: c10d::ProcessGroupNCCL::watchdogHandler() + 0x8a0 (0x7f3bd1a40e00 in {_LIB})",
        "frame #2: <unknown function> + 0x9caa4 (0x7f3c1d49caa4 in /lib/x86_64-linux-gnu/libc.so.6)",
    ]
)
SIGABRT = "Signal 6 (SIGABRT) received by PID 43"


def test_a_log_tail_is_matched_whole_and_summed_up_from_above_torchruns_report() -> None:
    oom = "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has 79.15 GiB"
    tail = torchrun_tail(
        oom, 1, 1, "To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html"
    )
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.exit_code) == (FailureClass.CUDA_OOM, 1)
    assert result.message == f"rank 1 exited with code 1: {oom}"


NOT_IN_TAIL = (
    "its error message is not in the last 2048 bytes of the log the kubelet keeps: see the pod's log"
)


def test_a_watchdog_abort_whose_nccl_frames_survive_in_the_tail_is_a_communication_error() -> None:
    tail = torchrun_tail(WATCHDOG, 3, -6, SIGABRT)  # one GPU: torchrun leaves the backtrace's last frames in
    assert "ProcessGroupNCCL::watchdogHandler" in tail and "what()" not in tail
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.message) == (
        FailureClass.COMMUNICATION_ERROR,
        f"rank 3 killed by SIGABRT; {NOT_IN_TAIL}",
    )


def test_a_tail_torchrun_filled_says_the_rank_was_killed_and_that_its_words_are_not_there() -> None:
    # Eight GPUs: seven SIGTERM lines, the traceback and the report leave none of the rank's words, and the
    # kubelet's cut falls inside a SIGTERM line ("...closing signal SIGTERM" -> "IGTERM").
    tail = torchrun_tail(WATCHDOG, 3, -6, SIGABRT, local_ranks=8)
    assert len(tail.encode()) == 2048 and "Watchdog" not in tail and not tail.startswith("W0501")
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.message) == (
        FailureClass.UNKNOWN,
        f"rank 3 killed by SIGABRT; {NOT_IN_TAIL}",
    )


def test_a_c_plus_plus_backtrace_is_never_a_tails_summary() -> None:
    frames = "\n".join(WATCHDOG.splitlines()[-3:])
    tail = torchrun_tail(frames, 3, -6, SIGABRT, local_ranks=2)
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert result.message.startswith("rank 3 killed by SIGABRT") and "frame #" not in result.message


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
    message = f"[exit 16] communication error between ranks: DistBackendError: {watchdog}"
    result = classify(pod("Failed", state=exited(1, message=message)))
    record = end_record(RECORD, result, end_time=NOW, progress_step=None, checkpoint_step=None)
    assert record.reason is FailureClass.COMMUNICATION_ERROR and not peer_never_joined(record)


def test_a_whole_log_in_which_the_rank_said_nothing_names_the_root_causes_rank_and_signal() -> None:
    tail = torchrun_tail("", 1, -11, "Signal 11 (SIGSEGV) received by PID 42")
    assert len(tail.encode()) < 2048  # not cut: the rank printed nothing before it died
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.message) == (FailureClass.UNKNOWN, "rank 1 killed by SIGSEGV")


def test_a_rank_that_exited_with_a_documented_code_but_wrote_no_message_is_classified_by_it() -> None:
    tail = torchrun_tail("OSError: could not write /dev/termination-log", 0, 11, "<N/A>")
    result = classify(pod("Failed", state=exited(1, message=tail)))
    assert (result.failure_class, result.exit_code) == (FailureClass.DATA_ERROR, ExitCode.DATA_ERROR)
