"""A P2P hang on PCIe-only GPUs usually ends as Stalled, not as an NCCL error: the stall timeout fires
before NCCL's own 30 minutes. A multi-GPU attempt on such a card that stalled before its first training
step turns P2P over PCIe off for the next attempts, as a CommunicationError there does."""

from __future__ import annotations

from sftjob.attempts import AttemptRecord
from sftjob.config import DistributedSettings
from sftjob.failures import FailureClass
from sftjob.plan import Plan
from sftjob_operator.classify import end_record, stalled_before_training
from sftjob_operator.restarts import SAFE_PCIE_NCCL_ENV, pcie_links_broken
from tests.unit.classify_cases import NOW, classify, pod, running
from tests.unit.restart_cases import A800, L40S, T0, candidates, plan, policy_decision, restart

STALL_TIMEOUT = 1800


def on_gpus(p: Plan, per_node: int) -> Plan:
    return p.model_copy(update={"distributed": DistributedSettings(nproc_per_node=per_node)})


def stalled(attempt: int, *, gpu: str = L40S, resumed: int | None, reported: int | None) -> AttemptRecord:
    """Attempt ``attempt`` as the reconcile records it after the stall check ended it: it resumed from
    step ``resumed`` and its trainer last reported step ``reported`` (None: it reported nothing)."""
    outcome = classify(
        pod("Running", state=running(started_seconds_ago=STALL_TIMEOUT + 100)),
        stall_timeout_seconds=STALL_TIMEOUT,
    )
    assert outcome.failure_class is FailureClass.STALLED
    record = AttemptRecord(attempt=attempt, node="l40s-0", gpu=gpu, start_time=T0, resumed_from_step=resumed)
    return end_record(record, outcome, end_time=NOW, progress_step=reported, checkpoint_step=resumed)


def test_an_attempt_that_stalled_before_reporting_a_step_past_its_resume_step_says_so() -> None:
    assert stalled_before_training(stalled(1, resumed=None, reported=None))
    assert stalled_before_training(stalled(2, resumed=200, reported=200))  # setup phases report step 200
    assert not stalled_before_training(stalled(3, resumed=200, reported=240))


def test_a_multi_gpu_pcie_attempt_that_hung_before_its_first_step_turns_p2p_over_pcie_off() -> None:
    plans = candidates(plan(A800), on_gpus(plan(L40S), 4))
    decision = restart(policy_decision([stalled(1, resumed=None, reported=None)], plans=plans))
    # Every candidate's plan carries it: the pod's environment comes from the first (A800) plan.
    assert all(
        p.env["NCCL_P2P_LEVEL"] == SAFE_PCIE_NCCL_ENV["NCCL_P2P_LEVEL"] for p in decision.plans.plans.values()
    )
    assert "NCCL P2P over NVLink only after a communication error or a stall before training on L40S" in (
        decision.message
    )


def test_stalls_at_the_start_of_a_multi_gpu_pcie_job_count_as_broken_links() -> None:
    history = [stalled(n, resumed=None, reported=None) for n in (1, 2, 3)]
    assert pcie_links_broken({L40S: on_gpus(plan(L40S), 2)}, history) == [L40S]


def test_a_stall_after_training_began_leaves_p2p_alone() -> None:
    plans = candidates(on_gpus(plan(L40S), 4))
    decision = restart(policy_decision([stalled(1, resumed=200, reported=260)], plans=plans))
    assert "NCCL_P2P_LEVEL" not in decision.plans.first.env


def test_a_stall_with_one_gpu_per_node_or_on_nvlink_gpus_leaves_p2p_alone() -> None:
    hung = stalled(1, resumed=None, reported=None)
    assert pcie_links_broken({L40S: on_gpus(plan(L40S), 1)}, [hung]) == []
    on_a800 = hung.model_copy(update={"gpu": A800})
    assert pcie_links_broken({A800: on_gpus(plan(A800), 8)}, [on_a800]) == []
