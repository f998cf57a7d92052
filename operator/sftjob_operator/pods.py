"""The trainer pods of an attempt, and everything the attempt needs, in creation order. Pure, no I/O.

One pod per node runs torchrun with one process per GPU; its grace period covers the step under way and
a checkpoint save on SIGTERM on the slowest card the pod may land on, and torchrun stops its workers
just inside it. A multi-node job's pods share one GPU product, each on its own node
(:func:`sftjob_operator.scheduling.gang_affinity`). The pod mounts its config (the ConfigMap's row for
each candidate card), the checkpoint claim, a memory-backed /dev/shm, a scratch /tmp that is also its
HOME and, when the spec names them, the model, dataset and output volumes; it
meets the restricted Pod Security profile unless the spec adds hostPath or nfs volumes. Every pod mounts
every volume, so a multi-node job's claims must allow mounts on several nodes (:func:`unshared_claim`).
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Mapping, Sequence
from typing import Any

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob.volumes import VolumeSource
from sftjob_operator import builders
from sftjob_operator.builders import (
    checkpoint_pvc,
    config_map,
    config_map_name,
    network_policy,
    pod_name,
    pvc_name,
    rendezvous_service,
    role,
    role_binding,
    service_account,
    trainer_account_name,
)
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.scheduling import gang_affinity, gpu_tolerations

Manifest = dict[str, Any]
Obj = Mapping[str, Any]

CONTAINER = "trainer"
TRAINER_MODULE = "sftjob_trainer.train"
# The container's PID 1, above torchrun: it writes the termination message of a rank killed by a signal,
# which could not write its own. The image's `python` (the trainer image installs with it) runs it.
LAUNCHER = ("python", "-m", "sftjob_trainer.launch")
# torchrun prints each worker's stderr lines behind its local rank ("[default1]:..."), which is how the
# launcher tells whose last words are whose; it tees them through files under a new folder in $TMPDIR or
# /tmp, the scratch volume (SCRATCH_MOUNT), and only stderr, so stdout and the log look as before.
TORCHRUN_TEE = "--tee=2"
HF_HOME = posixpath.join(c.CHECKPOINT_MOUNT, ".cache", "huggingface")  # downloads survive restarts
TRITON_CACHE_DIR = posixpath.join(c.SCRATCH_MOUNT, "triton")
# The trainer acts on SIGTERM after the optimizer step under way and then saves a checkpoint; give it
# time to: a base for setup, agreement and the process exit, the rest of the step (at most one whole
# step at the planner's throughput, with a margin for its error, capped), plus the checkpoint's write at
# an assumed 0.5 GiB/s to the checkpoint volume.
TERMINATION_GRACE_SECONDS = 120
STEP_GRACE_MARGIN = 1.5
STEP_GRACE_CAP_SECONDS = 1800
SAVE_SECONDS_PER_GIB = 2.0
# The access modes that let every node of a multi-node job mount a claim: read-write for the checkpoints and
# the output (every rank checks it can write there), read-only at least for the model and the dataset.
WRITE_MANY = frozenset({"ReadWriteMany"})
READ_MANY = frozenset({"ReadOnlyMany", "ReadWriteMany"})
# torchrun SIGKILLs its workers this long after forwarding SIGTERM (its default is 30 s): just inside the
# pod's grace, so the save can finish and torchrun still exits before the kubelet's SIGKILL.
TORCHRUN_SHUTDOWN_MARGIN_SECONDS = 10


def attempt_children(
    job: JobRef,
    spec: SFTJobSpec,
    plans: CandidatePlans,
    *,
    affinity: Manifest,
    image: str,
    ranks: Sequence[int],
    image_pull_secrets: Sequence[str] = (),
    isolated: bool = True,
) -> list[Manifest]:
    """Everything attempt ``job.attempt`` needs, in creation order (pods last, only those of ``ranks``);
    ``isolated``: with the NetworkPolicy that lets only the job's own pods reach its trainers."""
    pod_names = [pod_name(job.name, job.attempt, r) for r in range(spec.gpu.nodes)]
    account = service_account(job, image_pull_secrets)
    out = [account, role(job, pod_names), role_binding(job), config_map(job, spec, plans)]
    if isolated:
        out.append(network_policy(job))
    if spec.checkpoints.volume is None:
        out.append(checkpoint_pvc(job, spec))
    if spec.gpu.nodes > 1:
        out.append(rendezvous_service(job))
    return out + [trainer_pod(job, spec, plans, rank=r, affinity=affinity, image=image) for r in ranks]


def attempt_grace(spec: SFTJobSpec, plans: CandidatePlans) -> int:
    """The grace of every pod of the attempt: that of the slowest card it may land on (a pod's grace is
    fixed when it is created, before the scheduler picks a node)."""
    return max(grace_seconds(spec, p) for p in plans.fitting.values())


def grace_seconds(spec: SFTJobSpec, plan: Plan) -> int:
    """The grace a pod running ``plan`` needs: long enough for a step and one checkpoint of the plan."""
    step = math.ceil(min(STEP_GRACE_CAP_SECONDS, step_seconds(spec, plan) * STEP_GRACE_MARGIN))
    return TERMINATION_GRACE_SECONDS + step + math.ceil(plan.checkpoint_gib * SAVE_SECONDS_PER_GIB)


def step_seconds(spec: SFTJobSpec, plan: Plan) -> float:
    """One optimizer step at the planner's throughput (rows are at most the packed or maximum length)."""
    t = plan.training
    tokens = t.global_batch_size * (t.packing_length or spec.dataset.max_seq_length)
    speed = plan.predicted_tokens_per_second
    return tokens / speed if speed > 0 else math.inf


def rendezvous_timeout(spec: SFTJobSpec) -> int:
    """How long rank 0 waits for the other nodes: as long as the job may run."""
    return spec.active_deadline_seconds or c.RENDEZVOUS_TIMEOUT_SECONDS


def torchrun_command(job: JobRef, spec: SFTJobSpec, rank: int, *, grace: int) -> list[str]:
    procs = f"--nproc-per-node={spec.gpu.count}"
    shutdown = f"--shutdown-timeout={grace - TORCHRUN_SHUTDOWN_MARGIN_SECONDS}"
    if spec.gpu.nodes == 1:
        return [*LAUNCHER, "torchrun", "--standalone", procs, shutdown, TORCHRUN_TEE, "-m", TRAINER_MODULE]
    master = f"{pod_name(job.name, job.attempt, 0)}.{job.name}"
    return [
        *LAUNCHER,
        "torchrun",
        f"--nnodes={spec.gpu.nodes}",
        procs,
        f"--node-rank={rank}",
        f"--master-addr={master}",
        f"--master-port={c.TORCHRUN_PORT}",
        # The static rendezvous (torchrun's with --master-addr) gives up after 600 s unless told.
        f"--rdzv-conf=timeout={rendezvous_timeout(spec)}",
        shutdown,
        TORCHRUN_TEE,
        "-m",
        TRAINER_MODULE,
    ]


def _env(job: JobRef, spec: SFTJobSpec, plan: Plan) -> list[Manifest]:
    def field(path: str) -> Manifest:
        return {"valueFrom": {"fieldRef": {"fieldPath": path}}}

    env: list[Manifest] = [
        {"name": c.CONFIG_ENV, "value": posixpath.join(c.CONFIG_MOUNT, c.CONFIG_FILE)},
        {"name": "SFTJOB_ATTEMPT", "value": str(job.attempt)},
        {"name": "POD_NAME", **field("metadata.name")},
        {"name": "POD_NAMESPACE", **field("metadata.namespace")},
        {"name": "NODE_NAME", **field("spec.nodeName")},
        {"name": "HF_HOME", "value": HF_HOME},
        {"name": "HOME", "value": c.SCRATCH_MOUNT},
        {"name": "TRITON_CACHE_DIR", "value": TRITON_CACHE_DIR},
    ]
    token = spec.model.token_secret_ref
    if token is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
        )
    env += spec.tracking.env(c.SCRATCH_MOUNT)
    env += [{"name": k, "value": v} for k, v in sorted(plan.env.items())]
    env += [{"name": e.name, "value": e.value} for e in spec.env]  # the user's word is last, and wins
    return env


def _volumes(job: JobRef, spec: SFTJobSpec, plan: Plan) -> tuple[list[Manifest], list[Manifest]]:
    checkpoints = spec.checkpoints.volume
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": config_map_name(job.name)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.resources.shm_size}},
        {"name": "scratch", "emptyDir": {}},
        {
            "name": "checkpoints",
            **(
                checkpoints.to_kubernetes()
                if checkpoints is not None
                else {"persistentVolumeClaim": {"claimName": pvc_name(job.name)}}
            ),
        },
    ]
    mounts: list[Manifest] = [
        {"name": "config", "mountPath": c.CONFIG_MOUNT, "readOnly": True},
        {"name": "shm", "mountPath": "/dev/shm"},
        {"name": "scratch", "mountPath": c.SCRATCH_MOUNT},
        {"name": "checkpoints", "mountPath": c.CHECKPOINT_MOUNT},
    ]
    extra = (
        ("model", spec.model.volume, c.MODEL_MOUNT, True),
        ("data", spec.dataset.volume, c.DATASET_MOUNT, True),
        ("output", spec.output.volume, c.OUTPUT_MOUNT, False),
    )
    for name, source, path, read_only in extra:
        if source is not None:
            block = source.to_kubernetes()
            if read_only:  # the volume too, not just the mount: the kubelet then changes no group
                # ownership of a shared model tree (fsGroup), and a ReadOnlyMany claim attaches on every node
                for kind in ("persistentVolumeClaim", "nfs"):
                    if isinstance(block.get(kind), dict):
                        block[kind] = {**block[kind], "readOnly": True}  # type: ignore[dict-item]
            volumes.append({"name": name, **block})
            mounts.append({"name": name, "mountPath": path, "readOnly": read_only})
    return volumes, mounts


KEPT_CLAIM = "kept"  # shared_claims' field for the operator's own checkpoint claim, found already there


def shared_claims(spec: SFTJobSpec, job: str) -> list[tuple[str, str, frozenset[str]]]:
    """The claims each node of multi-node job ``job`` mounts: (the spec's field, the claim, the access
    modes any one of which lets several nodes mount it); none for a single node. Without
    ``checkpoints.volume`` that is the operator's own claim, which an earlier job of this name may have
    left (``keepOnDelete``), made for one node: it is reused as found."""
    if spec.gpu.nodes == 1:
        return []
    named: tuple[tuple[str, VolumeSource | None, frozenset[str]], ...] = (
        ("spec.checkpoints.volume", spec.checkpoints.volume, WRITE_MANY),
        ("spec.output.volume", spec.output.volume, WRITE_MANY),
        ("spec.model.volume", spec.model.volume, READ_MANY),
        ("spec.dataset.volume", spec.dataset.volume, READ_MANY),
    )
    own = [] if spec.checkpoints.volume is not None else [(KEPT_CLAIM, pvc_name(job), WRITE_MANY)]
    return own + [
        (field, volume.persistent_volume_claim.claim_name, modes)
        for field, volume, modes in named
        if volume is not None and volume.persistent_volume_claim is not None
    ]


def unread_claims(spec: SFTJobSpec, job: str, claims: Mapping[str, Obj | None]) -> tuple[str, ...]:
    """The claims of :func:`shared_claims` that ``claims`` (those read so far) lacks."""
    return tuple(name for _, name, _ in shared_claims(spec, job) if name not in claims)


def unshared_claim(spec: SFTJobSpec, job: str, claims: Mapping[str, Obj | None]) -> str | None:
    """Why a claim of a multi-node job cannot be mounted on all its nodes, or None. ``claims`` maps names to
    the claims as read (None: not read or not there); a claim's access modes are its volume's once bound."""
    for field, name, needed in shared_claims(spec, job):
        claim = claims.get(name) or {}
        modes = (claim.get("status") or {}).get("accessModes") or (claim.get("spec") or {}).get("accessModes")
        if modes and not needed & set(modes):
            why = (
                "the trainer writes there"
                if READ_MANY & set(modes)
                else "its volume would attach to one node, and the other pods wait in ContainerCreating"
                " (Multi-Attach error)"
            )
            where, fix = f"{field}.persistentVolumeClaim.claimName: claim {name} has", ""
            if field == KEPT_CLAIM:
                where = f"the checkpoint claim {name}, kept by an earlier job of this name, has"
                fix = "; delete it to have one made for several nodes, or set spec.checkpoints.volume"
            return (
                f"{where} accessModes {', '.join(modes)}; the {spec.gpu.nodes} nodes of the job"
                f" (spec.gpu.nodes) all mount it, which needs {' or '.join(sorted(needed))}: {why}{fix}"
            )
    return None


def attempt_selector(job: JobRef) -> dict[str, str]:
    """The labels that pick out the pods of attempt ``job.attempt`` of this job (and of no namesake)."""
    labels = builders.labels(job, attempt=job.attempt)
    return {key: labels[key] for key in (c.LABEL_JOB, c.LABEL_CONTROLLER_UID, c.LABEL_ATTEMPT)}


def trainer_pod(
    job: JobRef,
    spec: SFTJobSpec,
    plans: CandidatePlans,
    *,
    rank: int,
    affinity: Manifest,
    image: str,
) -> Manifest:
    """Node ``rank`` of attempt ``job.attempt``, on a node ``affinity`` (a ``nodeAffinity``) allows.

    The most preferred plan sets the CPUs and env, the memory is the largest any candidate's plan asks for
    (:meth:`CandidatePlans.memory_for`); the grace covers every candidate's plan; the config
    itself comes from the ConfigMap, so a pod on any candidate card finds its own plan there.
    """
    plan = plans.first
    grace = attempt_grace(spec, plans)
    gpus = str(spec.gpu.count)
    volumes, mounts = _volumes(job, spec, plan)
    ports = [{"name": "metrics", "containerPort": c.TRAINER_METRICS_PORT}]
    if spec.gpu.nodes > 1:
        ports.append({"name": "rendezvous", "containerPort": c.TORCHRUN_PORT})
    memory = plans.memory_for(rank)
    requests: Manifest = {"cpu": plan.resources.cpu, "memory": memory, c.GPU_RESOURCE: gpus}
    limits: Manifest = {"memory": memory, c.GPU_RESOURCE: gpus}
    rdma = spec.network.rdma
    if rdma is not None and spec.gpu.nodes > 1:
        requests[rdma.resource_name] = limits[rdma.resource_name] = str(rdma.count)
    container: Manifest = {
        "name": CONTAINER,
        "image": image,
        "command": torchrun_command(job, spec, rank, grace=grace),
        "env": _env(job, spec, plan),
        "ports": ports,
        "resources": {"requests": requests, "limits": limits},
        "volumeMounts": mounts,
        "terminationMessagePath": c.TERMINATION_LOG,
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    name = pod_name(job.name, job.attempt, rank)
    pod_spec: Manifest = {
        "restartPolicy": "Never",  # the operator decides about restarts, attempt by attempt
        "serviceAccountName": trainer_account_name(job.name),
        "automountServiceAccountToken": True,  # progress reports go through the API server
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": grace,
        "affinity": {"nodeAffinity": affinity},
        "tolerations": gpu_tolerations()
        + [t.model_dump(by_alias=True, exclude_none=True) for t in spec.tolerations],
        # Pod Security "restricted": the trainer image's user, and volumes (checkpoints, output) made
        # writable for its group; ownership is fixed only when the volume's root does not match.
        "securityContext": {
            "runAsNonRoot": True,
            "runAsUser": c.TRAINER_UID,
            "runAsGroup": c.TRAINER_UID,
            "fsGroup": c.TRAINER_UID,
            "fsGroupChangePolicy": "OnRootMismatch",
            "seccompProfile": {"type": "RuntimeDefault"},
        },
        "containers": [container],
        "volumes": volumes,
    }
    if spec.node_selector:
        pod_spec["nodeSelector"] = dict(spec.node_selector)
    if spec.priority_class_name:
        pod_spec["priorityClassName"] = spec.priority_class_name
    if spec.gpu.nodes > 1:
        pod_spec["hostname"] = name
        pod_spec["subdomain"] = job.name
        pod_spec["affinity"].update(gang_affinity(attempt_selector(job)))
    metadata = builders.metadata(job, name, attempt=job.attempt, rank=rank)
    if spec.pod_annotations:
        metadata["annotations"] = dict(spec.pod_annotations)
    if spec.queue_name or spec.gpu.nodes > 1:  # a multi-node attempt is one group in any Kueue queue
        metadata["labels"] |= queue_labels(job, spec.queue_name)
        metadata["annotations"] = metadata.get("annotations", {}) | queue_annotations(spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": pod_spec}


def queue_labels(job: JobRef, queue: str | None) -> dict[str, str]:
    """Kueue's pod integration: the LocalQueue, and the attempt's pods as one pod group, named for the job,
    its uid (a job created again under the name is never taken for the old one's Workload) and the attempt
    (every attempt is a new group, admitted again). A multi-node job without a queue is a group too, for
    a namespace whose Kueue queues pods by default (a LocalQueue named default)."""
    group = {c.KUEUE_POD_GROUP_LABEL: f"{job.name}-{job.uid[:8]}-{job.attempt}"}
    return group | ({c.KUEUE_QUEUE_LABEL: queue} if queue else {})


def queue_annotations(spec: SFTJobSpec) -> dict[str, str]:
    """The group's size (all its pods admitted together), and no retry inside it: a failed pod ends the
    group's workload, releasing its quota, and the operator's next attempt is a new group."""
    return {
        c.KUEUE_POD_GROUP_COUNT: str(spec.gpu.nodes),
        c.KUEUE_RETRIABLE_IN_GROUP: "false",
        c.KUEUE_POD_INDEX_LABEL: c.LABEL_RANK,  # the ranks in order, for topology-aware placement
    }
