"""The restart policy: after each attempt, the next one (when, with which plans, avoiding which
nodes) or the reason the job fails.

:func:`next_attempt` is the reconcile's :data:`~sftjob_operator.attempt_policy.AttemptPolicy`. It is a
pure function of ``spec.restartPolicy``, the attempt history in ``status.attempts``, the planner's
plans and the nodes: everything lives in the API server, and the next attempt's settings (the
OOM-laddered plans, the raised memory, the nodes to avoid, safer NCCL settings) are re-derived from
the whole history on every pass. An operator killed mid-backoff or mid-re-plan therefore decides
the same thing after it starts again. ``docs/failures.md`` describes the rules for users.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from datetime import datetime, timedelta
from enum import StrEnum

from sftjob.attempts import AttemptRecord, RestartPolicy, follows_the_job, not_the_jobs_fault
from sftjob.failures import CUDA_OOM_REASON, NODE_FAULT, PERMANENT, FailureClass, oom_phase
from sftjob.gpus import profile_for_key
from sftjob.job_plan import with_user_resources
from sftjob.plan import Plan
from sftjob.planner import replan_after_oom
from sftjob.spec import SFTJobSpec, to_plan_request
from sftjob_operator.attempt_end import peer_never_joined
from sftjob_operator.attempt_policy import GiveUp, NextAttempt
from sftjob_operator.host_memory import NodeObj, raise_host_memory
from sftjob_operator.planning import CandidatePlans

# Cards whose memory differs by at most this share share an OOM ladder (L40S 44.42 GiB, A40 44.35).
SAME_MEMORY_TOLERANCE = 0.01

# Takes the plan that ran out of GPU memory, returns the next rung of the ladder (same global batch;
# ``fits=False`` once no rung is left).
Replanner = Callable[[Plan], Plan]

# A node that produced this many communication errors is avoided by later attempts.
COMMUNICATION_ERRORS_TO_AVOID_NODE = 2
# NCCL's slow-but-safe setting for PCIe-only GPUs whose P2P path hangs (ACS/IOMMU), research §3.1: P2P only
# between GPUs NVLink connects. On PCIe-only cards that is no P2P at all (as NCCL_P2P_DISABLE=1 would
# be); on NVLink cards P2P goes on as before, so it is safe in a pod that may land on either. P2P joins the
# GPUs of one node only: with one GPU per node there is none to turn off, and no fallback.
SAFE_PCIE_NCCL_ENV = {"NCCL_P2P_LEVEL": "NVL"}

# The spec of a failed job is immutable and a failed job is never judged again: a permanent failure's fix
# takes a new job, which resumes only from checkpoints that outlived the old one (docs/install.md).
RECREATE = (
    "delete the job and create it again (its checkpoints survive only with checkpoints.keepOnDelete, a"
    " checkpoints.volume, or the claim <job>-checkpoints detached first: remove its ownerReferences)"
)
# docs/failures.md's "You" column.
ADVICE: dict[FailureClass, str] = {
    FailureClass.CONFIG_ERROR: f"fix the SFTJob spec (or the Secret/ConfigMap it names), then {RECREATE}",
    FailureClass.DATA_ERROR: f"fix the dataset (format, columns, bad rows), then {RECREATE}",
    FailureClass.MODEL_LOAD_ERROR: "check the model name, revision, token Secret and volume, then"
    f" {RECREATE}",
    FailureClass.IMAGE_PULL_ERROR: f"check spec.image and the registry credentials, then {RECREATE}",
    FailureClass.DIVERGED: "lower training.learningRate or raise warmupRatio, check the data, then"
    f" {RECREATE}",
    # Said once the job has failed: raising activeDeadlineSeconds then changes nothing.
    FailureClass.DEADLINE_EXCEEDED: "a larger spec.activeDeadlineSeconds or shorter training takes a new"
    f" job: {RECREATE}",
    FailureClass.CUDA_OOM: "lower training.microBatchSize or dataset.maxSeqLength, or use a larger GPU",
    FailureClass.HOST_OOM: "a larger spec.resources.memory, a lower spec.resources.cpu (it sets the"
    " dataloader workers) or nodes with more memory",
    FailureClass.NETWORK_ERROR: "check the egress to the hub (HF_ENDPOINT), or put the model on a volume",
    FailureClass.DRIVER_MISMATCH: "use a spec.image built for a CUDA the nodes' drivers support",
    FailureClass.GPU_UNAVAILABLE: "use a spec.image with PyTorch built for CUDA and no NVIDIA driver files",
    # The classes that end a job by using up restartPolicy.maxRestarts.
    FailureClass.STORAGE_ERROR: "give the checkpoints more room (a larger checkpoints.size or volume, or a"
    " smaller checkpoints.keep) and the hub cache too; a multi-node job needs a checkpoints.volume every node"
    " mounts (ReadWriteMany)",
    FailureClass.COMMUNICATION_ERROR: "between nodes, check the network between the pods (every TCP port open"
    " between them, the MTU, NCCL_SOCKET_IFNAME, the RDMA GID); inside a node, the PCIe ACS/IOMMU settings",
    FailureClass.STALLED: "look for a hang (NCCL, a stuck download or data source) in the pod logs, or raise"
    " restartPolicy.stallTimeoutSeconds above the longest step and setup work that downloads nothing",
    FailureClass.UNKNOWN: "read the message and the pod logs",
}
# A CUDA OOM outside the forward and backward passes (loading the model, the optimizer's step, a save): the
# ladder's rungs lower none of that memory, the model's own (weights, gradients, optimizer state).
STATIC_OOM_ADVICE = (
    "the model's weights, gradients and optimizer state need more GPU memory than planned, which no rung of"
    " the OOM ladder lowers: use a cheaper method (lora, qlora), more GPUs for FSDP to shard the model over,"
    " or a GPU with more memory"
)
# When the nodes cannot give the pods more memory, a larger spec.resources.memory only leaves them Pending.
HOST_MEMORY_EXHAUSTED_ADVICE = (
    f"a lower spec.resources.cpu (it sets the dataloader workers) or nodes with more memory, then {RECREATE}"
)
# How many nodes a give-up message names when a GPU or driver fault followed the job across them.
NODES_NAMED = 5


class GiveUpReason(StrEnum):
    """``Failed`` condition reasons besides the failure classes themselves."""

    RESTART_LIMIT_EXCEEDED = "RestartLimitExceeded"
    INTERRUPTION_LIMIT_EXCEEDED = "InterruptionLimitExceeded"
    OOM_LADDER_EXHAUSTED = "OOMLadderExhausted"
    HOST_MEMORY_EXHAUSTED = "HostMemoryExhausted"


def next_attempt(
    spec: SFTJobSpec,
    history: Sequence[AttemptRecord],
    plans: CandidatePlans,
    *,
    nodes: Mapping[str, NodeObj],
    now: datetime,
) -> NextAttempt | GiveUp:
    """The attempt after ``history`` (the first one, a resume, or a restart), or why there is none."""
    return decide(spec.restart_policy, history, plans, replan=planner_replanner(spec), nodes=nodes)


def planner_replanner(spec: SFTJobSpec) -> Replanner:
    """The planner's OOM ladder for this job; the plan's GPU profile is the card that ran out."""

    def replan(plan: Plan) -> Plan:
        request = to_plan_request(spec, spec.gpu.count, spec.gpu.nodes)
        profile = profile_for_key(plan.gpu)
        # The user's CPUs set the workers and threads of each rung too, as they set the first plan's.
        return with_user_resources(spec, replan_after_oom(request, profile, plan), profile)

    return replan


def decide(
    policy: RestartPolicy,
    history: Sequence[AttemptRecord],
    plans: CandidatePlans,
    *,
    replan: Replanner,
    nodes: Mapping[str, NodeObj],
) -> NextAttempt | GiveUp:
    """The decision, with the re-planner passed in. ``plans`` are the planner's plans for the job
    (the user's resources applied); the nodes map names to Node objects (for allocatable memory)."""
    last = history[-1] if history else None
    if last is not None and last.failed:
        stop = _stop(policy, history)
        if stop is not None:
            return stop
    settings = attempt_settings(policy, history, plans, replan=replan, nodes=nodes)
    if isinstance(settings, GiveUp):
        return settings
    not_before = None
    if last is not None and last.end_time is not None and backs_off(policy, last):
        failures = sum(1 for r in history if backs_off(policy, r))
        not_before = last.end_time + timedelta(seconds=backoff_seconds(policy, failures))
    return settings if not_before is None else replace(settings, not_before=not_before)


def backoff_seconds(policy: RestartPolicy, failures: int) -> float:
    """Wait before the restart after the ``failures``-th failure that backs off: backoff·2^(n-1), capped."""
    if failures < 1:
        return 0.0
    return float(min(policy.backoff_seconds * 2 ** min(failures - 1, 32), policy.max_backoff_seconds))


def counts_against_budget(policy: RestartPolicy, history: Sequence[AttemptRecord]) -> list[bool]:
    """For each record: a failure the job caused itself, counted against maxRestarts. Interruptions,
    faulty nodes (bounded by maxInterruptions) and OOM re-plans (bounded by the ladder) are not; a GPU
    or driver fault that followed the job across nodes is (:func:`sftjob.attempts.not_the_jobs_fault`)."""
    blameless = not_the_jobs_fault(history)
    return [backs_off(policy, r) and not b for r, b in zip(history, blameless, strict=True)]


def backs_off(policy: RestartPolicy, record: AttemptRecord) -> bool:
    """The restart after this failure waits: all but interruptions and OOM re-plans, which restart at once
    (elsewhere, or with a smaller plan). A faulty node's does too: other nodes may be as broken."""
    if not record.failed or record.interrupted:
        return False
    return not (record.reason is FailureClass.CUDA_OOM and policy.on_oom == "Replan")


def attempt_settings(
    policy: RestartPolicy,
    history: Sequence[AttemptRecord],
    plans: CandidatePlans,
    *,
    replan: Replanner,
    nodes: Mapping[str, NodeObj],
) -> NextAttempt | GiveUp:
    """The attempt that follows ``history``, starting at once: the planner's plans with every
    adjustment the failures so far call for, or why no plan is left."""
    ended = [r for r in history if r.failed]
    adjusted, changes = _gpu_adjusted(policy, plans, ended, replan)
    if not any(p.fits for p in adjusted.values()):
        ladders = " | ".join(f"{k}: {'; '.join(p.ladder)}" for k, p in adjusted.items() if p.ladder)
        # Only the ladders that ran out say what to try: a card that never fitted planned its suggestions
        # before any OOM (the very setup that ran out of memory among them).
        ran_out = [p for k, p in adjusted.items() if plans.plans[k].fits]
        tries = list(dict.fromkeys(s for p in ran_out for s in p.suggestions))
        oom = next((r for r in reversed(ended) if r.reason is FailureClass.CUDA_OOM), None)
        generic = _advice(oom) if oom is not None else ADVICE[FailureClass.CUDA_OOM]
        advice = f"try: {'; '.join(tries)}" if tries else generic
        return GiveUp(
            GiveUpReason.OOM_LADDER_EXHAUSTED,
            f"out of GPU memory with every re-plan applied ({ladders}); {advice}",
        )

    host_ooms = [r for r in ended if r.reason is FailureClass.HOST_OOM]
    if host_ooms:
        # Raised from what the pods that ran out asked for: the cards that fitted when they were made.
        earlier = [r for r in ended if r.attempt < host_ooms[-1].attempt]
        asked = CandidatePlans(_gpu_adjusted(policy, plans, earlier, replan)[0], plans.profile_by_product)
        exhausted = raise_host_memory(adjusted, asked, host_ooms, nodes, changes)
        if exhausted is not None:
            return GiveUp(GiveUpReason.HOST_MEMORY_EXHAUSTED, f"{exhausted}; {HOST_MEMORY_EXHAUSTED_ADVICE}")

    follows = _follows_the_job(history)
    if follows:
        changes.append(follows)
    avoid = avoided_nodes(ended)
    if avoid:
        changes.append(f"preferring nodes other than {', '.join(avoid)}")
    result = CandidatePlans(adjusted, plans.profile_by_product)
    return NextAttempt(
        attempt=max((r.attempt for r in history), default=0) + 1,
        plans=result,
        avoid_nodes=avoid,
        ladder_step=result.first.ladder[-1] if result.first.ladder else None,
        message="; ".join(changes),
    )


def _gpu_adjusted(
    policy: RestartPolicy, plans: CandidatePlans, ended: Sequence[AttemptRecord], replan: Replanner
) -> tuple[dict[str, Plan], list[str]]:
    """Each card's plan after the OOM ladder its own failures call for, and the NCCL fallback. A card
    whose ladder ran out also rules out every candidate card with no more memory."""
    changes: list[str] = []
    adjusted = {key: _laddered(policy, plans, key, ended, replan) for key in plans.plans}
    exhausted = [k for k, p in adjusted.items() if plans.plans[k].fits and not p.fits]
    ceiling = max((profile_for_key(k).memory_gib for k in exhausted), default=0.0)
    for key, plan in adjusted.items():
        if plan.ladder:
            changes.append(f"{key}: {plan.ladder[-1]}")
        if plan.fits and profile_for_key(key).memory_gib <= ceiling:
            adjusted[key] = plan.model_copy(update={"fits": False})
            changes.append(f"{key}: skipped, no more GPU memory than {', '.join(exhausted)}")
    several = any(p.distributed.nproc_per_node > 1 for p in adjusted.values())
    broken = pcie_links_broken(list(adjusted), ended) if several else []
    if broken:
        for key, plan in adjusted.items():
            adjusted[key] = plan.model_copy(update={"env": {**plan.env, **SAFE_PCIE_NCCL_ENV}})
        changes.append(f"NCCL P2P over NVLink only after a communication error on {', '.join(broken)}")
    return adjusted, changes


def pcie_links_broken(cards: Sequence[str], ended: Sequence[AttemptRecord]) -> list[str]:
    """The PCIe-only candidate cards on which communication broke (a P2P hang at start is one too: the
    trainer's communication probe ends it as a CommunicationError). Every candidate's plan then gets
    ``SAFE_PCIE_NCCL_ENV``: the pod's environment comes from the first fitting plan wherever it lands,
    so a fallback on the failing card's plan alone would miss a pod whose first card has NVLink. A peer
    that never joined the rendezvous says nothing about the links and does not count. A ``Stalled``
    attempt never counts: a slow tokenisation, volume read or download stalls the same way."""
    pcie = {k for k in cards if profile_for_key(k).nvlink_gbs is None}
    failed = {
        r.gpu
        for r in ended
        if r.reason is FailureClass.COMMUNICATION_ERROR and r.gpu in pcie and not peer_never_joined(r)
    }
    return sorted(k for k in failed if k is not None)


def avoided_nodes(ended: Sequence[AttemptRecord]) -> tuple[str, ...]:
    """Nodes that lost a job, failed its GPUs, or broke its communication more than once: the next
    attempts prefer any other node (``scheduling.node_affinity``) but may still use these when nothing
    else fits, so one lost node on a small pool never holds a job Pending forever. A rendezvous that
    timed out waiting for a peer is no fault of the node that waited."""
    comm = Counter(
        r.node
        for r in ended
        if r.reason is FailureClass.COMMUNICATION_ERROR and r.node and not peer_never_joined(r)
    )
    bad = {r.node for r in ended if r.reason in NODE_FAULT and r.node}
    bad |= {node for node, n in comm.items() if n >= COMMUNICATION_ERRORS_TO_AVOID_NODE}
    return tuple(sorted(bad))


def final_failure(spec: SFTJobSpec, history: Sequence[AttemptRecord]) -> GiveUp | None:
    """Why the failure that ended ``history`` ends the job whatever the plans (a permanent class, onOOM
    Fail, a budget used up), if it does: asked when no plan can be made for the next attempt."""
    if not history or not history[-1].failed:
        return None
    return _stop(spec.restart_policy, history)


def _stop(policy: RestartPolicy, history: Sequence[AttemptRecord]) -> GiveUp | None:
    """Why the failure that ended ``history`` ends the job too, if it does."""
    last = history[-1]
    cls = last.reason or FailureClass.UNKNOWN
    code = f" (exit code {last.exit_code})" if last.exit_code is not None else ""
    what = f"attempt {last.attempt} failed with {cls}{code}" + (f": {last.message}" if last.message else "")
    if cls in PERMANENT:
        return GiveUp(cls.value, f"{what}; {ADVICE[cls]}")
    if cls is FailureClass.CUDA_OOM and policy.on_oom == "Fail":
        return GiveUp(cls.value, f"{what}; restartPolicy.onOOM is Fail: {_advice(last)}")
    blameless = not_the_jobs_fault(history)
    counted = counts_against_budget(policy, history)
    if blameless[-1]:
        used = sum(blameless)
        if used > policy.max_interruptions:
            avoided = avoided_nodes([r for r in history if r.failed])
            nodes = f" (nodes at fault: {', '.join(avoided)})" if avoided else ""
            return GiveUp(
                GiveUpReason.INTERRUPTION_LIMIT_EXCEEDED,
                f"{what}; {used} preemptions, node losses or GPU and driver faults exceed"
                f" restartPolicy.maxInterruptions {policy.max_interruptions}{nodes}",
            )
    elif counted[-1]:
        used = sum(counted)
        if used > policy.max_restarts:
            follows = _follows_the_job(history)
            why = f"{what}; {follows}" if follows else what
            advice = f"; {_advice(last)}" if cls in ADVICE else ""
            return GiveUp(
                GiveUpReason.RESTART_LIMIT_EXCEEDED,
                f"{why}; {used} failures exceed restartPolicy.maxRestarts {policy.max_restarts}{advice}",
            )
    return None


def _follows_the_job(history: Sequence[AttemptRecord]) -> str | None:
    """Says so when the GPU or driver fault that ended ``history`` followed the job across nodes."""
    follows = follows_the_job(history)
    if follows is None:
        return None
    cls, nodes = follows
    named = ", ".join(nodes[:NODES_NAMED]) + (
        f" and {len(nodes) - NODES_NAMED} more" if len(nodes) > NODES_NAMED else ""
    )
    return (
        f"{cls} on {len(nodes)} nodes ({named}) follows the job (its image's CUDA or PyTorch, or its"
        " driver requirement), not a node: counted against restartPolicy.maxRestarts"
    )


def _laddered(
    policy: RestartPolicy, plans: CandidatePlans, key: str, ended: Sequence[AttemptRecord], replan: Replanner
) -> Plan:
    """Card ``key``'s plan one rung down the OOM ladder per CUDA OOM on it, or on a twin: a card of the same
    memory (the A800 SXM4 and PCIe 80GB, the L40S and the A40) planned with the same training settings,
    which runs out alike; ``fits=False`` once exhausted. An OOM the trainer says happened outside the
    forward and backward passes (:class:`sftjob.failures.OomPhase`: loading the model, the optimizer's step,
    a save) exhausts it at once: every rung lowers only those passes' memory, and restarting each rung
    (reloading the model every time) would end there anyway.

    The re-planner rebuilds the plan from the request, so the resources (which may carry the user's
    ``spec.resources``) are kept from the plan it was given.
    """
    plan = plans.plans[key]
    if policy.on_oom != "Replan" or not plan.fits:
        return plan
    for record in ended:
        if record.reason is FailureClass.CUDA_OOM and _twin(plans, record.gpu, key):
            if oom_phase(record.message) is not None:  # the model's own memory, which no rung lowers
                where = record.message.removeprefix(f"{CUDA_OOM_REASON} ").partition(": ")[0]
                step = (
                    f"exhausted after OOM {where}, outside the forward and backward passes the rungs shrink"
                )
                return plan.model_copy(update={"fits": False, "ladder": [*plan.ladder, step]})
            rung = replan(plan)
            if len(rung.ladder) <= len(plan.ladder):  # the re-planner added no step: nothing left
                rung = rung.model_copy(update={"fits": False})
            plan = rung.model_copy(update={"resources": plan.resources})
            if not plan.fits:
                break
    return plan


def _advice(record: AttemptRecord) -> str:
    """What to change after the failure ``record``: a CUDA OOM outside the forward and backward passes has
    advice of its own."""
    cls = record.reason or FailureClass.UNKNOWN
    if cls is FailureClass.CUDA_OOM and oom_phase(record.message) is not None:
        return STATIC_OOM_ADVICE
    return ADVICE[cls]


def _twin(plans: CandidatePlans, failed: str | None, card: str) -> bool:
    """``card`` is the card that ran out, or one of its memory planned with its training settings."""
    if failed is None or failed == card or failed not in plans.plans:
        return failed == card
    ran_out, other = profile_for_key(failed).memory_gib, profile_for_key(card).memory_gib
    same_memory = abs(ran_out - other) <= SAME_MEMORY_TOLERANCE * max(ran_out, other)
    return same_memory and plans.plans[failed].training == plans.plans[card].training
