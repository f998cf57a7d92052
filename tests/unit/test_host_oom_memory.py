"""After a host OOM the next attempt asks for more memory: 1.5 times per OOM, up to nine tenths of the
allocatable memory of the smallest node with the plan's GPU, so that every rank can still be scheduled; a
card whose nodes leave no room for a raise is skipped, and the job fails once no card is left."""

from __future__ import annotations

from sftjob.attempts import AttemptRecord
from sftjob.failures import FailureClass
from sftjob.plan import Plan
from sftjob_operator.host_memory import raised_memory
from sftjob_operator.restarts import GiveUpReason
from tests.unit.restart_cases import (
    A800,
    L40S,
    candidates,
    failed,
    give_up,
    history_of,
    node,
    plan,
    policy_decision,
    restart,
)

A800_PRODUCT, L40S_PRODUCT = "NVIDIA-A800-SXM4-80GB", "NVIDIA-L40S"


def test_the_host_oom_memory_bump_keeps_the_users_resources_through_re_plans() -> None:
    history = [failed(1, FailureClass.CUDA_OOM), failed(2, FailureClass.HOST_OOM)]
    decision = restart(policy_decision(history, plans=candidates(plan(memory="100Gi"))))
    assert decision.plans.first.resources.memory == "153600Mi"  # 100Gi x 1.5, re-plan or not


def test_host_oom_raises_the_memory_request_up_to_nine_tenths_of_node_allocatable_then_fails() -> None:
    nodes = {"gpu-0": node("gpu-0", "134217728Ki")}  # 128 GiB

    def memory_after(n: int) -> str:
        decision = policy_decision(history_of(*[FailureClass.HOST_OOM] * n), nodes=nodes)
        return restart(decision).plans.first.resources.memory

    assert memory_after(1) == "98304Mi"  # 64Gi x 1.5
    assert memory_after(2) == "117964Mi"  # 144Gi capped at 90% of the node's 128Gi: DaemonSets need room
    result = give_up(policy_decision(history_of(*[FailureClass.HOST_OOM] * 3), nodes=nodes))
    assert result.reason == GiveUpReason.HOST_MEMORY_EXHAUSTED
    assert "cannot be raised 10% more within 90% of the smallest allocatable of the nodes with its GPU" in (
        result.message
    )
    assert "(A800-SXM4-80GB: 134217728Ki)" in result.message
    assert "spec.resources.memory" not in result.message  # more than the nodes have would stay Pending
    assert "spec.resources.cpu" in result.message and "delete the job and create it again" in result.message


def test_host_oom_gives_up_when_the_cap_leaves_less_than_a_tenth_more_memory() -> None:
    nodes = {"gpu-0": node("gpu-0", "100Gi")}
    assert raised_memory("64Gi", 1, "100Gi") == "92160Mi"  # 96Gi wanted, 90Gi allowed
    assert raised_memory("64Gi", 2, "100Gi") is None  # the attempt that failed already had the 90Gi
    assert raised_memory("88Gi", 1, "100Gi") is None  # 90Gi would be 2% more: no raise worth a restart
    assert raised_memory("100Gi", 1, "100Gi") is None  # the user asked for all of it
    history = history_of(FailureClass.HOST_OOM, FailureClass.HOST_OOM)
    assert give_up(policy_decision(history, nodes=nodes)).reason == GiveUpReason.HOST_MEMORY_EXHAUSTED


def test_host_oom_on_a_node_that_is_gone_still_raises_memory() -> None:
    decision = restart(policy_decision(history_of(FailureClass.HOST_OOM)))
    assert decision.plans.first.resources.memory == "98304Mi"
    assert "memory 64Gi -> 98304Mi after host OOM" in decision.message


def test_the_raise_is_capped_by_the_smallest_node_with_the_plans_gpu_not_the_node_that_ran_out() -> None:
    nodes = {
        "gpu-0": node("gpu-0", "512Gi", A800_PRODUCT),  # ran out of memory
        "small": node("small", "128Gi", A800_PRODUCT),  # where the second rank may land
        "l40s": node("l40s", "64Gi", L40S_PRODUCT),  # another card's: no bound on the A800's plan
        "cpu": node("cpu", "32Gi"),
    }
    history = history_of(FailureClass.HOST_OOM, FailureClass.HOST_OOM)
    assert restart(policy_decision(history, nodes=nodes)).plans.first.resources.memory == "117964Mi"


def test_a_host_oom_on_a_node_that_is_gone_is_capped_by_the_nodes_left_with_its_gpu() -> None:
    nodes = {"small": node("small", "128Gi", A800_PRODUCT)}
    history = history_of(FailureClass.HOST_OOM, FailureClass.HOST_OOM)  # on gpu-0, deleted since
    assert restart(policy_decision(history, nodes=nodes)).plans.first.resources.memory == "117964Mi"


def test_a_card_whose_nodes_leave_no_room_for_a_raise_is_skipped_for_a_card_whose_nodes_do() -> None:
    plans = candidates(plan(L40S, memory="224Gi"), plan(A800, memory="64Gi"))
    nodes = {"l40s": node("l40s", "256Gi", L40S_PRODUCT), "a800": node("a800", "1Ti", A800_PRODUCT)}
    decision = restart(
        policy_decision([failed(1, FailureClass.HOST_OOM, node="l40s", gpu=L40S)], plans=plans, nodes=nodes)
    )
    # The pod asked for the L40S plan's 224Gi (the most of the two cards' plans) and ran out with it.
    assert (decision.plans.first.gpu, decision.plans.first.resources.memory) == (A800, "344064Mi")
    assert not decision.plans.plans[L40S].fits
    assert "L40S: skipped, no room to raise the memory request within 256Gi" in decision.message
    assert "memory 224Gi -> 344064Mi after host OOM" in decision.message


def test_a_card_that_does_not_fit_anyway_never_makes_a_host_oom_fail_the_job() -> None:
    unfit = plan(A800, memory="240Gi").model_copy(update={"fits": False})
    nodes = {"l40s": node("l40s", "256Gi", L40S_PRODUCT)}
    history = [failed(1, FailureClass.HOST_OOM, node="l40s", gpu=L40S)]
    decision = restart(policy_decision(history, plans=candidates(plan(L40S), unfit), nodes=nodes))
    assert decision.plans.first.resources.memory == "98304Mi"


def _split(memory: str, worker: str) -> Plan:
    """A multi-node sharded plan: node rank 0's pod loads the model, the other nodes' pods do not."""
    resources = plan().resources.model_copy(update={"memory": memory, "worker_memory": worker})
    return plan().model_copy(update={"resources": resources})


def _ooms(*node_ranks: int | None) -> list[AttemptRecord]:
    return [
        r.model_copy(update={"node_rank": n})
        for r, n in zip(history_of(*[FailureClass.HOST_OOM] * len(node_ranks)), node_ranks, strict=True)
    ]


def _after(history: list[AttemptRecord], split: Plan, allocatable: str) -> tuple[str, str | None]:
    nodes = {"gpu-0": node("gpu-0", allocatable, A800_PRODUCT)}
    raised = restart(policy_decision(history, plans=candidates(split), nodes=nodes)).plans.first.resources
    return raised.memory, raised.worker_memory


def test_a_host_oom_raises_the_memory_of_the_pods_that_ran_out_node_rank_zeros_or_the_others() -> None:
    split = _split("64Gi", "40Gi")
    assert _after(_ooms(1), split, "1Ti") == ("64Gi", "61440Mi")  # another node's pod: 40Gi x 1.5
    assert _after(_ooms(0), split, "1Ti") == ("98304Mi", "40Gi")  # node rank 0's: 64Gi x 1.5
    assert _after(_ooms(1, 2, 0), split, "1Ti") == ("98304Mi", "92160Mi")  # 40Gi x 1.5 x 1.5
    decision = restart(policy_decision(_ooms(1), plans=candidates(split)))
    assert (
        "memory 64Gi -> 64Gi (node rank 0), 40Gi -> 61440Mi (other nodes) after host OOM" in decision.message
    )


def test_the_other_nodes_pods_grow_after_node_rank_zeros_pod_reached_its_cap() -> None:
    # Node rank 0's 456Gi (Llama 70B full on 8 nodes) is near the cap of 500Gi nodes; the others' 88Gi is not.
    split = _split("456Gi", "88Gi")
    assert _after(_ooms(3), split, "500Gi") == ("456Gi", "135168Mi")
    assert _after(_ooms(None), split, "500Gi") == ("460800Mi", "135168Mi")  # not known: both, to the cap
    nodes = {"gpu-0": node("gpu-0", "500Gi", A800_PRODUCT)}
    ran_out_first = give_up(policy_decision(_ooms(0), plans=candidates(split), nodes=nodes))
    assert ran_out_first.reason == GiveUpReason.HOST_MEMORY_EXHAUSTED  # 456Gi cannot grow 10% within 450Gi


def test_a_host_oom_raises_from_what_the_pods_asked_for_not_a_card_the_oom_ladder_ruled_out_before() -> None:
    plans = candidates(plan(A800, memory="64Gi"), plan(L40S, micro_batch=2, memory="200Gi"))
    history = [
        failed(1, FailureClass.CUDA_OOM, gpu=L40S),
        failed(2, FailureClass.CUDA_OOM, gpu=L40S),  # the L40S's ladder is done: the pods ask for 64Gi
        failed(3, FailureClass.HOST_OOM, gpu=A800),
    ]
    decision = restart(policy_decision(history, plans=plans))
    assert decision.plans.first.resources.memory == "98304Mi"  # 64Gi x 1.5
    assert "memory 64Gi -> 98304Mi after host OOM" in decision.message
