"""The packing the planner chooses for a model that runs its own code (spec.model.trustRemoteCode)."""

from sftjob.config import TrainingOverrides
from sftjob.gpus import profile_for_type
from sftjob.model_shapes import resolve_architecture
from sftjob.planner import PlanRequest, plan

A800 = profile_for_type("A800")


def _plan(**kwargs):
    request = PlanRequest(architecture=resolve_architecture("meta-llama/Llama-3.1-8B"), **kwargs)
    return plan(request, A800)


def test_remote_code_is_planned_without_packing_and_the_plan_says_why() -> None:
    p = _plan(remote_code=True)
    assert p.fits and not p.training.packing and p.training.packing_length is None
    assert any("packing off" in r and "trustRemoteCode" in r for r in p.reasons), p.reasons


def test_remote_code_packs_when_the_spec_asks_for_packing_or_a_packing_length() -> None:
    assert _plan(remote_code=True, overrides=TrainingOverrides(packing=True)).training.packing
    asked = _plan(remote_code=True, packing_length=1024).training
    assert asked.packing and asked.packing_length == 1024


def test_a_model_of_transformers_own_code_is_still_packed_by_default() -> None:
    assert _plan().training.packing


def test_a_job_trusting_remote_code_asks_the_planner_for_a_remote_code_plan() -> None:
    from sftjob.spec import SFTJobSpec, to_plan_request

    model = {"name": "internlm/internlm2_5-7b-chat", "trustRemoteCode": True, "parameters": 7_700_000_000}
    spec = SFTJobSpec.model_validate({"model": model, "dataset": {"name": "tatsu-lab/alpaca"}})
    assert to_plan_request(spec, gpus_per_node=1, nodes=1).remote_code


def test_remote_code_of_a_liger_family_is_planned_without_liger_and_with_its_logits_counted() -> None:
    native, remote = _plan(), _plan(remote_code=True)
    assert native.training.liger_kernels and not remote.training.liger_kernels
    assert any("Liger kernels off" in r and "trustRemoteCode" in r for r in remote.reasons), remote.reasons
    logits = next(term for term in remote.memory.terms if term.name == "logits")
    assert "vocab" in logits.note  # counted whole: the trainer computes the loss from them
