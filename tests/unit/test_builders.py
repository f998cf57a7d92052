"""The pure builders: an SFTJob and its plans in, the children's manifests out."""

from __future__ import annotations

import json
from typing import Any

import pytest
from pydantic import ValidationError

from sftjob import constants as c
from sftjob.config import DistributedSettings, JobRef, TrainerConfig, TrainingSettings
from sftjob.gpus import GpuProfile, profile_for_type
from sftjob.plan import MemoryEstimate, Plan, PodResources
from sftjob.spec import SFTJobSpec
from sftjob_operator import builders, pods
from sftjob_operator.planning import CandidatePlans, plan_candidates
from sftjob_operator.scheduling import default_products, node_affinity

JOB = JobRef(namespace="team", name="llama", uid="uid-1", attempt=3)


def fake_plan(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
    world = spec.gpu.count * spec.gpu.nodes
    return Plan(
        gpu=profile.key,
        fits=True,
        training=TrainingSettings(
            global_batch_size=8 * world, micro_batch_size=2, gradient_accumulation_steps=4
        ),
        distributed=DistributedSettings(nnodes=spec.gpu.nodes, nproc_per_node=spec.gpu.count),
        env={"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"},
        resources=PodResources(cpu="8", memory="64Gi", shm_size="16Gi"),
        memory=MemoryEstimate(terms=[], total_gib=30.0, budget_gib=40.0),
        predicted_tokens_per_second=1000.0,
        predicted_mfu=0.4,
    )


def spec(**changes: Any) -> SFTJobSpec:
    body: dict[str, Any] = {
        "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
        "dataset": {"name": "org/chats"},
    }
    body.update(changes)
    return SFTJobSpec.model_validate(body)


def pod(s: SFTJobSpec, rank: int = 0) -> dict[str, Any]:
    plans = plan_candidates(s, default_products(), fake_plan)
    affinity = node_affinity(s.gpu.candidates(), default_products())
    return pods.trainer_pod(JOB, s, plans, rank=rank, affinity=affinity, image="trainer:test")


def env_of(manifest: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in manifest["spec"]["containers"][0]["env"]}


def test_a_pod_is_named_labelled_and_owned_for_its_attempt_and_rank() -> None:
    p = pod(spec(gpu={"type": "A800", "count": 8, "nodes": 2}), rank=1)
    meta = p["metadata"]
    assert meta["name"] == "llama-3-1" and meta["namespace"] == "team"
    assert meta["labels"][c.LABEL_JOB] == "llama" and meta["labels"][c.LABEL_ATTEMPT] == "3"
    assert meta["labels"][c.LABEL_RANK] == "1"
    (owner,) = meta["ownerReferences"]
    assert owner["kind"] == "SFTJob" and owner["uid"] == "uid-1" and owner["controller"]


def test_a_single_node_pod_runs_torchrun_standalone_with_one_process_per_gpu_under_the_launcher() -> None:
    p = pod(spec(gpu={"type": "A800", "count": 8}))
    (container,) = p["spec"]["containers"]
    assert container["command"] == [
        "python",
        "-m",
        "sftjob_trainer.launch",  # PID 1: the message of a rank killed by a signal
        "torchrun",
        "--standalone",
        "--nproc-per-node=8",
        "--shutdown-timeout=307",  # 120 s + 1.5 x a 131 s step (64 x 2048 tokens at 1000/s) - 10 s
        "--tee=2",  # each rank's stderr lines behind its local rank, for the launcher
        "-m",
        "sftjob_trainer.train",
    ]
    assert "hostname" not in p["spec"]


def test_the_grace_period_covers_a_checkpoint_save_and_torchrun_stops_its_workers_inside_it() -> None:
    s = spec(gpu={"type": "A800", "count": 8})
    plan = fake_plan(s, profile_for_type("A800")).model_copy(
        update={"checkpoint_gib": 85.1, "predicted_tokens_per_second": 64 * 2048 / 10}  # a 10 s step
    )
    only = CandidatePlans({plan.gpu: plan}, {})
    p = pods.trainer_pod(JOB, s, only, rank=0, affinity={}, image="trainer:test")
    assert p["spec"]["terminationGracePeriodSeconds"] == 120 + 15 + 171
    assert "--shutdown-timeout=296" in p["spec"]["containers"][0]["command"]


def test_multi_node_pods_meet_at_rank_zero_through_the_headless_service() -> None:
    p = pod(spec(gpu={"type": "A800", "count": 4, "nodes": 2}), rank=1)
    command = p["spec"]["containers"][0]["command"]
    assert "--nnodes=2" in command and "--node-rank=1" in command
    assert "--master-addr=llama-3-0.llama" in command and f"--master-port={c.TORCHRUN_PORT}" in command
    assert command[:4] == ["python", "-m", "sftjob_trainer.launch", "torchrun"] and "--tee=2" in command
    assert (p["spec"]["hostname"], p["spec"]["subdomain"]) == ("llama-3-1", "llama")
    service = builders.rendezvous_service(JOB)
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["publishNotReadyAddresses"]


def test_only_the_jobs_own_pods_reach_its_trainers_but_anyone_may_scrape_their_metrics() -> None:
    s = spec(gpu={"type": "A800", "count": 4, "nodes": 2})
    plans = plan_candidates(s, default_products(), fake_plan)
    children = pods.attempt_children(JOB, s, plans, affinity={}, image="trainer:test", ranks=[0, 1])
    (policy,) = [m for m in children if m["kind"] == "NetworkPolicy"]
    trainers = {c.LABEL_JOB: "llama", c.LABEL_CONTROLLER_UID: "uid-1"}  # the pods' own labels
    assert all(trainers.items() <= m["metadata"]["labels"].items() for m in children if m["kind"] == "Pod")
    assert policy["metadata"]["ownerReferences"][0]["uid"] == "uid-1"  # deleted with the job
    assert policy["spec"] == {
        "podSelector": {"matchLabels": trainers},
        "policyTypes": ["Ingress"],
        "ingress": [
            {"from": [{"podSelector": {"matchLabels": trainers}}]},
            {"ports": [{"protocol": "TCP", "port": c.TRAINER_METRICS_PORT}]},
        ],
    }
    unguarded = pods.attempt_children(JOB, s, plans, affinity={}, image="t", ranks=[0], isolated=False)
    assert "NetworkPolicy" not in {m["kind"] for m in unguarded}


def test_a_pod_requests_its_gpus_tolerates_the_gpu_taint_and_never_restarts_itself() -> None:
    p = pod(spec(gpu={"type": "L40S", "count": 2}))
    resources = p["spec"]["containers"][0]["resources"]
    assert resources["requests"][c.GPU_RESOURCE] == resources["limits"][c.GPU_RESOURCE] == "2"
    assert resources["requests"]["memory"] == resources["limits"]["memory"] == "64Gi"
    assert {"key": c.GPU_TAINT_KEY, "operator": "Exists", "effect": "NoSchedule"} in p["spec"]["tolerations"]
    assert p["spec"]["restartPolicy"] == "Never"
    terms = p["spec"]["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    (term,) = terms["nodeSelectorTerms"]
    assert term["matchExpressions"][0]["values"] == default_products()["L40S"]


def test_the_pods_of_nodes_other_than_rank_zeros_ask_for_the_workers_memory_when_the_plan_has_one() -> None:
    def split_plan(s: SFTJobSpec, profile: GpuProfile) -> Plan:
        made = fake_plan(s, profile)
        return made.model_copy(
            update={"resources": made.resources.model_copy(update={"worker_memory": "40Gi"})}
        )

    s = spec(gpu={"type": "A800", "count": 4, "nodes": 3})
    plans = plan_candidates(s, default_products(), split_plan)
    affinity = node_affinity(s.gpu.candidates(), default_products())
    memory = [
        pods.trainer_pod(JOB, s, plans, rank=r, affinity=affinity, image="t")["spec"]["containers"][0][
            "resources"
        ]
        for r in range(3)
    ]
    assert [(m["requests"]["memory"], m["limits"]["memory"]) for m in memory] == [
        ("64Gi", "64Gi"),
        ("40Gi", "40Gi"),
        ("40Gi", "40Gi"),
    ]


def test_a_pod_that_may_land_on_several_cards_asks_for_the_memory_of_the_hungriest_cards_plan() -> None:
    # Replicated on the A800 (each process loads onto its GPU), sharded on the L40S (rank 0 loads on the CPU).
    def per_card(s: SFTJobSpec, profile: GpuProfile) -> Plan:
        made = fake_plan(s, profile)
        memory = "96Gi" if profile.key == "L40S" else "48Gi"
        return made.model_copy(update={"resources": made.resources.model_copy(update={"memory": memory})})

    s = spec(gpu={"types": ["A800", "L40S"], "count": 2})
    plans = plan_candidates(s, default_products(), per_card)
    assert plans.first.resources.memory == "48Gi"  # the A800's plan comes first
    affinity = node_affinity(s.gpu.candidates(), default_products())
    made = pods.trainer_pod(JOB, s, plans, rank=0, affinity=affinity, image="t")
    assert made["spec"]["containers"][0]["resources"]["limits"]["memory"] == "96Gi"


def test_a_pod_meets_the_restricted_pod_security_profile_as_the_trainer_images_user() -> None:
    p = pod(spec())
    security = p["spec"]["securityContext"]
    assert security["runAsNonRoot"] is True and security["runAsUser"] == security["fsGroup"] == c.TRAINER_UID
    assert security["seccompProfile"] == {"type": "RuntimeDefault"}
    container = p["spec"]["containers"][0]["securityContext"]
    assert container == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def test_a_pod_mounts_its_config_a_memory_backed_shm_and_the_checkpoint_claim() -> None:
    p = pod(spec())
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    assert volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}
    assert volumes["config"]["configMap"]["name"] == "llama-config"
    assert volumes["checkpoints"]["persistentVolumeClaim"]["claimName"] == "llama-checkpoints"
    mounts = {m["name"]: m["mountPath"] for m in p["spec"]["containers"][0]["volumeMounts"]}
    assert mounts == {
        "config": c.CONFIG_MOUNT,
        "shm": "/dev/shm",
        "scratch": c.SCRATCH_MOUNT,
        "checkpoints": c.CHECKPOINT_MOUNT,
    }


def test_a_model_on_a_volume_is_mounted_read_only_where_the_config_points() -> None:
    s = spec(model={"path": "llama-8b", "volume": {"persistentVolumeClaim": {"claimName": "models"}}})
    p = pod(s)
    mount = next(m for m in p["spec"]["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": c.MODEL_MOUNT, "readOnly": True}
    # The volume too: no fsGroup relabelling of a shared model tree, a ReadOnlyMany claim on every node.
    volume = next(v for v in p["spec"]["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "models", "readOnly": True}
    config = builders.trainer_config(JOB, s, plan_candidates(s, default_products(), fake_plan).first)
    assert config.model.path == f"{c.MODEL_MOUNT}/llama-8b"


def test_the_hub_revisions_of_the_model_and_the_dataset_reach_the_trainer() -> None:
    s = spec(
        model={"name": "meta-llama/Llama-3.1-8B", "revision": "v1"},
        dataset={"name": "org/chats", "revision": "2026-11-01"},
    )
    config = builders.trainer_config(JOB, s, plan_candidates(s, default_products(), fake_plan).first)
    assert (config.model.revision, config.dataset.revision) == ("v1", "2026-11-01")


def test_the_pod_environment_has_the_config_path_downward_api_plan_env_and_the_users_env_last() -> None:
    s = spec(
        model={"name": "meta-llama/Llama-3.1-8B-Instruct", "tokenSecretRef": {"name": "hf"}},
        env=[{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "mine"}],
    )
    p = pod(s)
    env = env_of(p)
    assert env[c.CONFIG_ENV] == f"{c.CONFIG_MOUNT}/{c.CONFIG_FILE}"
    assert env["POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert env["HF_TOKEN"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    names = [e["name"] for e in p["spec"]["containers"][0]["env"]]
    assert names[-1] == "PYTORCH_CUDA_ALLOC_CONF" and names.count("PYTORCH_CUDA_ALLOC_CONF") == 2


def test_the_trainer_may_only_annotate_its_own_pods() -> None:
    role = builders.role(JOB, ["llama-3-0", "llama-3-1"])
    (rule,) = role["rules"]
    assert rule["verbs"] == ["patch"] and rule["resourceNames"] == ["llama-3-0", "llama-3-1"]
    assert builders.service_account(JOB)["automountServiceAccountToken"] is False
    assert pod(spec())["spec"]["automountServiceAccountToken"] is True
    binding = builders.role_binding(JOB)
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "llama-trainer", "namespace": "team"}]


def test_the_checkpoint_claim_is_shared_by_all_nodes_and_kept_only_when_asked() -> None:
    multi = builders.checkpoint_pvc(JOB, spec(gpu={"type": "A800", "nodes": 2}, checkpoints={"size": "1Ti"}))
    assert (
        multi["spec"]["accessModes"] == ["ReadWriteMany"]
        and multi["spec"]["resources"]["requests"]["storage"] == "1Ti"
    )
    assert multi["metadata"]["ownerReferences"]
    kept = builders.checkpoint_pvc(JOB, spec(checkpoints={"keepOnDelete": True, "storageClassName": "fast"}))
    assert "ownerReferences" not in kept["metadata"] and kept["spec"]["storageClassName"] == "fast"


def test_the_config_map_holds_a_valid_trainer_config_per_candidate_gpu() -> None:
    s = spec(gpu={"types": ["L40S", "A40"]}, checkpoints={"everySteps": 50})
    cm = builders.config_map(JOB, s, plan_candidates(s, default_products(), fake_plan))
    assert set(cm["data"]) == {c.CONFIG_FILE, "config-L40S.json", "config-A40.json", c.CONFIG_PRODUCTS}
    products = json.loads(cm["data"][c.CONFIG_PRODUCTS])  # what the trainer finds its card's plan by
    assert products == {p: "L40S" for p in default_products()["L40S"]} | {
        p: "A40" for p in default_products()["A40"]
    }
    config = TrainerConfig.model_validate_json(cm["data"][c.CONFIG_FILE])
    assert (
        config.job == JOB
        and config.checkpoints.every_steps == 50
        and config.checkpoints.every_minutes is None
    )
    assert config.output_dir == f"{c.CHECKPOINT_MOUNT}/final" and config.lora.target_modules == "all-linear"
    assert cm["data"][c.CONFIG_FILE] == cm["data"]["config-L40S.json"]


@pytest.mark.parametrize(
    "distributed",
    [{"nproc_per_node": 2}, {"nnodes": 2}, {"sharding": "ddp"}, {"sharding": "fsdp"}, {"sharding": "hsdp"}],
)
def test_a_trainer_config_refuses_qlora_on_more_than_one_gpu_or_with_sharding(
    distributed: dict[str, Any],
) -> None:
    world = distributed.get("nproc_per_node", 1) * distributed.get("nnodes", 1)
    body = {
        "model": {"name": "a/b"},
        "dataset": {"name": "c/d"},
        "method": "qlora",
        "distributed": distributed,
        "training": {"global_batch_size": world},
    }
    with pytest.raises(ValidationError, match="method qlora runs on exactly one GPU"):
        TrainerConfig.model_validate(body)
    assert TrainerConfig.model_validate(body | {"method": "lora"}).method == "lora"
    one_gpu = body | {"distributed": {}, "training": {"global_batch_size": 1}}
    assert TrainerConfig.model_validate(one_gpu).method == "qlora"


def test_each_cards_config_carries_the_tokens_per_second_its_own_plan_predicted() -> None:
    # The trainer exports it beside the measured rate: SFTJobSlowerThanPlanned compares the two.
    def planned(s: SFTJobSpec, profile: GpuProfile) -> Plan:
        speed = 2000.0 if profile.key.startswith("L40S") else 1000.0
        return fake_plan(s, profile).model_copy(update={"predicted_tokens_per_second": speed})

    s = spec(gpu={"types": ["L40S", "A40"]})
    cm = builders.config_map(JOB, s, plan_candidates(s, default_products(), planned))
    speeds = {
        key: TrainerConfig.model_validate_json(cm["data"][c.CONFIG_VARIANT.format(profile=key)]).report
        for key in ("L40S", "A40")
    }
    assert {key: report.planned_tokens_per_second for key, report in speeds.items()} == {
        "L40S": 2000.0,
        "A40": 1000.0,
    }


def test_a_single_type_job_gets_one_config() -> None:
    s = spec(gpu={"type": "A40"})
    cm = builders.config_map(JOB, s, plan_candidates(s, default_products(), fake_plan))
    assert set(cm["data"]) == {c.CONFIG_FILE}


def test_an_event_names_the_job_and_cuts_long_messages() -> None:
    job = JobRef(namespace="team", name="tune", uid="u-1", attempt=2)
    event = builders.event(
        job, type="Warning", reason="CudaOOM", message="x" * 5000, time="2026-11-30T00:00:00Z"
    )
    assert event["involvedObject"] == {
        "apiVersion": "sftjob.io/v1alpha1",
        "kind": "SFTJob",
        "namespace": "team",
        "name": "tune",
        "uid": "u-1",
    }
    assert event["metadata"] == {"generateName": "tune.", "namespace": "team"}
    assert len(event["message"]) == builders.EVENT_MESSAGE_MAX
    assert event["reportingComponent"] == event["source"]["component"] == "sftjob-operator"


def test_the_trainer_gets_the_jobs_bad_row_tolerance() -> None:
    s = spec(dataset={"name": "org/chats", "maxBadRowFraction": 0.2})
    cm = builders.config_map(JOB, s, plan_candidates(s, default_products(), fake_plan))
    assert TrainerConfig.model_validate_json(cm["data"][c.CONFIG_FILE]).dataset.max_bad_row_fraction == 0.2


def test_merging_the_adapter_reaches_the_trainer_and_a_trainer_config_refuses_it_for_full() -> None:
    s = spec(output={"mergeAdapter": True})
    config = builders.trainer_config(JOB, s, plan_candidates(s, default_products(), fake_plan).first)
    assert config.merge_adapter
    plain = spec()
    assert not builders.trainer_config(
        JOB, plain, plan_candidates(plain, default_products(), fake_plan).first
    ).merge_adapter
    with pytest.raises(ValidationError, match="method full writes the whole model already"):
        TrainerConfig.model_validate(config.model_dump() | {"method": "full"})
