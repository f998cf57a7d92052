"""Pure builders: an SFTJob and its plans in, the manifests of its children out. No I/O.

Every child has a deterministic name and an ownerReference to the SFTJob, so creating it twice is a
409 the operator shrugs off and deleting the job lets the garbage collector remove it:

- ``<job>-config``       ConfigMap: the trainer configuration (one per candidate GPU profile)
- ``<job>-checkpoints``  PersistentVolumeClaim, when the spec names no checkpoint volume
- ``<job>``              headless Service for torchrun rendezvous (multi-node jobs)
- ``<job>-trainer``      ServiceAccount, Role (get/patch on this attempt's pods only), RoleBinding
- ``<job>-<attempt>-<rank>``  one trainer Pod per node
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Sequence
from typing import Any

from sftjob import constants as c
from sftjob.config import (
    CheckpointSettings,
    DatasetSource,
    GpuExpectation,
    JobRef,
    LoraSettings,
    ModelSource,
    ReportSettings,
    TrainerConfig,
)
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob_operator.planning import CandidatePlans
from sftjob_operator.scheduling import gpu_tolerations

Manifest = dict[str, Any]

CONTAINER = "trainer"
TRAINER_MODULE = "sftjob_trainer.train"
MANAGED_BY = "sftjob-operator"
EVENT_MESSAGE_MAX = 1024
ROLE_TRAINER = "trainer"
# The trainer finishes its step and saves a checkpoint on SIGTERM; give it time to: a base for the step
# and the process exit, plus the checkpoint's write at an assumed 0.5 GiB/s to the checkpoint volume.
TERMINATION_GRACE_SECONDS = 120
SAVE_SECONDS_PER_GIB = 2.0
# torchrun SIGKILLs its workers this long after forwarding SIGTERM (its default is 30 s): just inside the
# pod's grace, so the save can finish and torchrun still exits before the kubelet's SIGKILL.
TORCHRUN_SHUTDOWN_MARGIN_SECONDS = 10
# How often the trainer annotates its pod with progress (the operator shows it within this).
PROGRESS_INTERVAL_SECONDS = 10.0
HF_HOME = posixpath.join(c.CHECKPOINT_MOUNT, ".cache", "huggingface")  # downloads survive restarts
VARIANT_KEY = "config-{profile}.json"


def event(job: JobRef, *, type: str, reason: str, message: str, time: str) -> Manifest:
    """A core/v1 Event about the job (what ``kubectl describe sftjob`` lists); ``time`` is RFC 3339."""
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{job.name}.", "namespace": job.namespace},
        "involvedObject": {
            "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
            "kind": c.KIND,
            "namespace": job.namespace,
            "name": job.name,
            "uid": job.uid,
        },
        "type": type,
        "reason": reason,
        "message": message[:EVENT_MESSAGE_MAX],
        "source": {"component": MANAGED_BY},
        "reportingComponent": MANAGED_BY,
        "firstTimestamp": time,
        "lastTimestamp": time,
        "count": 1,
    }


def pod_name(job: str, attempt: int, rank: int) -> str:
    return f"{job}-{attempt}-{rank}"


def config_map_name(job: str) -> str:
    return f"{job}-config"


def pvc_name(job: str) -> str:
    return f"{job}-checkpoints"


def trainer_account_name(job: str) -> str:
    return f"{job}-trainer"


def owner_reference(job: JobRef) -> Manifest:
    return {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
        "kind": c.KIND,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def labels(job: JobRef, *, attempt: int | None = None, rank: int | None = None) -> dict[str, str]:
    out = {
        c.LABEL_JOB: job.name,
        "app.kubernetes.io/name": "sftjob",
        "app.kubernetes.io/instance": job.name,
        "app.kubernetes.io/managed-by": MANAGED_BY,
    }
    if attempt is not None:
        out[c.LABEL_ATTEMPT] = str(attempt)
        out[c.LABEL_ROLE] = ROLE_TRAINER
    if rank is not None:
        out[c.LABEL_RANK] = str(rank)
    return out


def _metadata(job: JobRef, name: str, *, owned: bool = True, **label_args: int | None) -> Manifest:
    meta: Manifest = {"name": name, "namespace": job.namespace, "labels": labels(job, **label_args)}
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# --- trainer configuration --------------------------------------------------------------------------


def output_dir(spec: SFTJobSpec) -> str:
    base = c.OUTPUT_MOUNT if spec.output.volume is not None else c.CHECKPOINT_MOUNT
    return posixpath.join(base, spec.output.path)


def trainer_config(job: JobRef, spec: SFTJobSpec, plan: Plan) -> TrainerConfig:
    """The operator→trainer contract for one plan (``job.attempt`` is the attempt it is rendered for)."""
    model, data = spec.model, spec.dataset
    return TrainerConfig(
        job=job,
        model=ModelSource(
            name=model.name,
            path=posixpath.join(c.MODEL_MOUNT, model.path) if model.path else None,
            revision=model.revision,
            trust_remote_code=model.trust_remote_code,
        ),
        dataset=DatasetSource(
            name=data.name,
            path=posixpath.join(c.DATASET_MOUNT, data.path) if data.path else None,
            format=data.format,
            split=data.split,
            max_seq_length=data.max_seq_length,
        ),
        method=spec.method,
        lora=LoraSettings(
            r=spec.lora.r,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=spec.target_modules,
        ),
        training=plan.training,
        distributed=plan.distributed,
        checkpoints=CheckpointSettings(
            dir=c.CHECKPOINT_MOUNT,
            every_steps=spec.checkpoints.every_steps,
            every_minutes=spec.checkpoint_every_minutes,
            keep=spec.checkpoints.keep,
        ),
        output_dir=output_dir(spec),
        gpu=GpuExpectation(required=True, memory_gib=round(plan.memory.total_gib, 2)),
        report=ReportSettings(
            interval_seconds=PROGRESS_INTERVAL_SECONDS, metrics_port=c.TRAINER_METRICS_PORT
        ),
    )


def config_map(job: JobRef, spec: SFTJobSpec, plans: CandidatePlans) -> Manifest:
    """``config.json`` holds the most preferred fitting plan; with several candidate cards,
    ``config-<profile>.json`` holds each card's plan and the trainer loads the one for its device."""
    data = {c.CONFIG_FILE: trainer_config(job, spec, plans.first).to_json()}
    if len(plans.fitting) > 1:
        for key, plan in plans.fitting.items():
            data[VARIANT_KEY.format(profile=key)] = trainer_config(job, spec, plan).to_json()
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": _metadata(job, config_map_name(job.name)),
        "data": data,
    }


# --- storage, network and permissions ---------------------------------------------------------------


def checkpoint_pvc(job: JobRef, spec: SFTJobSpec) -> Manifest:
    """The claim the operator makes when the spec names no checkpoint volume. Owned by the job (so
    deleted with it) unless ``checkpoints.keepOnDelete``; shared by all nodes of a multi-node job."""
    claim: Manifest = {
        "accessModes": ["ReadWriteOnce" if spec.gpu.nodes == 1 else "ReadWriteMany"],
        "resources": {"requests": {"storage": spec.checkpoints.size}},
    }
    if spec.checkpoints.storage_class_name:
        claim["storageClassName"] = spec.checkpoints.storage_class_name
    meta = _metadata(job, pvc_name(job.name), owned=not spec.checkpoints.keep_on_delete)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def rendezvous_service(job: JobRef) -> Manifest:
    """Headless Service giving each pod a DNS name (``<pod>.<job>``) before it is ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_JOB: job.name},
            "ports": [{"name": "rendezvous", "port": c.TORCHRUN_PORT, "targetPort": c.TORCHRUN_PORT}],
        },
    }


def service_account(job: JobRef) -> Manifest:
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": _metadata(job, trainer_account_name(job.name)),
        "automountServiceAccountToken": False,  # only the trainer pods mount it, explicitly
    }


def role(job: JobRef, pod_names: list[str]) -> Manifest:
    """The trainer may read and annotate its own attempt's pods (progress reports) and nothing else."""
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": _metadata(job, trainer_account_name(job.name)),
        "rules": [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "patch"], "resourceNames": pod_names}
        ],
    }


def role_binding(job: JobRef) -> Manifest:
    name = trainer_account_name(job.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": _metadata(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }


def attempt_children(
    job: JobRef,
    spec: SFTJobSpec,
    plans: CandidatePlans,
    *,
    affinity: Manifest,
    image: str,
    ranks: Sequence[int],
) -> list[Manifest]:
    """Everything attempt ``job.attempt`` needs, in creation order (pods last, only those of ``ranks``)."""
    pod_names = [pod_name(job.name, job.attempt, r) for r in range(spec.gpu.nodes)]
    out = [service_account(job), role(job, pod_names), role_binding(job), config_map(job, spec, plans)]
    if spec.checkpoints.volume is None:
        out.append(checkpoint_pvc(job, spec))
    if spec.gpu.nodes > 1:
        out.append(rendezvous_service(job))
    return out + [trainer_pod(job, spec, plans.first, rank=r, affinity=affinity, image=image) for r in ranks]


# --- the trainer pod ---------------------------------------------------------------------------------


def grace_seconds(plan: Plan) -> int:
    """The pod's terminationGracePeriodSeconds: long enough for a step and one checkpoint of this plan."""
    return TERMINATION_GRACE_SECONDS + math.ceil(plan.checkpoint_gib * SAVE_SECONDS_PER_GIB)


def torchrun_command(job: JobRef, spec: SFTJobSpec, rank: int, *, grace: int) -> list[str]:
    procs = f"--nproc-per-node={spec.gpu.count}"
    shutdown = f"--shutdown-timeout={grace - TORCHRUN_SHUTDOWN_MARGIN_SECONDS}"
    if spec.gpu.nodes == 1:
        return ["torchrun", "--standalone", procs, shutdown, "-m", TRAINER_MODULE]
    master = f"{pod_name(job.name, job.attempt, 0)}.{job.name}"
    return [
        "torchrun",
        f"--nnodes={spec.gpu.nodes}",
        procs,
        f"--node-rank={rank}",
        f"--master-addr={master}",
        f"--master-port={c.TORCHRUN_PORT}",
        shutdown,
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
    ]
    token = spec.model.token_secret_ref
    if token is not None:
        env.append(
            {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": token.name, "key": token.key}}}
        )
    env += [{"name": k, "value": v} for k, v in sorted(plan.env.items())]
    env += [{"name": e.name, "value": e.value} for e in spec.env]  # the user's word is last, and wins
    return env


def _volumes(job: JobRef, spec: SFTJobSpec, plan: Plan) -> tuple[list[Manifest], list[Manifest]]:
    checkpoints = spec.checkpoints.volume
    volumes: list[Manifest] = [
        {"name": "config", "configMap": {"name": config_map_name(job.name)}},
        {"name": "shm", "emptyDir": {"medium": "Memory", "sizeLimit": plan.resources.shm_size}},
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
        {"name": "checkpoints", "mountPath": c.CHECKPOINT_MOUNT},
    ]
    extra = (
        ("model", spec.model.volume, c.MODEL_MOUNT, True),
        ("data", spec.dataset.volume, c.DATASET_MOUNT, True),
        ("output", spec.output.volume, c.OUTPUT_MOUNT, False),
    )
    for name, source, path, read_only in extra:
        if source is not None:
            volumes.append({"name": name, **source.to_kubernetes()})
            mounts.append({"name": name, "mountPath": path, "readOnly": read_only})
    return volumes, mounts


def trainer_pod(
    job: JobRef,
    spec: SFTJobSpec,
    plan: Plan,
    *,
    rank: int,
    affinity: Manifest,
    image: str,
) -> Manifest:
    """Node ``rank`` of attempt ``job.attempt``. ``plan`` sets resources and env; the config itself
    comes from the ConfigMap, so a pod on any candidate card finds its own plan there."""
    gpus = str(spec.gpu.count)
    volumes, mounts = _volumes(job, spec, plan)
    ports = [{"name": "metrics", "containerPort": c.TRAINER_METRICS_PORT}]
    if spec.gpu.nodes > 1:
        ports.append({"name": "rendezvous", "containerPort": c.TORCHRUN_PORT})
    container: Manifest = {
        "name": CONTAINER,
        "image": image,
        "command": torchrun_command(job, spec, rank, grace=grace_seconds(plan)),
        "env": _env(job, spec, plan),
        "ports": ports,
        "resources": {
            "requests": {"cpu": plan.resources.cpu, "memory": plan.resources.memory, c.GPU_RESOURCE: gpus},
            "limits": {"memory": plan.resources.memory, c.GPU_RESOURCE: gpus},
        },
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
        "terminationGracePeriodSeconds": grace_seconds(plan),
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
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": _metadata(job, name, attempt=job.attempt, rank=rank),
        "spec": pod_spec,
    }
