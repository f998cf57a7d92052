"""How the trainer pod runs: torchrun's rendezvous wait, the grace period a SIGTERM needs, the NCCL
environment wherever the pod lands, the driver floor preflight gets, and a writable HOME."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import yaml

from sftjob import constants as c
from sftjob.config import TrainerConfig
from sftjob.gpus import profile_for_key
from sftjob.job_plan import plan_job
from sftjob.resources import pod_environment
from sftjob.spec import SFTJobSpec
from sftjob_operator import builders, pods
from sftjob_operator.planning import plan_candidates
from sftjob_operator.scheduling import default_products
from tests.unit.test_builders import JOB, env_of, fake_plan, pod, spec

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def example(name: str) -> SFTJobSpec:
    return SFTJobSpec.model_validate(yaml.safe_load((EXAMPLES / name).read_text())["spec"])


def command(s: SFTJobSpec, rank: int = 0) -> list[str]:
    return pod(s, rank)["spec"]["containers"][0]["command"]


# --- rendezvous ----------------------------------------------------------------------------------------


def test_multi_node_rank_zero_waits_a_day_for_the_other_nodes_not_torchruns_ten_minutes() -> None:
    s = spec(gpu={"type": "A800", "count": 4, "nodes": 2})
    for rank in (0, 1):
        assert f"--rdzv-conf=timeout={c.RENDEZVOUS_TIMEOUT_SECONDS}" in command(s, rank)
    assert c.RENDEZVOUS_TIMEOUT_SECONDS == 86_400


def test_with_a_deadline_rank_zero_waits_as_long_as_the_job_may_run() -> None:
    s = spec(gpu={"type": "A800", "count": 4, "nodes": 2}, activeDeadlineSeconds=7200)
    assert "--rdzv-conf=timeout=7200" in command(s)


def test_a_single_node_job_has_no_rendezvous_to_wait_for() -> None:
    assert not any(arg.startswith("--rdzv") for arg in command(spec(gpu={"type": "A800", "count": 8})))


# --- grace period --------------------------------------------------------------------------------------


def test_the_l40s_qlora_examples_grace_covers_a_whole_step_and_the_save() -> None:
    s = example("l40s-qlora.yaml")
    plan = plan_job(s, profile_for_key("L40S"))
    t = plan.training
    step = (
        t.global_batch_size
        * (t.packing_length or s.dataset.max_seq_length)
        / plan.predicted_tokens_per_second
    )
    assert step > 200  # 32 x 4096 tokens at ~500 tokens/s: over four minutes
    grace = pods.grace_seconds(s, plan)
    assert grace == 120 + math.ceil(step * 1.5) + math.ceil(plan.checkpoint_gib * 2)  # was 123 s
    # A SIGTERM just after a step began: torchrun lets the workers finish it and save before SIGKILL.
    assert grace - pods.TORCHRUN_SHUTDOWN_MARGIN_SECONDS > step + plan.checkpoint_gib * 2 + 60


def test_a_step_longer_than_the_cap_adds_only_the_cap() -> None:
    s = spec(gpu={"type": "A800", "count": 8})
    slow = fake_plan(s, profile_for_key("A800")).model_copy(update={"predicted_tokens_per_second": 1.0})
    assert pods.grace_seconds(s, slow) == pods.TERMINATION_GRACE_SECONDS + pods.STEP_GRACE_CAP_SECONDS
    unknown = slow.model_copy(update={"predicted_tokens_per_second": 0.0})
    assert pods.grace_seconds(s, unknown) == pods.TERMINATION_GRACE_SECONDS + pods.STEP_GRACE_CAP_SECONDS


def test_unpacked_rows_are_counted_at_the_datasets_maximum_length() -> None:
    s = spec(dataset={"name": "org/chats", "maxSeqLength": 4096}, gpu={"type": "A800", "count": 8})
    plan = fake_plan(s, profile_for_key("A800"))  # 64 rows, no packing length, 1000 tokens/s
    assert plan.training.packing_length is None
    assert pods.step_seconds(s, plan) == 64 * 4096 / 1000


# --- NCCL ----------------------------------------------------------------------------------------------


def test_the_nccl_environment_restricts_no_card_as_the_pod_may_land_on_any_candidate() -> None:
    """The pod gets one environment wherever it lands (it takes no card): NCCL_P2P_LEVEL=NVL from an A800
    SXM4 plan turned P2P off on the PCIe cards the same pod could land on."""
    env = pod_environment(4, 1, 8)
    assert "NCCL_P2P_LEVEL" not in env and "NCCL_P2P_DISABLE" not in env


def test_a_pod_for_a800_cards_leaves_p2p_to_nccl_wherever_it_lands() -> None:
    env = env_of(pod(spec(gpu={"type": "A800", "count": 4})))
    assert "NCCL_P2P_LEVEL" not in env


# --- driver floor --------------------------------------------------------------------------------------


def configs(s: SFTJobSpec) -> list[TrainerConfig]:
    data = builders.config_map(JOB, s, plan_candidates(s, default_products(), fake_plan))["data"]
    return [TrainerConfig.model_validate_json(text) for key, text in data.items() if key != c.CONFIG_PRODUCTS]


def test_no_image_gets_a_fixed_driver_floor_the_cuda_major_check_decides() -> None:
    for s in (spec(gpu={"type": "Any"}), spec(image="registry.example/trainer:cuda12")):
        assert all(config.gpu.min_driver == "" for config in configs(s))


# --- a writable HOME -----------------------------------------------------------------------------------


def test_home_and_the_triton_cache_are_on_a_writable_scratch_volume() -> None:
    p = pod(spec(image="registry.example/trainer:mine"))
    env = env_of(p)
    assert env["HOME"] == c.SCRATCH_MOUNT == "/tmp"
    assert env["TRITON_CACHE_DIR"].startswith(c.SCRATCH_MOUNT + "/")
    volumes = {v["name"]: v for v in p["spec"]["volumes"]}
    mounts: dict[str, Any] = {m["mountPath"]: m for m in p["spec"]["containers"][0]["volumeMounts"]}
    scratch = mounts[c.SCRATCH_MOUNT]
    assert volumes[scratch["name"]] == {"name": scratch["name"], "emptyDir": {}}
    assert not scratch.get("readOnly")


def test_the_users_env_still_wins_over_the_plans() -> None:
    p = pod(spec(env=[{"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:False"}]))
    names = [e["name"] for e in p["spec"]["containers"][0]["env"]]
    assert names.count("PYTORCH_CUDA_ALLOC_CONF") == 2
    assert env_of(p)["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:False"
