"""The checkpoint volume a job needs: refused at planning when the claim the operator makes is too small;
and quantities read as the CRD admits them."""

from __future__ import annotations

import re
from typing import Any

import pytest

from sftjob.gpus import profile_for_type
from sftjob.job_plan import plan_job
from sftjob.kube_names import POSITIVE_QUANTITY
from sftjob.spec import SFTJobSpec
from sftjob.storage import QUANTITY_SCALE, quantity_gib, quantity_value, too_small, volume_need

FULL_7B: dict[str, Any] = {
    "model": {"name": "Qwen/Qwen2.5-7B-Instruct"},
    "dataset": {"name": "HuggingFaceH4/ultrachat_200k"},
    "method": "full",
    "gpu": {"type": "A800", "count": 8},
}


def job(**changes: Any) -> tuple[SFTJobSpec, Any]:
    spec = SFTJobSpec.model_validate({**FULL_7B, **changes})
    return spec, plan_job(spec, profile_for_type("A800"))


@pytest.mark.parametrize(
    ("quantity", "gib"),
    [
        ("100Gi", 100),
        ("1.5Ti", 1536),
        ("500M", 500e6 / 2**30),
        ("67108864Ki", 64),  # node memory as kubectl shows it
        ("4294967296Ki", 4096),
        ("102400Mi", 100),
        ("1Pi", 2**20),
        ("107374182400", 100),
    ],
)
def test_memory_quantities_read_as_gib(quantity: str, gib: float) -> None:
    assert quantity_gib(quantity) == pytest.approx(gib)


def test_quantities_are_read_with_exactly_the_suffixes_the_crds_pattern_admits() -> None:
    suffixes = re.search(r"\(([^()]*)\)\?\$$", POSITIVE_QUANTITY)
    assert suffixes is not None and set(suffixes.group(1).split("|")) | {""} == set(QUANTITY_SCALE)
    assert quantity_value("500m") == pytest.approx(0.5) and quantity_value("64k") == 64_000


@pytest.mark.parametrize("text", ["64K", "1e9", "1Ei", "0", " 1Gi", "Gi"])
def test_text_the_crds_pattern_refuses_is_no_quantity_and_is_named(text: str) -> None:
    with pytest.raises(ValueError, match=re.escape(f"{text!r} is not a quantity above zero")):
        quantity_value(text)


def test_a_full_run_needs_its_checkpoints_plus_one_the_final_model_and_the_download() -> None:
    spec, plan = job()
    need = volume_need(spec, plan)
    assert need.checkpoints_gib == pytest.approx(4 * plan.checkpoint_gib)
    assert need.final_model_gib == pytest.approx(need.download_gib)  # bf16 out, as the bf16 base came in
    assert need.total_gib > 300


def test_the_default_claim_is_refused_for_a_7b_full_run_with_the_size_to_ask_for() -> None:
    spec, plan = job()
    problem = too_small(spec, plan)
    assert problem is not None and "default checkpoint claim (100Gi" in problem and "4 + 1" not in problem
    assert "3 + 1 checkpoints" in problem and "Gi or more" in problem


def test_an_unset_size_is_named_as_whoever_asks_knows_its_default() -> None:
    spec, plan = job()
    operators = too_small(spec, plan)
    assert operators is not None and "(100Gi, the operator's default: status.effective shows it)" in operators
    asked = too_small(spec, plan, "the built-in default {size} (the operator's may differ)")
    assert asked is not None and asked.startswith("the built-in default 100Gi (the operator's may differ)")


def test_a_checkpoint_size_in_kibibytes_is_checked_like_any_other() -> None:
    problem = too_small(*job(checkpoints={"size": "104857600Ki"}))  # 100Gi
    assert problem is not None and problem.startswith("spec.checkpoints.size 104857600Ki cannot hold the run")
    assert too_small(*job(checkpoints={"size": "524288000Ki"})) is None  # 500Gi


def test_a_claim_big_enough_or_a_volume_of_the_users_own_is_not_questioned() -> None:
    assert too_small(*job(checkpoints={"size": "500Gi"})) is None
    assert too_small(*job(checkpoints={"volume": {"persistentVolumeClaim": {"claimName": "ckpt"}}})) is None


def test_an_output_volume_of_its_own_takes_the_final_model_off_the_checkpoint_volume() -> None:
    spec, plan = job(output={"volume": {"persistentVolumeClaim": {"claimName": "out"}}})
    assert volume_need(spec, plan).final_model_gib == 0


def test_a_merged_adapter_takes_room_for_its_base_beside_the_adapter() -> None:
    adapter, plan = job(method="lora")
    merged, merged_plan = job(method="lora", output={"mergeAdapter": True})
    base = volume_need(adapter, plan).download_gib  # the hub's bf16 files, as the merged model is written
    assert volume_need(merged, merged_plan).final_model_gib == pytest.approx(
        volume_need(adapter, plan).final_model_gib + base
    )


def test_keeping_the_best_checkpoint_asks_room_for_one_checkpoint_more() -> None:
    spec, plan = job(evaluation={"fraction": 0.01, "finalModel": "Best"})
    need = volume_need(spec, plan)
    assert need.checkpoints_gib == pytest.approx(5 * plan.checkpoint_gib)
    assert "3 + 1 + 1 (the best) checkpoints" in need.describe(spec.checkpoints.keep, plan.checkpoint_gib)
