"""Pure builders: an SFTJob and its plans in, the manifests of its children out. No I/O.

Every child has a deterministic name, an ownerReference to the SFTJob and its uid as a label, so
creating it twice is a 409 the operator shrugs off (once it has checked the object is this job's, not
an earlier job's of the same name) and deleting the job lets the garbage collector remove it:

- ``<job>-config``       ConfigMap: the trainer configuration (one per candidate GPU profile)
- ``<job>-checkpoints``  PersistentVolumeClaim, when the spec names no checkpoint volume
- ``<job>``              headless Service for torchrun rendezvous (multi-node jobs)
- ``<job>-trainer``      ServiceAccount, Role (patch on this attempt's pods only), RoleBinding
- ``<job>-<attempt>-<rank>``  one trainer Pod per node (:mod:`sftjob_operator.pods`, which also puts an
  attempt's children in creation order)
"""

from __future__ import annotations

import json
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

Manifest = dict[str, Any]

MANAGED_BY = "sftjob-operator"
EVENT_MESSAGE_MAX = 1024
ROLE_TRAINER = "trainer"
PROGRESS_INTERVAL_SECONDS = 10.0


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


def network_policy_name(job: str) -> str:
    return f"{job}-trainers"


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
        c.LABEL_CONTROLLER_UID: job.uid,
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


def metadata(job: JobRef, name: str, *, owned: bool = True, **label_args: int | None) -> Manifest:
    meta: Manifest = {"name": name, "namespace": job.namespace, "labels": labels(job, **label_args)}
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


# Children are created in batches, each once the one before it is there: first what the pods refer to
# (ServiceAccount, Role, ConfigMap, claim, Service) at once, then the RoleBinding (the operator may bind
# a Role only if the API server can check the Role's rules against its own, so the Role must exist),
# then the pods (admission needs their ServiceAccount). Other kinds go in the first batch.
CREATE_BATCH = {"RoleBinding": 1, "Pod": 2}


def creation_batches(children: Sequence[Manifest]) -> list[list[Manifest]]:
    """``children`` in creation batches (``CREATE_BATCH``), empty batches left out."""
    batches: list[list[Manifest]] = [[] for _ in range(max(CREATE_BATCH.values()) + 1)]
    for manifest in children:
        batches[CREATE_BATCH.get(manifest["kind"], 0)].append(manifest)
    return [batch for batch in batches if batch]


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
            revision=data.revision,
            format=data.format,
            split=data.split,
            max_seq_length=data.max_seq_length,
            max_bad_row_fraction=data.max_bad_row_fraction,
        ),
        evaluation=spec.evaluation,
        method=spec.method,
        lora=LoraSettings(
            r=spec.lora.r,
            alpha=spec.lora.alpha,
            dropout=spec.lora.dropout,
            target_modules=spec.lora.target_modules,
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
        merge_adapter=spec.output.merge_adapter,
        gpu=GpuExpectation(required=True, memory_gib=round(plan.memory.total_gib, 2)),
        report=ReportSettings(
            interval_seconds=PROGRESS_INTERVAL_SECONDS,
            metrics_port=c.TRAINER_METRICS_PORT,
            planned_tokens_per_second=plan.predicted_tokens_per_second,
        ),
        tracking=spec.tracking.settings(posixpath.join(c.CHECKPOINT_MOUNT, c.TENSORBOARD_FOLDER)),
    )


def config_map(job: JobRef, spec: SFTJobSpec, plans: CandidatePlans) -> Manifest:
    """``config.json`` holds the most preferred fitting plan; with several candidate cards,
    ``config-<profile>.json`` holds each card's plan and the trainer loads the one for its device, found
    in ``products.json`` (the product labels the operator planned with) or the built-in GPU table."""
    data = {c.CONFIG_FILE: trainer_config(job, spec, plans.first).to_json()}
    if len(plans.fitting) > 1:
        for key, plan in plans.fitting.items():
            data[c.CONFIG_VARIANT.format(profile=key)] = trainer_config(job, spec, plan).to_json()
        products = {product: key for product, key in plans.profile_by_product.items() if key in plans.fitting}
        data[c.CONFIG_PRODUCTS] = json.dumps(products, sort_keys=True)
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": metadata(job, config_map_name(job.name)),
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
    meta = metadata(job, pvc_name(job.name), owned=not spec.checkpoints.keep_on_delete)
    return {"apiVersion": "v1", "kind": "PersistentVolumeClaim", "metadata": meta, "spec": claim}


def rendezvous_service(job: JobRef) -> Manifest:
    """Headless Service giving each pod a DNS name (``<pod>.<job>``) before it is ready; it selects by
    the job's uid too, so never a pod of an earlier job of that name that is still terminating."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(job, job.name),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": {c.LABEL_JOB: job.name, c.LABEL_CONTROLLER_UID: job.uid},
            "ports": [{"name": "rendezvous", "port": c.TORCHRUN_PORT, "targetPort": c.TORCHRUN_PORT}],
        },
    }


def network_policy(job: JobRef) -> Manifest:
    """The job's trainer pods accept connections only from each other (torchrun's store on rank 0 and
    NCCL's sockets take no credentials: PyTorch supports them on a trusted network only) and, from
    anywhere, on the metrics port the scraper reads. Ingress only; a cluster whose network plugin does not
    enforce NetworkPolicies ignores it."""
    trainers = {c.LABEL_JOB: job.name, c.LABEL_CONTROLLER_UID: job.uid}
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": metadata(job, network_policy_name(job.name)),
        "spec": {
            "podSelector": {"matchLabels": trainers},
            "policyTypes": ["Ingress"],
            "ingress": [
                {"from": [{"podSelector": {"matchLabels": trainers}}]},
                {"ports": [{"protocol": "TCP", "port": c.TRAINER_METRICS_PORT}]},
            ],
        },
    }


def service_account(job: JobRef, image_pull_secrets: Sequence[str] = ()) -> Manifest:
    """The trainer pods' identity. Kubernetes adds its ``image_pull_secrets`` (Secret names in the job's
    namespace) to every pod that runs as it, so trainer images can come from a private registry."""
    account: Manifest = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": metadata(job, trainer_account_name(job.name)),
        "automountServiceAccountToken": False,  # only the trainer pods mount it, explicitly
    }
    if image_pull_secrets:
        account["imagePullSecrets"] = [{"name": name} for name in image_pull_secrets]
    return account


def role(job: JobRef, pod_names: list[str]) -> Manifest:
    """The trainer may PATCH its attempt's pods, to report progress in annotations; it never reads them.

    RBAC cannot narrow a PATCH to some fields: the chart's ValidatingAdmissionPolicy
    (templates/trainer-pod-policy.yaml) refuses anything but the progress annotations, on its own pod.
    """
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "Role",
        "metadata": metadata(job, trainer_account_name(job.name)),
        "rules": [{"apiGroups": [""], "resources": ["pods"], "verbs": ["patch"], "resourceNames": pod_names}],
    }


def role_binding(job: JobRef) -> Manifest:
    name = trainer_account_name(job.name)
    return {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": metadata(job, name),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": job.namespace}],
    }
