"""The planner: fit verdicts per GPU, method and size, overrides, batch exactness, fp8, the OOM ladder."""

from dataclasses import replace

import pytest
from pydantic import ValidationError

from sftjob.config import LoraSettings, TrainingOverrides
from sftjob.gpus import GPU_TYPES, profile_for_type
from sftjob.model_shapes import resolve_architecture
from sftjob.plan import TIME_SLICED_REASON
from sftjob.planner import PlanRequest, plan, plan_all, replan_after_oom
from sftjob.throughput import ThroughputInputs, predict

A800, A40, L40S = (profile_for_type(t) for t in GPU_TYPES)
MODELS = {"1B": "meta-llama/Llama-3.2-1B", "8B": "meta-llama/Llama-3.1-8B", "70B": "meta-llama/Llama-3.1-70B"}

# Expected verdict on one GPU at the default 2048-token sequence, per (size, method): GPU types that fit.
EXPECTED_FITS = {
    ("1B", "full"): {"A800", "A40", "L40S"},
    ("1B", "lora"): {"A800", "A40", "L40S"},
    ("1B", "qlora"): {"A800", "A40", "L40S"},
    ("8B", "full"): set(),
    ("8B", "lora"): {"A800", "A40", "L40S"},
    ("8B", "qlora"): {"A800", "A40", "L40S"},
    ("70B", "full"): set(),
    ("70B", "lora"): set(),
    ("70B", "qlora"): {"A800"},
}


def request(size="8B", method="lora", **kwargs):
    return PlanRequest(architecture=resolve_architecture(MODELS.get(size, size)), method=method, **kwargs)


@pytest.mark.parametrize("gpu_type", GPU_TYPES)
@pytest.mark.parametrize(("size", "method"), list(EXPECTED_FITS))
def test_each_gpu_method_and_size_band_gets_a_consistent_verdict(gpu_type, size, method):
    p = plan(request(size, method), profile_for_type(gpu_type))
    t = p.training
    assert p.fits == (gpu_type in EXPECTED_FITS[(size, method)])
    assert (
        t.micro_batch_size * t.gradient_accumulation_steps * p.distributed.world_size == t.global_batch_size
    )
    assert p.memory.fits == p.fits
    assert p.verdict
    if not p.fits:
        assert "GiB" in p.verdict
        assert p.suggestions


def test_full_70b_on_one_a40_explains_the_numbers_and_suggests_what_fits():
    p = plan(request("70B", "full"), A40)
    assert not p.fits
    assert "A40" in p.verdict
    assert f"{p.memory.total_gib:.1f} GiB" in p.verdict
    assert "39.9 GiB" in p.verdict  # 44.35 x 0.9
    assert any("fsdp" in s and "A40" in s for s in p.suggestions)


def test_full_8b_on_one_card_suggests_lora_qlora_and_more_gpus():
    suggestions = " | ".join(plan(request("8B", "full"), A800).suggestions)
    assert "method lora fits" in suggestions
    assert "method qlora fits" in suggestions
    assert "2 A800-SXM4-80GB with fsdp" in suggestions


def test_qlora_70b_on_l40s_suggests_the_bigger_card():
    assert any("A800-SXM4-80GB" in s for s in plan(request("70B", "qlora"), L40S).suggestions)


def test_suggestions_are_real_plans_that_fit():
    more = plan(request("8B", "full", gpus_per_node=2), A800)
    assert more.fits
    assert more.distributed.sharding == "fsdp"


def test_a_cheaper_method_is_suggested_as_admission_takes_it_qlora_on_one_gpu():
    # 70B LoRA over two GPUs: half the 140 GB bf16 base on each is more than an A800 holds.
    suggestions = plan(request("70B", "lora", gpus_per_node=2), A800).suggestions
    qlora = [s for s in suggestions if "method qlora" in s]
    assert qlora and all("fits on 1 x A800-SXM4-80GB" in s for s in qlora)


def test_an_l40s_is_not_suggested_as_a_bigger_card_than_an_a40():
    assert not any("L40S" in s for s in plan(request("70B", "qlora"), A40).suggestions)


def test_gradient_checkpointing_is_used_only_when_nothing_fits_without_it_or_it_runs_faster():
    assert not plan(request("1B", "full"), A800).training.gradient_checkpointing
    big = plan(request("70B", "qlora"), A800)
    assert big.fits and big.training.gradient_checkpointing
    assert any("nothing fits without it" in r for r in big.reasons)


def test_plan_prefers_the_largest_micro_batch_that_fits():
    p = plan(request("1B", "full"), A800)
    assert p.training.micro_batch_size > 1
    assert p.fits


@pytest.mark.parametrize(("world", "global_batch"), [(1, 30), (2, 30), (4, 64), (8, 8), (3, 33)])
def test_micro_batch_times_accumulation_times_gpus_is_exactly_the_global_batch(world, global_batch):
    r = request(
        "1B", "lora", gpus_per_node=world, overrides=TrainingOverrides(global_batch_size=global_batch)
    )
    t = (p := plan(r, A800)).training
    assert t.global_batch_size == global_batch
    assert t.micro_batch_size * t.gradient_accumulation_steps * p.distributed.world_size == global_batch


def test_default_global_batch_is_about_128k_tokens_and_divisible_by_the_gpus():
    p = plan(request("1B", "lora", max_seq_length=4096, gpus_per_node=3), A800)
    assert p.training.global_batch_size % 3 == 0
    assert 30 <= p.training.global_batch_size <= 36


def test_global_batch_not_divisible_by_the_gpus_is_reported_not_changed():
    p = plan(request("1B", "lora", gpus_per_node=4, overrides=TrainingOverrides(global_batch_size=30)), A800)
    assert not p.fits
    assert "globalBatchSize 30" in p.verdict
    assert p.training.global_batch_size == 30


def test_user_overrides_are_kept():
    overrides = TrainingOverrides(
        micro_batch_size=2, learning_rate=1e-5, epochs=3, gradient_checkpointing=True
    )
    p = plan(request("1B", "lora", overrides=overrides), A40)
    assert p.fits
    t = p.training
    assert (t.micro_batch_size, t.learning_rate, t.epochs, t.gradient_checkpointing) == (2, 1e-5, 3, True)
    assert any("set by spec.training.gradientCheckpointing" in r for r in p.reasons)


def test_overrides_that_cannot_fit_are_reported_and_never_silently_changed():
    p = plan(
        request("8B", "lora", overrides=TrainingOverrides(micro_batch_size=8, gradient_checkpointing=False)),
        A40,
    )
    assert not p.fits
    assert p.training.micro_batch_size == 8
    assert not p.training.gradient_checkpointing
    assert any("leave microBatchSize/gradientCheckpointing to the planner" in s for s in p.suggestions)


def test_micro_batch_override_that_does_not_divide_the_batch_is_reported():
    overrides = TrainingOverrides(global_batch_size=32, micro_batch_size=3)
    p = plan(request("1B", "lora", overrides=overrides), A800)
    assert not p.fits
    assert "microBatchSize 3" in p.verdict


def test_learning_rate_default_depends_on_the_method():
    assert plan(request("1B", "full"), A800).training.learning_rate == 2e-5
    assert plan(request("1B", "lora"), A800).training.learning_rate == 2e-4


def test_packing_liger_fused_adamw_and_sdpa_are_on_by_default():
    t = plan(request("8B", "lora", max_seq_length=4096), A800).training
    assert t.packing and t.packing_length == 4096
    assert t.liger_kernels
    assert t.optimizer == "adamw_torch_fused"
    assert t.attention == "sdpa"
    assert t.precision == "bf16"


def test_liger_is_off_for_a_guessed_architecture():
    guessed = resolve_architecture("acme/unknown", None, 1_000_000_000)
    p = plan(PlanRequest(architecture=guessed), A800)
    assert not p.training.liger_kernels
    assert any("logits" in t.name and t.gib > 0.5 for t in p.memory.terms)


def test_every_card_trains_in_bf16_even_those_with_fp8_tensor_cores():
    for gpu in (L40S, A800, A40):
        assert plan(request("1B", "full"), gpu).training.precision == "bf16"


def test_fp8_is_refused_until_the_trainer_can_train_in_it():
    with pytest.raises(ValidationError, match="precision"):
        TrainingOverrides.model_validate({"precision": "fp8"})


def test_env_has_the_fragmentation_fix_and_nccl_settings_by_interconnect():
    single = plan(request("1B", "lora"), A40).env
    assert single["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert "NCCL_DEBUG" not in single
    nvlink = plan(request("1B", "lora", gpus_per_node=8), A800).env
    assert "NCCL_P2P_LEVEL" not in nvlink  # NCCL prefers NVLink itself; the setting would only restrict
    assert nvlink["NCCL_IB_DISABLE"] == "1"
    pcie = plan(request("1B", "lora", gpus_per_node=4), L40S).env
    assert "NCCL_P2P_LEVEL" not in pcie
    assert pcie["NCCL_DEBUG"] == "INFO"
    multi_node = plan(request("1B", "lora", gpus_per_node=8, nodes=2), A800).env
    assert "NCCL_IB_DISABLE" not in multi_node


def test_pod_resources_scale_with_gpus_and_model_size():
    small = plan(request("1B", "lora"), A800)
    assert small.resources.cpu == "8"
    assert small.resources.shm_size == "8Gi"
    qlora = plan(request("70B", "qlora"), A800)  # quantised straight onto the GPU: no copy on the host
    assert qlora.resources.memory == "48Gi"  # the 32 GiB floor, one process, the /dev/shm
    full = plan(request("8B", "full"), A800)  # the final model is saved through a bf16 copy on the host
    assert int(full.resources.memory.removesuffix("Gi")) >= 1.5 * 8.03e9 * 2 / 2**30
    eight = plan(request("1B", "lora", gpus_per_node=8), A800)
    assert eight.resources.cpu == "64"
    assert eight.resources.shm_size == "32Gi"
    assert eight.training.dataloader_workers == 4


def test_multi_node_full_fine_tuning_pods_hold_rank_0s_sharded_load_but_no_checkpoint_gather():
    # examples/a800-full-multinode.yaml: Qwen2.5 7B, 2 nodes x 4 A800, HSDP (sharded inside each node).
    p = plan(request("Qwen/Qwen2.5-7B-Instruct", "full", gpus_per_node=4, nodes=2), A800)
    assert p.fits and p.distributed.sharding == "hsdp"
    assert 84 < p.checkpoint_gib < 86  # fp32 weights + AdamW m and v
    assert p.model_dump(by_alias=True)["checkpointGiB"] == p.checkpoint_gib
    # Rank 0 alone loads the fp32 model (1.5 x 28.4 GiB), then 4 x 3 GiB and 16 GiB of /dev/shm; every
    # rank writes its own shards of the 85.1 GiB checkpoint, from its GPU.
    assert p.resources.memory == "72Gi"


def test_plan_all_gives_one_plan_per_gpu_type_in_order():
    assert [p.gpu for p in plan_all(request("1B", "lora"))] == ["A800-SXM4-80GB", "A40", "L40S"]


def test_full_fine_tuning_on_several_pcie_gpus_shards_when_states_do_not_fit_one_card():
    p = plan(request("8B", "full", gpus_per_node=4), L40S)
    assert p.fits
    assert p.distributed.sharding == "fsdp"


# --- the OOM ladder ---------------------------------------------------------------------------------


def test_oom_ladder_halves_micro_batch_then_checkpoints_then_shortens_rows_then_gives_up():
    r = request("1B", "full", max_seq_length=2048)
    p = plan(r, A800)
    micros, steps = [p.training.micro_batch_size], []
    while p.fits:
        p = replan_after_oom(r, A800, p)
        t = p.training
        assert t.global_batch_size == 64
        assert t.micro_batch_size * t.gradient_accumulation_steps == t.global_batch_size
        micros.append(t.micro_batch_size)
        steps.append((t.micro_batch_size, t.gradient_checkpointing, t.packing_length))
    assert micros[:4] == [8, 4, 2, 1]
    assert steps[3] == (1, True, 2048)
    assert steps[4] == (1, True, 1024)
    assert steps[5] == (1, True, 512)
    assert "nothing left to trade" in p.verdict
    assert len(p.ladder) == 7
    assert p.ladder[0].startswith("OOM at micro-batch 8")
    assert p.ladder[-1].startswith("exhausted")
    assert p.suggestions


def test_an_exhausted_oom_ladder_never_suggests_rows_as_long_as_those_that_ran_out_of_memory():
    r = request("8B", "lora", max_seq_length=2048)
    p = plan(r, L40S)
    while p.fits:
        p = replan_after_oom(r, L40S, p)
    assert p.training.packing_length == 512  # the shortest rows tried still ran out of memory
    assert not [s for s in p.suggestions if s.startswith("maxSeqLength") or "with ddp" in s], p.suggestions
    assert any(s.startswith("method qlora") for s in p.suggestions), p.suggestions


def test_an_exhausted_oom_ladder_plans_its_other_suggestions_with_the_rows_that_ran_out_of_memory():
    r = request("8B", "lora", gpus_per_node=2, max_seq_length=4096)
    p = plan(r, L40S)
    while p.fits:
        p = replan_after_oom(r, L40S, p)
    assert p.training.packing_length == 512
    assert any(s.startswith("method qlora at maxSeqLength 512 fits on 1 x L40S") for s in p.suggestions)
    assert any(s.startswith("fits on 2 x A800-SXM4-80GB at maxSeqLength 512") for s in p.suggestions)
    # Only sharding over more GPUs is planned at the job's own rows.
    assert all("at maxSeqLength 512" in s or "with fsdp" in s for s in p.suggestions), p.suggestions


def test_a_shorter_row_suggestion_lowers_the_packing_length_the_user_set():
    gemma = "google/gemma-2-9b"  # eager attention: its rows' score matrices make long rows expensive
    fixed = plan(request(gemma, "lora", max_seq_length=16384, packing_length=8192), L40S)
    assert not fixed.fits
    assert "packingLength 4096 fits" in " | ".join(fixed.suggestions)
    assert not [s for s in fixed.suggestions if s.startswith("maxSeqLength")]  # 4096 < packingLength 8192
    free = plan(request(gemma, "lora", max_seq_length=16384), L40S)
    assert "maxSeqLength 4096 fits" in " | ".join(free.suggestions)


def test_a_time_sliced_cards_plan_says_its_budget_assumes_the_job_has_the_card_to_itself():
    r = request("8B", "lora", max_seq_length=4096)
    shared = plan(r, replace(L40S, time_sliced=True))
    assert TIME_SLICED_REASON in shared.reasons
    assert TIME_SLICED_REASON not in plan(r, L40S).reasons
    # The operator re-plans after an OOM with the table's profile, found by the plan's key.
    assert TIME_SLICED_REASON in replan_after_oom(r, L40S, shared).reasons
    # status.plan.summary, which kubectl describe shows, says so too.
    assert shared.summary().endswith("time-sliced GPU: the budget assumes no other pod uses it")
    assert "time-sliced" not in plan(r, L40S).summary()


def test_oom_ladder_skips_what_the_user_fixed():
    overrides = TrainingOverrides(micro_batch_size=4, gradient_checkpointing=False)
    r = request("1B", "lora", overrides=overrides, packing_length=2048)
    p = plan(r, A800)
    after = replan_after_oom(r, A800, p)
    assert not after.fits
    assert after.training.micro_batch_size == 4
    assert not after.training.gradient_checkpointing


def test_oom_ladder_goes_to_checkpointing_when_micro_batch_is_fixed():
    r = request("1B", "lora", overrides=TrainingOverrides(micro_batch_size=4))
    after = replan_after_oom(r, A800, plan(r, A800))
    assert after.fits
    assert after.training.micro_batch_size == 4
    assert after.training.gradient_checkpointing
    assert "gradient checkpointing on" in after.ladder[0]


def test_oom_ladder_halving_an_odd_micro_batch_keeps_the_batch_exact():
    r = request("1B", "lora", overrides=TrainingOverrides(global_batch_size=24))
    p = plan(r, A800).model_copy(
        update={
            "training": plan(r, A800).training.model_copy(
                update={"micro_batch_size": 3, "gradient_accumulation_steps": 8}
            )
        }
    )
    after = replan_after_oom(r, A800, p)
    assert after.training.micro_batch_size == 1
    assert after.training.gradient_accumulation_steps == 24


# --- throughput model -------------------------------------------------------------------------------


def test_throughput_model_lands_within_10_percent_of_the_h200_anchors():
    h200 = profile_for_type("H200")
    tiny = resolve_architecture("TinyLlama/TinyLlama-1.1B")
    l7 = resolve_architecture("meta-llama/Llama-2-7b-hf")
    lora = LoraSettings(r=16, dropout=0.0)
    anchors = [
        (43549, ThroughputInputs(tiny, "full", h200, 4, 4096)),
        (34768, ThroughputInputs(tiny, "full", h200, 4, 4096, gradient_checkpointing=True)),
        (57126, ThroughputInputs(tiny, "full", h200, 4, 4096, liger_kernels=True)),
        (60207, ThroughputInputs(tiny, "full", h200, 8, 4096, liger_kernels=True)),
        (53304, ThroughputInputs(tiny, "full", h200, 2, 4096, 2, liger_kernels=True)),
        (11090, ThroughputInputs(l7, "lora", h200, 4, 4096, lora=lora)),
        (7849, ThroughputInputs(l7, "lora", h200, 4, 4096, gradient_checkpointing=True, lora=lora)),
        (10364, ThroughputInputs(l7, "lora", h200, 1, 4096, 4, lora=lora)),
        (12900, ThroughputInputs(l7, "lora", h200, 1, 4096, 4, liger_kernels=True, lora=lora)),
    ]
    for measured, inputs in anchors:
        assert predict(inputs).tokens_per_second == pytest.approx(measured, rel=0.10)


def test_a800_is_predicted_faster_than_a40_for_the_same_job():
    a800, a40 = plan(request("1B", "lora"), A800), plan(request("1B", "lora"), A40)
    assert a800.predicted_tokens_per_second > 1.5 * a40.predicted_tokens_per_second
    assert 0 < a40.predicted_mfu < 1


def test_a_model_that_soft_caps_its_attention_is_planned_with_eager_attention():
    gemma = PlanRequest(architecture=resolve_architecture("google/gemma-2-9b-it"), max_seq_length=4096)
    llama = PlanRequest(architecture=resolve_architecture("meta-llama/Llama-3.1-8B"), max_seq_length=4096)
    assert plan(gemma, A800).training.attention == "eager"
    assert any("attention eager" in r for r in plan(gemma, A800).reasons)
    assert plan(llama, A800).training.attention == "sdpa"


def test_a_users_micro_batch_without_a_global_batch_rounds_the_default_global_batch_to_it():
    p = plan(
        request("8B", "lora", overrides=TrainingOverrides(micro_batch_size=3), max_seq_length=4096), A800
    )
    t = p.training
    assert p.fits and t.micro_batch_size == 3 and t.global_batch_size % 3 == 0
    assert t.micro_batch_size * t.gradient_accumulation_steps == t.global_batch_size


def test_mistral_v0_1_packed_past_its_window_is_planned_with_eager_attention():
    long = plan(request("mistralai/Mistral-7B-v0.1", "lora", max_seq_length=8192), L40S)
    assert long.training.attention == "eager"
    assert any("sliding window of 4096" in r for r in long.reasons)
    short = plan(request("mistralai/Mistral-7B-v0.1", "lora", max_seq_length=4096), L40S)
    assert short.training.attention == "sdpa"


def test_a_mistral_7b_fine_tune_naming_no_version_is_planned_with_v0_1s_window():
    hermes = "teknium/OpenHermes-2.5-Mistral-7B"  # a fine-tune of v0.1
    assert plan(request(hermes, "lora", max_seq_length=8192), L40S).training.attention == "eager"
    v0_3 = plan(request("mistralai/Mistral-7B-Instruct-v0.3", "lora", max_seq_length=8192), L40S)
    assert v0_3.training.attention == "sdpa"


def test_checkpointing_that_lets_ddp_fit_beats_sharding_at_micro_batch_one():
    # examples/a40-multinode.yaml's shape: 8B LoRA on 2 nodes x 2 L40S over TCP. FSDP fits at micro-batch
    # 1 without recomputation but crosses the nodes every micro-batch; DDP with checkpointing does not.
    p = plan(request("8B", "lora", gpus_per_node=2, nodes=2, max_seq_length=4096), L40S)
    assert p.training.gradient_checkpointing and p.distributed.sharding == "ddp"
    unchecked = plan(
        request(
            "8B",
            "lora",
            gpus_per_node=2,
            nodes=2,
            max_seq_length=4096,
            overrides=TrainingOverrides(gradient_checkpointing=False),
        ),
        L40S,
    )
    assert p.predicted_tokens_per_second > 1.05 * unchecked.predicted_tokens_per_second
