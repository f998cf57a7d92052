"""Restart decisions: permanent failures fail at once, transient ones back off, budgets end flapping,
CUDA OOM walks the planner's ladder, and every decision is re-derived from status alone."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from sftjob.attempts import AttemptRecord, RestartPolicy
from sftjob.failures import FREE_RESTART, PERMANENT, FailureClass
from sftjob.spec import SFTJobSpec
from sftjob_operator.attempt_policy import AttemptPolicy, GiveUp, NextAttempt
from sftjob_operator.planning import plan_candidates
from sftjob_operator.restarts import ADVICE, STATIC_OOM_ADVICE, GiveUpReason, backoff_seconds, next_attempt
from sftjob_operator.scheduling import default_products
from tests.unit.restart_cases import (
    A800,
    L40S,
    T0,
    candidates,
    failed,
    give_up,
    history_of,
    plan,
    policy_decision,
    restart,
    wait_of,
)

# --- the policy --------------------------------------------------------------------------------------


def test_the_first_attempt_starts_at_once_with_the_planners_plans() -> None:
    assert policy_decision([]) == NextAttempt(attempt=1, plans=candidates())


def test_a_resumed_job_starts_the_next_attempt_at_once() -> None:
    suspended = AttemptRecord(
        attempt=1, start_time=T0, end_time=T0 + timedelta(minutes=1), message="suspended"
    )
    assert policy_decision([suspended]) == NextAttempt(attempt=2, plans=candidates())


@pytest.mark.parametrize("cls", sorted(PERMANENT))
def test_permanent_failures_fail_the_job_at_once_with_advice(cls: FailureClass) -> None:
    result = give_up(policy_decision(history_of(cls)))
    assert result.reason == cls.value
    assert result.message.startswith(f"attempt 1 failed with {cls} (exit code 1): {cls} happened; ")
    assert result.message.endswith(f"; {ADVICE[cls]}")


@pytest.mark.parametrize("cls", sorted(PERMANENT))
def test_a_permanent_failure_says_to_delete_the_job_and_create_it_again_not_to_apply_it(
    cls: FailureClass,
) -> None:
    """A failed job is never judged again and its spec is immutable: applying it again changes nothing."""
    result = give_up(policy_decision(history_of(cls)))
    assert "delete the job and create it again" in result.message and "apply" not in result.message
    assert "checkpoints.keepOnDelete" in result.message and "ownerReferences" in result.message


@pytest.mark.parametrize(
    "cls",
    [
        FailureClass.UNKNOWN,
        FailureClass.STALLED,
        FailureClass.STORAGE_ERROR,
        FailureClass.COMMUNICATION_ERROR,
        FailureClass.NETWORK_ERROR,
    ],
)
def test_transient_failures_restart_after_the_backoff(cls: FailureClass) -> None:
    history = history_of(cls)
    decision = restart(policy_decision(history))
    assert decision.attempt == 2
    assert wait_of(decision, history) == 10


def test_backoff_doubles_per_counted_failure_and_is_capped() -> None:
    policy = RestartPolicy(backoff_seconds=10, max_backoff_seconds=60, max_restarts=10)
    waits = []
    for n in range(1, 6):
        history = history_of(*[FailureClass.UNKNOWN] * n)
        waits.append(wait_of(policy_decision(history, policy), history))
    assert waits == [10, 20, 40, 60, 60]
    assert backoff_seconds(policy, 0) == 0


def test_the_failure_after_max_restarts_fails_the_job() -> None:
    policy = RestartPolicy(max_restarts=3)
    assert isinstance(policy_decision(history_of(*[FailureClass.UNKNOWN] * 3), policy), NextAttempt)
    result = give_up(policy_decision(history_of(*[FailureClass.UNKNOWN] * 4), policy))
    assert result.reason == GiveUpReason.RESTART_LIMIT_EXCEEDED
    assert "4 failures exceed restartPolicy.maxRestarts 3" in result.message


def test_max_restarts_zero_fails_on_the_first_failure() -> None:
    result = give_up(policy_decision(history_of(FailureClass.STALLED), RestartPolicy(max_restarts=0)))
    assert result.reason == "RestartLimitExceeded"


def test_preemptions_and_node_loss_restart_at_once_without_consuming_max_restarts() -> None:
    reasons = [FailureClass.UNKNOWN] * 3 + [FailureClass.PREEMPTED, FailureClass.NODE_LOST] * 3
    decision = restart(policy_decision(history_of(*reasons), RestartPolicy(max_restarts=3)))
    assert decision.not_before is None and decision.attempt == 10


def test_interruptions_are_bounded_separately_so_a_flapping_cluster_still_ends() -> None:
    policy = RestartPolicy(max_interruptions=2)
    assert isinstance(policy_decision(history_of(*[FailureClass.PREEMPTED] * 2), policy), NextAttempt)
    result = give_up(policy_decision(history_of(*[FailureClass.PREEMPTED] * 3), policy))
    assert result.reason == GiveUpReason.INTERRUPTION_LIMIT_EXCEEDED
    assert "maxInterruptions 2" in result.message


def test_a_cuda_oom_re_plans_at_once_without_consuming_max_restarts() -> None:
    history = [*history_of(*[FailureClass.UNKNOWN] * 3), failed(4, FailureClass.CUDA_OOM)]
    decision = restart(policy_decision(history, RestartPolicy(max_restarts=3)))
    assert decision.not_before is None
    assert decision.plans.first.training.micro_batch_size == 2
    assert (decision.ladder_step, decision.message) == ("halved", f"{A800}: halved")


def test_on_oom_retry_keeps_the_plan_and_consumes_the_budget() -> None:
    history = history_of(FailureClass.CUDA_OOM)
    decision = restart(policy_decision(history, RestartPolicy(on_oom="Retry")))
    assert decision.plans == candidates() and wait_of(decision, history) == 10


def test_on_oom_fail_fails_the_job_at_once() -> None:
    result = give_up(policy_decision(history_of(FailureClass.CUDA_OOM), RestartPolicy(on_oom="Fail")))
    assert result.reason == "CudaOOM" and "onOOM is Fail" in result.message


def test_an_oom_on_one_gpu_type_leaves_the_other_types_plan_alone() -> None:
    plans = candidates(plan(A800), plan(L40S))
    decision = restart(policy_decision(history_of(FailureClass.CUDA_OOM, gpu=L40S), plans=plans))
    assert decision.plans.plans[A800] == plan(A800)
    assert decision.plans.plans[L40S].training.micro_batch_size == 2


def test_an_exhausted_ladder_moves_the_job_to_a_card_with_more_memory() -> None:
    plans = candidates(plan(L40S, micro_batch=1, accumulation=32), plan(A800))
    decision = restart(policy_decision(history_of(FailureClass.CUDA_OOM, gpu=L40S), plans=plans))
    assert decision.plans.allowed_products() == ["NVIDIA-A800-SXM4-80GB"]
    assert decision.plans.first.gpu == A800


def test_an_exhausted_ladder_rules_out_cards_with_no_more_memory() -> None:
    plans = candidates(plan(A800, micro_batch=1, accumulation=32), plan(L40S))
    history = [failed(1, FailureClass.CUDA_OOM, gpu=L40S), failed(2, FailureClass.CUDA_OOM)]
    result = give_up(policy_decision(history, plans=plans))
    assert result.reason == GiveUpReason.OOM_LADDER_EXHAUSTED
    assert f"{A800}: exhausted" in result.message


def test_faulty_gpu_nodes_do_not_consume_max_restarts_however_long_the_job_runs() -> None:
    reasons = [
        FailureClass.GPU_UNAVAILABLE,
        FailureClass.COMMUNICATION_ERROR,
        FailureClass.STALLED,
        FailureClass.DRIVER_MISMATCH,
        FailureClass.GPU_UNAVAILABLE,
        FailureClass.UNKNOWN,
    ]
    history = [failed(i, r, node=f"gpu-{i}") for i, r in enumerate(reasons, start=1)]
    policy = RestartPolicy(max_restarts=3)
    assert restart(policy_decision(history, policy)).avoid_nodes == ("gpu-1", "gpu-4", "gpu-5")
    four = give_up(policy_decision([*history, failed(7, FailureClass.UNKNOWN)], policy))
    assert "4 failures exceed restartPolicy.maxRestarts 3" in four.message


def test_a_faulty_gpu_node_restarts_elsewhere_after_the_backoff() -> None:
    history = history_of(FailureClass.UNKNOWN, FailureClass.DRIVER_MISMATCH, node="old-driver")
    assert wait_of(policy_decision(history), history) == 20  # the second failure that backs off


def test_faulty_gpu_nodes_count_as_interruptions_so_a_cluster_of_broken_nodes_still_ends() -> None:
    policy = RestartPolicy(max_interruptions=3)
    history = [
        failed(1, FailureClass.PREEMPTED, node="a"),
        failed(2, FailureClass.GPU_UNAVAILABLE, node="b"),
        failed(3, FailureClass.DRIVER_MISMATCH, node="c"),
    ]
    assert isinstance(policy_decision(history, policy), NextAttempt)
    result = give_up(policy_decision([*history, failed(4, FailureClass.GPU_UNAVAILABLE, node="d")], policy))
    assert result.reason == GiveUpReason.INTERRUPTION_LIMIT_EXCEEDED
    assert "4 preemptions, node losses or GPU and driver faults exceed" in result.message
    assert result.message.endswith("maxInterruptions 3 (nodes at fault: b, c, d)")


def test_lost_and_faulty_nodes_and_repeated_nccl_breakers_are_avoided() -> None:
    history = [
        failed(1, FailureClass.NODE_LOST, node="lost"),
        failed(2, FailureClass.GPU_UNAVAILABLE, node="xid"),
        failed(3, FailureClass.DRIVER_MISMATCH, node="old-driver"),
        failed(4, FailureClass.COMMUNICATION_ERROR, node="flaky"),
        failed(5, FailureClass.COMMUNICATION_ERROR, node="once"),
        failed(6, FailureClass.COMMUNICATION_ERROR, node="flaky"),
    ]
    decision = restart(policy_decision(history, RestartPolicy(max_restarts=10)))
    assert decision.avoid_nodes == ("flaky", "lost", "old-driver", "xid")
    assert "preferring nodes other than flaky, lost, old-driver, xid" in decision.message


def test_a_communication_error_on_pcie_only_gpus_keeps_nccl_p2p_to_nvlink_in_every_candidates_plan() -> None:
    plans = candidates(plan(A800, per_node=4), plan(L40S, per_node=4))
    decision = restart(policy_decision(history_of(FailureClass.COMMUNICATION_ERROR, gpu=L40S), plans=plans))
    # The pod's environment comes from the first plan (the A800 SXM4's) wherever it lands: it must carry it.
    assert decision.plans.first.gpu == A800
    assert all(p.env["NCCL_P2P_LEVEL"] == "NVL" for p in decision.plans.plans.values())
    assert "NCCL P2P over NVLink only after a communication error on L40S" in decision.message
    nvlink = restart(policy_decision(history_of(FailureClass.COMMUNICATION_ERROR, gpu=A800), plans=plans))
    assert all("NCCL_P2P_LEVEL" not in p.env for p in nvlink.plans.plans.values())


def test_one_gpu_per_node_has_no_p2p_to_turn_off_after_a_communication_error() -> None:
    history = history_of(FailureClass.COMMUNICATION_ERROR, gpu=L40S)
    decision = restart(policy_decision(history, plans=candidates(plan(L40S, per_node=1))))
    assert "NCCL_P2P_LEVEL" not in decision.plans.first.env and "NCCL P2P" not in decision.message


def test_a_rendezvous_that_gave_up_on_a_missing_peer_neither_avoids_the_node_nor_disables_p2p() -> None:
    waited = "DistStoreError: Timed out after 86401 seconds waiting for clients. 1/2 clients joined."
    history = [
        r.model_copy(update={"message": waited})
        for r in history_of(FailureClass.COMMUNICATION_ERROR, FailureClass.COMMUNICATION_ERROR, gpu=L40S)
    ]
    decision = restart(policy_decision(history, plans=candidates(plan(L40S, per_node=4))))
    assert decision.avoid_nodes == ()
    assert "NCCL_P2P_LEVEL" not in decision.plans.first.env
    assert decision.not_before is not None  # still a failure of the job's own: it backs off and counts


def test_the_decision_after_an_operator_restart_equals_the_decision_before() -> None:
    history = [
        failed(1, FailureClass.CUDA_OOM),
        failed(2, FailureClass.HOST_OOM),
        failed(3, FailureClass.NODE_LOST, node="gone"),
        failed(4, FailureClass.UNKNOWN),
    ]
    stored = [r.model_dump(mode="json", by_alias=True, exclude_none=True) for r in history]
    reloaded = [AttemptRecord.model_validate(r) for r in stored]
    before, after = policy_decision(history), policy_decision(reloaded)
    assert before == after
    assert restart(after).not_before == T0 + timedelta(minutes=40, seconds=20)  # mid-backoff: same deadline


def test_the_running_attempt_is_rendered_from_the_history_before_it() -> None:
    history = history_of(FailureClass.CUDA_OOM, FailureClass.UNKNOWN)
    restarted = restart(policy_decision(history))
    rendered = restart(policy_decision(history[:1]))
    assert rendered.plans == restarted.plans and rendered.attempt == 2


# --- with the real planner's OOM ladder -------------------------------------------------------------


def qwen7b_spec(gpu: dict[str, Any] | None = None, **training: Any) -> SFTJobSpec:
    return SFTJobSpec.model_validate(
        {
            "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
            "dataset": {"name": "org/chats", "maxSeqLength": 2048},
            "gpu": gpu or {"type": "A800"},
            "training": {"globalBatchSize": 4, **training},
        }
    )


def planned(spec: SFTJobSpec, history: list[AttemptRecord]) -> NextAttempt | GiveUp:
    plans = plan_candidates(spec, default_products())
    return next_attempt(spec, history, plans, nodes={}, now=T0)


def test_cuda_oom_twice_halves_the_micro_batch_then_turns_on_checkpointing_keeping_the_global_batch() -> None:
    spec = qwen7b_spec()
    first = restart(planned(spec, [])).plans.first.training
    assert (first.micro_batch_size, first.gradient_accumulation_steps, first.gradient_checkpointing) == (
        2,
        2,
        False,
    )

    once = restart(planned(spec, history_of(FailureClass.CUDA_OOM)))
    t = once.plans.first.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (1, 4, 4)
    assert not t.gradient_checkpointing
    assert once.ladder_step is not None and "micro-batch 2 -> 1" in once.ladder_step

    twice = restart(planned(spec, history_of(FailureClass.CUDA_OOM, FailureClass.CUDA_OOM)))
    t = twice.plans.first.training
    assert (t.micro_batch_size, t.gradient_accumulation_steps, t.global_batch_size) == (1, 4, 4)
    assert t.gradient_checkpointing
    assert twice.ladder_step is not None and "gradient checkpointing on" in twice.ladder_step
    assert len(twice.plans.first.ladder) == 2


def test_a_rung_of_the_oom_ladder_keeps_the_workers_and_threads_the_users_cpus_set() -> None:
    body = qwen7b_spec().model_dump(by_alias=True, exclude_none=True)
    spec = SFTJobSpec.model_validate(body | {"resources": {"cpu": "2"}})
    first = restart(planned(spec, [])).plans.first
    rung = restart(planned(spec, history_of(FailureClass.CUDA_OOM))).plans.first
    assert rung.ladder and first.training.dataloader_workers == rung.training.dataloader_workers == 1
    assert first.env["OMP_NUM_THREADS"] == rung.env["OMP_NUM_THREADS"] == "1"
    assert rung.resources.cpu == "2"


def test_a_cuda_oom_steps_down_the_ladder_of_every_card_with_the_same_memory_not_a_smaller_ones() -> None:
    spec = qwen7b_spec()  # A800: the SXM4 80GB (the OOM), the PCIe 80GB (same memory), the PCIe 40GB
    plans = restart(planned(spec, history_of(FailureClass.CUDA_OOM))).plans.plans
    (rung,) = plans["A800-SXM4-80GB"].ladder
    assert "micro-batch 2 -> 1" in rung and plans["A800-PCIE-80GB"].ladder == [rung]
    assert plans["A800-PCIE-40GB"].ladder == []


def test_a_card_of_the_same_memory_planned_otherwise_keeps_its_plan_after_a_cuda_oom() -> None:
    plans = candidates(plan(A800, micro_batch=4), plan("A800-PCIE-80GB", micro_batch=16, accumulation=2))
    adjusted = restart(policy_decision(history_of(FailureClass.CUDA_OOM), plans=plans)).plans.plans
    assert adjusted[A800].ladder == ["halved"] and adjusted["A800-PCIE-80GB"].ladder == []


def test_a_job_that_cannot_be_made_to_fit_fails_with_the_ladder() -> None:
    spec = qwen7b_spec(packing=False)
    result = give_up(planned(spec, history_of(*[FailureClass.CUDA_OOM] * 3)))
    assert result.reason == GiveUpReason.OOM_LADDER_EXHAUSTED
    for step in ("micro-batch 2 -> 1", "gradient checkpointing on", "exhausted"):
        assert step in result.message


def test_an_exhausted_ladder_says_what_the_planner_found_would_fit_rather_than_generic_advice() -> None:
    result = give_up(planned(qwen7b_spec(packing=False), history_of(*[FailureClass.CUDA_OOM] * 3)))
    assert "exhausted after OOM at micro-batch 1 x accumulation 4, checkpointing, rows of 2048); try: " in (
        result.message
    )
    assert f"method qlora fits on 1 x {A800}" in result.message
    assert ADVICE[FailureClass.CUDA_OOM] not in result.message


def test_an_exhausted_ladder_suggests_nothing_a_card_that_never_fitted_planned_before_any_oom() -> None:
    spec = SFTJobSpec.model_validate(
        {"model": {"name": "Qwen/Qwen2.5-32B-Instruct"}, "method": "lora",
         "dataset": {"name": "org/chats", "maxSeqLength": 2048},
         "gpu": {"types": ["A800", "L40S"], "count": 2}, "training": {"globalBatchSize": 4, "packing": False}}
    )  # fmt: skip
    plans = plan_candidates(spec, default_products())
    assert plans.plans[A800].fits and not plans.plans[L40S].fits
    result = give_up(
        next_attempt(spec, history_of(*[FailureClass.CUDA_OOM] * 4, gpu=A800), plans, nodes={}, now=T0)
    )
    assert f"fits on 2 x {A800}" not in result.message  # the setup that ran out of memory
    assert not [s for s in plans.plans[L40S].suggestions if s in result.message]


def test_an_exhausted_ladder_the_planner_has_no_suggestion_for_ends_with_the_generic_advice() -> None:
    plans = candidates(plan(micro_batch=1, accumulation=32))
    result = give_up(policy_decision(history_of(FailureClass.CUDA_OOM), plans=plans))
    assert result.message.endswith(f"; {ADVICE[FailureClass.CUDA_OOM]}")


def test_a_job_whose_ladder_runs_out_on_its_preferred_card_moves_to_a_bigger_one() -> None:
    spec = qwen7b_spec({"types": ["L40S", "A800"]}, packing=False)
    plans = plan_candidates(spec, default_products())
    assert plans.first.gpu == L40S
    decision = restart(
        next_attempt(spec, history_of(*[FailureClass.CUDA_OOM] * 3, gpu=L40S), plans, nodes={}, now=T0)
    )
    assert L40S not in decision.plans.fitting
    assert decision.plans.first.gpu == A800 and decision.plans.first.ladder == []


def test_the_policy_plugs_into_the_reconcile_and_starts_the_first_attempt_with_the_planners_plans() -> None:
    policy: AttemptPolicy = next_attempt
    spec = qwen7b_spec()
    plans = plan_candidates(spec, default_products())
    assert policy(spec, [], plans, nodes={}, now=T0) == NextAttempt(attempt=1, plans=plans)


# --- an OOM outside the forward and backward passes ---------------------------------------------------


def oom_at(attempt: int, reason: str, gpu: str = A800) -> AttemptRecord:
    return failed(attempt, FailureClass.CUDA_OOM, gpu=gpu).model_copy(update={"message": reason})


LOADING = "CUDA out of memory while loading the model from Qwen/Qwen2.5-7B-Instruct: CUDA out of memory."


@pytest.mark.parametrize(
    "reason",
    [
        LOADING,
        "CUDA out of memory in the optimizer step: CUDA out of memory. Tried to allocate 14.00 GiB",
        "CUDA out of memory while saving a checkpoint: CUDA out of memory. Tried to allocate 2.00 GiB",
    ],
)
def test_an_oom_outside_the_forward_and_backward_passes_skips_the_ladder_whose_rungs_only_lower_those(
    reason: str,
) -> None:
    result = give_up(planned(qwen7b_spec(), [oom_at(1, reason)]))
    where = reason.removeprefix("CUDA out of memory ").split(":")[0]
    assert result.reason == GiveUpReason.OOM_LADDER_EXHAUSTED
    assert f"exhausted after OOM {where}, outside the forward and backward passes" in result.message
    assert "micro-batch" not in result.message and "maxSeqLength" not in result.message
    assert result.message.endswith(f"; {STATIC_OOM_ADVICE}")


def test_an_oom_while_loading_moves_a_job_allowed_a_bigger_card_there_at_once() -> None:
    spec = qwen7b_spec({"types": ["L40S", "A800"]}, packing=False)
    decision = restart(planned(spec, [oom_at(1, LOADING, gpu=L40S)]))
    assert L40S not in decision.plans.fitting
    assert decision.plans.first.gpu == A800 and decision.plans.first.ladder == []


def test_an_oom_outside_the_passes_after_rungs_already_taken_ends_the_ladder_there() -> None:
    history = [failed(1, FailureClass.CUDA_OOM), oom_at(2, LOADING)]
    result = give_up(policy_decision(history))
    assert f"{A800}: halved; exhausted after OOM while loading the model" in result.message


def test_on_oom_fail_after_an_oom_while_loading_gives_the_advice_for_the_models_own_memory() -> None:
    result = give_up(policy_decision([oom_at(1, LOADING)], RestartPolicy(on_oom="Fail")))
    assert result.message.endswith(f"onOOM is Fail: {STATIC_OOM_ADVICE}")


# --- advice when the restarts run out ----------------------------------------------------------------


def test_every_class_that_can_use_up_max_restarts_gives_advice_when_it_does() -> None:
    counted = set(FailureClass) - FREE_RESTART - PERMANENT
    assert counted <= ADVICE.keys()


@pytest.mark.parametrize(
    ("cls", "advice"),
    [
        (FailureClass.STORAGE_ERROR, "checkpoints.size"),
        (FailureClass.COMMUNICATION_ERROR, "NCCL_SOCKET_IFNAME"),
        (FailureClass.STALLED, "stallTimeoutSeconds"),
        (FailureClass.UNKNOWN, "pod logs"),
    ],
)
def test_restart_limit_exceeded_says_what_to_change_for_the_class_that_used_it_up(
    cls: FailureClass, advice: str
) -> None:
    result = give_up(policy_decision(history_of(*[cls] * 4), RestartPolicy(max_restarts=3)))
    assert result.reason == GiveUpReason.RESTART_LIMIT_EXCEEDED
    assert result.message.endswith(f"maxRestarts 3; {ADVICE[cls]}") and advice in ADVICE[cls]
