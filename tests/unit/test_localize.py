"""The local trainer runner's pure decisions: which config a pod's trainer gets on this machine."""

from __future__ import annotations

from pathlib import Path

from sftjob.config import DatasetSource, DistributedSettings, ModelSource, TrainerConfig, TrainingSettings
from sftjob_dev.localize import config_key, local_config, localize_path, pod_env

MOUNTS = {
    "/checkpoints": Path("/w/local/ns/job/checkpoints"),
    "/model": Path("/w/local/assets/model"),
    "/data": Path("/w/local/assets/data"),
}


def injected(**changes: object) -> TrainerConfig:
    config = TrainerConfig(
        model=ModelSource(path="/model/tiny-llama"),
        dataset=DatasetSource(path="/data/copy.jsonl"),
        checkpoints={"dir": "/checkpoints"},
        output_dir="/checkpoints/final",
        training=TrainingSettings(global_batch_size=8, micro_batch_size=4, gradient_accumulation_steps=2),
    )
    return TrainerConfig.model_validate(config.model_dump() | changes)


def test_in_pod_folders_map_to_local_ones_and_other_paths_are_left_alone() -> None:
    assert localize_path("/checkpoints", MOUNTS) == "/w/local/ns/job/checkpoints"
    assert localize_path("/checkpoints/final", MOUNTS) == "/w/local/ns/job/checkpoints/final"
    assert localize_path("/checkpointsX/a", MOUNTS) == "/checkpointsX/a"
    assert localize_path("/etc/sftjob/config.json", MOUNTS) == "/etc/sftjob/config.json"


def test_the_local_config_is_the_operators_with_local_folders_a_cpu_run_and_its_own_metrics_port() -> None:
    config, notes = local_config(injected(), MOUNTS, metrics_port=40001)
    assert config.model.path == "/w/local/assets/model/tiny-llama"
    assert config.dataset.path == "/w/local/assets/data/copy.jsonl"
    assert config.checkpoints.dir == "/w/local/ns/job/checkpoints"
    assert config.output_dir == "/w/local/ns/job/checkpoints/final"
    assert config.gpu.required is False
    assert config.report.metrics_port == 40001
    assert config.training.dataloader_workers == 0
    assert config.training.learning_rate == injected().training.learning_rate
    assert any("gpu.required false" in n for n in notes)
    assert config.tracking.tensorboard_dir is None


def test_tensorboards_folder_on_the_checkpoint_volume_maps_to_the_local_one() -> None:
    tracking = {"tensorboard_dir": "/checkpoints/tensorboard", "wandb": {"project": "p"}}
    config, _ = local_config(injected(tracking=tracking), MOUNTS, metrics_port=None)
    assert config.tracking.tensorboard_dir == "/w/local/ns/job/checkpoints/tensorboard"
    assert config.tracking.wandb is not None and config.tracking.wandb.project == "p"


def test_a_multi_gpu_plan_runs_as_one_process_with_the_same_global_batch() -> None:
    plan = injected(
        distributed=DistributedSettings(nproc_per_node=4),
        training=TrainingSettings(global_batch_size=32, micro_batch_size=4, gradient_accumulation_steps=2),
    )
    config, _ = local_config(plan, MOUNTS, metrics_port=None)
    assert config.distributed.world_size == 1
    assert config.training.gradient_accumulation_steps == 8
    assert config.training.global_batch_size == 32


def test_the_trainer_reads_its_cards_plan_when_the_operator_rendered_one_per_card() -> None:
    data = {"config.json": "{}", "config-L40S.json": "{}"}
    assert config_key(data, "NVIDIA-L40S") == "config-L40S.json"
    assert config_key(data, "NVIDIA-A40") == "config.json"
    assert config_key({"config.json": "{}"}, "NVIDIA-L40S") == "config.json"
    assert config_key(data, None) == "config.json"


def test_the_pods_plain_env_is_passed_with_folders_mapped_and_downward_api_entries_skipped() -> None:
    pod = {
        "spec": {
            "containers": [
                {
                    "name": "trainer",
                    "env": [
                        {"name": "SFTJOB_CONFIG", "value": "/etc/sftjob/config.json"},
                        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        {"name": "HF_HOME", "value": "/checkpoints/.cache/huggingface"},
                        {"name": "PYTORCH_CUDA_ALLOC_CONF", "value": "expandable_segments:True"},
                    ],
                }
            ]
        }
    }
    assert pod_env(pod, "trainer", MOUNTS) == {
        "HF_HOME": "/w/local/ns/job/checkpoints/.cache/huggingface",
        "PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True",
    }
