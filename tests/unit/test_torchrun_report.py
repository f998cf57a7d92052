"""torchrun's report and tee'd lines read alike by the operator and the trainer's launcher, and what the
launcher writes from them (a killed rank and its last words) classed by the operator by those words."""

from __future__ import annotations

import pytest

from sftjob.failures import FailureClass
from sftjob.torchrun_report import RootCause, last_words, read_report, summarize, worker_line
from sftjob_operator.termination import message_class, read_message
from tests.unit.classify_cases import classify, exited, pod

# What torchrun 2.15 printed when local rank 1 of two aborted (tests/trainer/test_launch.py runs it).
REPORT = """\
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
=======================================================
sftjob_trainer.train FAILED
-------------------------------------------------------
Failures:
[1]:
  time      : 2026-12-02_13:39:25
  host      : llama-sft-1-1
  rank      : 8 (local_rank: 0)
  exitcode  : -15 (pid: 32033)  (SIGTERM)
  error_file: <N/A>
  traceback : Signal 15 (SIGTERM) received by PID 32033
-------------------------------------------------------
Root Cause (first observed failure):
[0]:
  time      : 2026-12-02_13:39:25
  host      : llama-sft-1-1
  rank      : 9 (local_rank: 1)
  exitcode  : -6 (pid: 32034)  (SIGABRT)
  error_file: <N/A>
  traceback : Signal 6 (SIGABRT) received by PID 32034
=======================================================
""".splitlines()
WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5,"
    " OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600023 milliseconds before timing"
    " out."
)


def test_the_root_cause_of_a_report_is_its_last_block_not_the_failures_listed_before_it() -> None:
    report = read_report(["[default1]:its words", *REPORT])
    assert report is not None and report.start == 2  # the top rule, below which torchrun's words stop
    assert report.root_cause == RootCause(rank=9, local_rank=1, exitcode=-6)


def test_lines_without_a_root_cause_heading_hold_no_report() -> None:
    assert read_report(REPORT[: REPORT.index("Root Cause (first observed failure):")]) is None


@pytest.mark.parametrize(
    ("cause", "described"),
    [
        (RootCause(1, 1, -6), "rank 1 killed by SIGABRT"),
        (RootCause(0, 0, 1), "rank 0 exited with code 1"),
        (RootCause(None, None, -99), "a rank killed by signal 99"),
        (RootCause(3, None, None), ""),
    ],
)
def test_a_root_cause_is_described_by_its_rank_and_its_exit_code_or_signal(
    cause: RootCause, described: str
) -> None:
    assert cause.describe() == described


def test_a_tee_prefix_names_the_local_rank_and_the_rank_prefix_of_torchs_own_logs_does_not() -> None:
    assert worker_line("[default1]:[rank9]:[E1202] boom") == (1, "[rank9]:[E1202] boom")
    assert worker_line("[rank1]:[E1202] boom") is None
    assert (
        worker_line("W1202 13:39:25.028000 1 torch/distributed/elastic/multiprocessing/api.py:1028] x")
        is None
    )


def test_last_words_skip_a_cpp_backtrace_and_rules() -> None:
    said = [
        "  what():  " + WATCHDOG,
        "Exception raised from checkTimeout at NCCL.cpp:634",
        "frame #0: x",
        "=====",
    ]
    assert last_words(said) == f"what():  {WATCHDOG}"
    assert last_words(["frame #3: y", ""]) == ""


def test_last_words_of_tee_d_lines_are_the_root_causes_own_without_their_prefix() -> None:
    said = [
        f"[default1]:  what():  {WATCHDOG}",
        "[default1]:frame #0: c10::Error::Error(...) + 0x98",
        "[default0]:stopping on SIGTERM after step 12",
    ]
    assert last_words(said, local_rank=1) == f"what():  {WATCHDOG}"
    assert last_words(said) == "stopping on SIGTERM after step 12"


def test_a_kubelet_tail_of_tee_d_lines_names_the_root_causes_words() -> None:
    backtrace = "[default1]:frame #0: c10::Error::Error(...) + 0x98"
    tail = [f"[default1]:  what():  {WATCHDOG}", backtrace, *REPORT]
    said = read_message("\n".join(tail) + "\n")
    assert said.summary == f"rank 9 killed by SIGABRT: what():  {WATCHDOG}"
    assert message_class(said, own_image=False) == (FailureClass.COMMUNICATION_ERROR, said.summary)


def test_a_cause_without_last_words_is_summed_up_by_how_it_ended() -> None:
    assert summarize(RootCause(1, 1, -9), "") == "rank 1 killed by SIGKILL"
    assert summarize(RootCause(None, None, None), "words") == "words"


@pytest.mark.parametrize(
    ("exitcode", "words", "cls"),
    [
        (
            -6,
            f"[rank1]:[E1202 13:39:24.100000 31 ProcessGroupNCCL.cpp:632] {WATCHDOG}",
            FailureClass.COMMUNICATION_ERROR,
        ),
        (1, "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", FailureClass.CUDA_OOM),
    ],
)
def test_the_launchers_message_is_classed_by_the_operator_from_its_words(
    exitcode: int, words: str, cls: FailureClass
) -> None:
    message = summarize(RootCause(1, 1, exitcode), words) + "\n"
    said = read_message(message)
    assert said.exit_code is None and said.summary == message.strip()
    assert message_class(said, own_image=False) == (cls, message.strip())
    outcome = classify(pod("Failed", state=exited(1, message=message)))  # torchrun's 1 behind the launcher
    assert outcome.failure_class is cls and outcome.message == message.strip()
