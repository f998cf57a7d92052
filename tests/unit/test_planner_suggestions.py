"""What the planner suggests when a job does not fit: changes that fit, each a real plan, single changes
first, then a cheaper method with more GPUs or shorter rows; more GPUs at a global batch they split."""

from typing import Any

import pytest

from sftjob.config import Method, TrainingOverrides
from sftjob.gpus import profile_for_type
from sftjob.model_shapes import resolve_architecture
from sftjob.plan import Plan
from sftjob.planner import PlanRequest, plan

A800, A40, L40S = (profile_for_type(t) for t in ("A800", "A40", "L40S"))
LLAMA_70B, LLAMA_8B = "meta-llama/Llama-3.1-70B", "meta-llama/Llama-3.1-8B"


def request(model: str, method: Method, **kwargs: Any) -> PlanRequest:
    return PlanRequest(architecture=resolve_architecture(model), method=method, **kwargs)


def assert_planned(suggestion: str, p: Plan) -> None:
    """The suggestion is ``p``: it fits, and the suggestion quotes its numbers."""
    assert p.fits, p.verdict
    assert f"~{p.memory.total_gib:.1f}/{p.memory.budget_gib:.1f} GiB" in suggestion, (suggestion, p.summary())


def test_a_70b_full_job_far_beyond_an_a40_is_offered_a_cheaper_method_with_more_gpus_or_shorter_rows():
    suggestions = plan(request(LLAMA_70B, "full", max_seq_length=8192), A40).suggestions
    assert len(suggestions) == 2, suggestions
    lora, qlora = suggestions
    assert lora.startswith("method lora fits on 2 node(s) x 8 A40 with fsdp")
    assert_planned(lora, plan(request(LLAMA_70B, "lora", max_seq_length=8192, gpus_per_node=8, nodes=2), A40))
    assert qlora.startswith("method qlora at maxSeqLength 4096 fits on 1 x A800-SXM4-80GB")
    assert_planned(qlora, plan(request(LLAMA_70B, "qlora", max_seq_length=4096), A800))


@pytest.mark.parametrize("seq", [16384, 32768])
def test_a_70b_full_job_with_longer_rows_still_gets_a_suggestion_that_plans_as_fitting(seq: int):
    suggestions = plan(request(LLAMA_70B, "full", max_seq_length=seq), A40).suggestions
    assert suggestions
    qlora = next(s for s in suggestions if s.startswith("method qlora at maxSeqLength 4096 fits on 1 x A800"))
    assert_planned(qlora, plan(request(LLAMA_70B, "qlora", max_seq_length=4096), A800))


def test_single_changes_are_suggested_before_a_cheaper_method_with_more_gpus():
    suggestions = plan(request(LLAMA_70B, "full"), A40).suggestions
    assert suggestions[0].startswith("method qlora fits on 1 x A800-SXM4-80GB")
    assert suggestions[1].startswith("full fits on 8 node(s) x 8 A40 with fsdp")
    assert suggestions[-1].startswith("method lora fits on 1 node(s) x 8 A40 with fsdp")
    assert_planned(suggestions[-1], plan(request(LLAMA_70B, "lora", gpus_per_node=8), A40))


def test_the_jobs_method_at_shorter_rows_on_a_bigger_card_is_suggested_when_no_single_change_fits():
    suggestions = plan(request(LLAMA_70B, "qlora", max_seq_length=131072), A40).suggestions
    assert len(suggestions) == 1 and suggestions[0].startswith("maxSeqLength 4096 fits on 1 x A800-SXM4-80GB")
    assert_planned(suggestions[0], plan(request(LLAMA_70B, "qlora", max_seq_length=4096), A800))


def test_more_gpus_that_do_not_split_the_global_batch_are_suggested_at_the_next_batch_they_split():
    overrides = TrainingOverrides(global_batch_size=26)
    r = request(LLAMA_8B, "full", max_seq_length=8192, gpus_per_node=2, overrides=overrides)
    suggestions = plan(r, L40S).suggestions
    more = [s for s in suggestions if s.startswith("full fits on 1 node(s) x 8 L40S with fsdp")]
    assert more == [next(s for s in suggestions if "with fsdp at globalBatchSize 32 (" in s)], suggestions
    rounded = overrides.model_copy(update={"global_batch_size": 32})
    p = plan(r.model_copy(update={"gpus_per_node": 8, "overrides": rounded}), L40S)
    assert_planned(more[0], p)
    assert p.distributed.sharding == "fsdp" and p.training.global_batch_size == 32


def test_a_users_micro_batch_is_kept_and_the_global_batch_rounded_to_what_every_gpus_micro_batches_split():
    overrides = TrainingOverrides(global_batch_size=24, micro_batch_size=4)  # 3 rows per GPU on 8 GPUs
    r = request(LLAMA_8B, "full", gpus_per_node=2, overrides=overrides)
    more = [s for s in plan(r, L40S).suggestions if "8 L40S" in s]
    assert len(more) == 1 and "with fsdp at globalBatchSize 32 (" in more[0], more
    rounded = overrides.model_copy(update={"global_batch_size": 32})
    p = plan(r.model_copy(update={"gpus_per_node": 8, "overrides": rounded}), L40S)
    assert_planned(more[0], p)
    assert p.training.micro_batch_size == 4


def test_a_global_batch_the_larger_layout_splits_is_not_mentioned():
    overrides = TrainingOverrides(global_batch_size=32)
    r = request(LLAMA_8B, "full", max_seq_length=8192, gpus_per_node=2, overrides=overrides)
    suggestions = plan(r, L40S).suggestions
    assert any(s.startswith("full fits on 1 node(s) x 8 L40S with fsdp (") for s in suggestions), suggestions
    assert not any("globalBatchSize" in s for s in suggestions)


def test_a_job_no_change_fits_says_so_in_its_verdict_and_suggests_nothing():
    huge = PlanRequest(architecture=resolve_architecture("acme/huge", None, 2_000_000_000_000), method="full")
    p = plan(huge, A40)
    assert not p.fits and p.suggestions == []
    assert "no change the planner tried fits either" in p.verdict
    assert "up to 8 nodes x 8 GPUs" in p.verdict and "rows down to 512 tokens" in p.verdict
    assert p.reasons[-1] == f"does not fit: {p.verdict}"
