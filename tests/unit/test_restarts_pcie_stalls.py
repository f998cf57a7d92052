"""A Stalled attempt says nothing about the PCIe links: a slow tokenisation, volume read or download that
stopped growing stalls just as a P2P hang would, and the trainer's communication probe turns a P2P hang
at start into a CommunicationError. So a stall never switches NCCL's P2P over PCIe off."""

from __future__ import annotations

from sftjob.attempts import AttemptRecord
from sftjob.config import DistributedSettings
from sftjob.failures import FailureClass
from sftjob.plan import Plan
from sftjob_operator.attempt_end import end_record
from sftjob_operator.restarts import pcie_links_broken
from tests.unit.classify_cases import NOW, classify, pod, running
from tests.unit.restart_cases import A800, L40S, T0, candidates, plan, policy_decision, restart

STALL_TIMEOUT = 1800


def on_gpus(p: Plan, per_node: int) -> Plan:
    return p.model_copy(update={"distributed": DistributedSettings(nproc_per_node=per_node)})


def test_a_multi_gpu_pcie_attempt_that_stalled_before_its_first_step_leaves_p2p_alone() -> None:
    outcome = classify(
        pod("Running", state=running(started_seconds_ago=STALL_TIMEOUT + 100)),
        stall_timeout_seconds=STALL_TIMEOUT,
    )
    assert outcome.failure_class is FailureClass.STALLED
    record = AttemptRecord(attempt=1, node="l40s-0", gpu=L40S, start_time=T0)
    hung = end_record(record, outcome, end_time=NOW, progress_step=None, checkpoint_step=None)
    assert hung.message == outcome.message
    plans = candidates(plan(A800), on_gpus(plan(L40S), 4))
    decision = restart(policy_decision([hung], plans=plans))
    assert all("NCCL_P2P_LEVEL" not in p.env for p in decision.plans.plans.values())
    assert "NCCL P2P" not in decision.message
    assert pcie_links_broken([L40S], [hung]) == []
