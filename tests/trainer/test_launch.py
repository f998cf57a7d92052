"""The container's PID 1 above torchrun writes the termination message of a rank killed by a signal (the
NCCL watchdog's SIGABRT), which the operator then classes by its words, keeps a rank's own message, passes
SIGTERM on and ends with torchrun's exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from sftjob.failures import ExitCode, FailureClass, read_exit_tag, tag_exit_code
from sftjob_operator.termination import message_class, read_message
from sftjob_trainer.failures import EXITING
from tests.torchrun_output import report_block

pytestmark = pytest.mark.trainer

LAUNCH = [sys.executable, "-m", "sftjob_trainer.launch"]
WATCHDOG = (
    "[PG ID 0 PG GUID 0(default_pg) Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5,"
    " OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran for 600023 milliseconds before timing"
    " out."
)
CUDA_OOM = (
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity"
)
PREEMPTED_ECHO = tag_exit_code(ExitCode.PREEMPTED, "stopped by SIGTERM at step 12")
# The last rank aborts after a line of its own, as the NCCL watchdog does; the first waits in its collective
# until torchrun SIGTERMs it, and then writes the SIGTERM code, as the trainer does.
ABORTING_RANK = """
import os, signal, sys, time

ready = os.path.join(os.path.dirname(__file__), "rank-0-ready")

def stopped(signum, frame):
    with open(os.environ["SFTJOB_TERMINATION_LOG"], "w") as fh:
        fh.write("[exit 20] stopped by SIGTERM\\n")
    print("wrote the SIGTERM code", file=sys.stderr)
    sys.exit(20)

if os.environ["LOCAL_RANK"] == "1":
    while not os.path.exists(ready):
        time.sleep(0.05)
    print("watchdog: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)", file=sys.stderr)
    print("frame #0: c10::Error::Error() + 0x1", file=sys.stderr)
    os.abort()
signal.signal(signal.SIGTERM, stopped)
print("rank 0 waiting in its all-reduce", file=sys.stderr)
open(ready, "w").close()
time.sleep(30)
"""


def report(rank: int, exitcode: int, *, local_rank: int | None = None) -> list[str]:
    """torchrun's last lines once a worker failed (its log line, its traceback, its report)."""
    local = rank if local_rank is None else local_rank
    return [
        "E1202 13:39:25.131000 31712 torch/distributed/elastic/multiprocessing/api.py:1002]"
        f" failed (exitcode: {exitcode}) local_rank: {local} (pid: 32034) of binary: /usr/bin/python",
        "Traceback (most recent call last):",
        '  File "/usr/local/bin/torchrun", line 10, in <module>',
        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
        *report_block(rank, exitcode, local_rank=local),
    ]


def fake_torchrun(
    tmp_path: Path, stderr: list[str], *, code: int = 1, writes: str | None = None
) -> list[str]:
    """A command that acts as torchrun whose ranks failed: a rank's message (``writes``), then ``stderr``
    (worker lines behind their --tee prefix, then torchrun's own), then exit ``code`` (negative: killed by
    that signal)."""
    write = (
        f"open(os.environ['SFTJOB_TERMINATION_LOG'], 'w').write({as_text([writes])!r})\n" if writes else ""
    )
    end = f"os.kill(os.getpid(), {-code})" if code < 0 else f"sys.exit({code})"
    script = tmp_path / "torchrun.py"
    script.write_text(
        f"import os, sys\n{write}sys.stderr.write({as_text(stderr)!r})\nsys.stderr.flush()\n{end}\n"
    )
    return [sys.executable, str(script)]


def as_text(lines: list[str]) -> str:
    return "".join(f"{line}\n" for line in lines)


def launch(command: list[str], termination_log: Path) -> subprocess.CompletedProcess[str]:
    env = os.environ | {"SFTJOB_TERMINATION_LOG": str(termination_log)}
    return subprocess.run(
        [*LAUNCH, *command], env=env, capture_output=True, text=True, timeout=60, check=False
    )


def operator_reads(termination_log: Path) -> tuple[FailureClass, str] | None:
    """The class and message the operator takes from the termination message of a pod whose torchrun
    exited 1."""
    return message_class(read_message(termination_log.read_text()), own_image=False)


def test_a_rank_killed_by_the_nccl_watchdog_is_named_with_its_last_words_and_classed_a_communication_error(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = [
        "[default0]:step 12 loss 1.25",
        f"[default1]:[rank1]:[E1202 13:39:24.100000 31 ProcessGroupNCCL.cpp:632] {WATCHDOG}",
        "[default1]:Exception raised from checkTimeout at /pytorch/torch/csrc/distributed/c10d/NCCL.cpp:634",
        "[default1]:frame #0: c10::Error::Error(c10::SourceLocation, std::string) + 0x98",
        "[default0]:[rank0]: waiting for the all-reduce",
        "W1202 13:39:25.028000 31712 torch/distributed/elastic/multiprocessing/api.py:1028] Sending process"
        " 32033 closing signal SIGTERM",
        *report(1, -signal.SIGABRT),
    ]
    done = launch(fake_torchrun(tmp_path, stderr), termination_log)
    assert done.returncode == 1
    assert done.stderr == as_text(stderr)  # the pod's log as torchrun wrote it
    message = termination_log.read_text()
    assert message.startswith("rank 1 killed by SIGABRT: [rank1]:") and WATCHDOG in message, message
    assert "frame #" not in message and len(message.encode()) < 4096 and message.count("\n") == 1
    said = operator_reads(termination_log)
    assert said is not None and said[0] is FailureClass.COMMUNICATION_ERROR
    assert said[1] == message.strip()


def test_a_peers_sigterm_code_is_replaced_by_the_rank_that_was_killed(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = ["[default1]:Fatal Python error: Segmentation fault", *report(1, -signal.SIGSEGV)]
    launch(fake_torchrun(tmp_path, stderr, writes=PREEMPTED_ECHO), termination_log)
    assert termination_log.read_text() == "rank 1 killed by SIGSEGV: Fatal Python error: Segmentation fault\n"


def test_a_rank_that_exited_without_a_message_is_named_and_its_cuda_oom_classed_as_one(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = ["[default0]:Traceback (most recent call last):", f"[default0]:{CUDA_OOM}", *report(0, 1)]
    launch(fake_torchrun(tmp_path, stderr), termination_log)
    assert termination_log.read_text() == f"rank 0 exited with code 1: {CUDA_OOM}\n"
    said = operator_reads(termination_log)
    assert said is not None and said[0] is FailureClass.CUDA_OOM


def test_the_rank_of_another_node_is_named_by_its_global_rank_with_its_local_ranks_words(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = ["[default0]:its words", "[default1]:the killed rank's words", *report(9, -9, local_rank=1)]
    launch(fake_torchrun(tmp_path, stderr), termination_log)
    assert termination_log.read_text() == "rank 9 killed by SIGKILL: the killed rank's words\n"


def test_a_ranks_own_message_is_kept_though_it_was_killed_on_its_way_out(
    tmp_path: Path, termination_log: Path
) -> None:
    own = tag_exit_code(ExitCode.COMMUNICATION_ERROR, "communication error between ranks: NCCL error")
    said = f"[default1]:E sftjob_trainer.failures: {EXITING} COMMUNICATION_ERROR (16): NCCL error"
    stderr = [said, f"[default1]:{WATCHDOG}", *report(1, -signal.SIGABRT)]
    launch(fake_torchrun(tmp_path, stderr, writes=own), termination_log)
    assert termination_log.read_text() == f"{own}\n"


def test_a_peers_broken_collective_is_replaced_by_the_rank_killed_without_a_word(
    tmp_path: Path, termination_log: Path
) -> None:
    echo = tag_exit_code(ExitCode.COMMUNICATION_ERROR, "communication error between ranks: Connection reset")
    peer = f"[default0]:E sftjob_trainer.failures: {EXITING} COMMUNICATION_ERROR (16): Connection reset"
    stderr = [peer, "[default1]:Fatal Python error: Segmentation fault", *report(1, -signal.SIGSEGV)]
    launch(fake_torchrun(tmp_path, stderr, writes=echo), termination_log)
    assert termination_log.read_text() == "rank 1 killed by SIGSEGV: Fatal Python error: Segmentation fault\n"


def test_a_root_cause_that_stopped_on_sigterm_keeps_its_own_sigterm_code(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = ["[default0]:exiting with PREEMPTED (20)", *report(0, ExitCode.PREEMPTED)]
    launch(fake_torchrun(tmp_path, stderr, writes=PREEMPTED_ECHO), termination_log)
    assert read_exit_tag(termination_log.read_text())[0] == ExitCode.PREEMPTED


def test_a_torchrun_that_failed_without_a_report_leaves_the_message_to_its_log(
    tmp_path: Path, termination_log: Path
) -> None:
    stderr = [
        "torch.distributed.DistStoreError: Timed out after 601 seconds waiting for clients. 1/2 clients"
    ]
    assert launch(fake_torchrun(tmp_path, stderr), termination_log).returncode == 1
    assert not termination_log.exists()


@pytest.mark.parametrize(
    ("code", "container_code"), [(0, 0), (3, 3), (-signal.SIGKILL, 128 + signal.SIGKILL)]
)
def test_the_launcher_ends_with_torchruns_exit_code(
    tmp_path: Path, termination_log: Path, code: int, container_code: int
) -> None:
    assert launch(fake_torchrun(tmp_path, [], code=code), termination_log).returncode == container_code
    assert not termination_log.exists()


def test_an_image_without_torchrun_is_a_config_error(tmp_path: Path, termination_log: Path) -> None:
    done = launch([str(tmp_path / "torchrun")], termination_log)
    assert done.returncode == ExitCode.CONFIG_ERROR
    said = read_message(termination_log.read_text())
    assert said.exit_code == ExitCode.CONFIG_ERROR and "cannot run" in said.summary


def test_a_sigterm_is_passed_on_to_torchrun_and_the_message_left_to_the_ranks(
    tmp_path: Path, termination_log: Path
) -> None:
    heard = tmp_path / "heard"
    script = tmp_path / "torchrun.py"
    script.write_text(
        "import signal, sys, time\n"
        "def stop(signum, frame):\n"
        f"    open({str(heard)!r}, 'w').write(str(signum))\n"
        f"    sys.stderr.write({as_text(report(1, -signal.SIGTERM))!r})\n"
        "    sys.exit(1)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        "print('[default0]:ready', file=sys.stderr, flush=True)\n"
        "time.sleep(30)\n"
    )
    env = os.environ | {"SFTJOB_TERMINATION_LOG": str(termination_log)}
    launcher = subprocess.Popen(
        [*LAUNCH, sys.executable, str(script)], env=env, stderr=subprocess.PIPE, text=True
    )
    try:
        assert launcher.stderr is not None and launcher.stderr.readline() == "[default0]:ready\n"
        launcher.send_signal(signal.SIGTERM)
        _, rest = launcher.communicate(timeout=20)
    finally:
        launcher.kill()
    assert launcher.returncode == 1 and "Root Cause" in rest
    assert heard.read_text() == str(int(signal.SIGTERM))
    assert not termination_log.exists()


def test_under_the_real_torchrun_the_aborted_rank_replaces_its_peers_sigterm_code(
    tmp_path: Path, termination_log: Path
) -> None:
    script = tmp_path / "ranks.py"
    script.write_text(ABORTING_RANK)
    torchrun = str(Path(sys.executable).with_name("torchrun"))
    command = [torchrun, "--standalone", "--nproc-per-node=2", "--tee=2", str(script)]
    done = launch(command, termination_log)
    assert done.returncode == 1
    assert "[default0]:rank 0 waiting in its all-reduce" in done.stderr
    assert "[default0]:wrote the SIGTERM code" in done.stderr  # the echo the launcher then replaced
    message = termination_log.read_text()
    expected = (
        "rank 1 killed by SIGABRT: watchdog: Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5)"
    )
    assert message == f"{expected}\n", message
