"""One plan per GPU profile the job may land on, made at admission and re-derived on every pass.

A job for one GPU type is planned for that type's cards; ``Any`` or an ordered list is planned for
every candidate card; a nodeSelector on the GPU product label narrows them to that product's card
(``sftjob.gpu_products``, the cards ``sftjob plan`` shows). The ConfigMap carries all of them (the
trainer picks its row from the device it finds), the affinity keeps the pods off cards whose plan does
not fit, and ``status.plan`` shows the plan of the card the pods landed on. Planning is pure and
memoised on the spec, so re-deriving it on every reconcile pass costs nothing after the first.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

from kubernetes.utils.quantity import parse_quantity

from sftjob import constants as c
from sftjob.gpu_products import GpuCards, ProductMap, cards_for_job
from sftjob.gpus import GpuProfile
from sftjob.job_plan import plan_job
from sftjob.job_status import PlanStatus
from sftjob.plan import Plan
from sftjob.spec import SFTJobSpec
from sftjob.storage import too_small
from sftjob_operator.conditions import Reason

PlanFn = Callable[[SFTJobSpec, GpuProfile], Plan]


class PlanningError(Exception):
    """No plan can be made: ``reason`` is the condition reason, the message says what to change."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class CandidatePlans:
    """Plans by GPU profile key, in preference order, and which product labels each serves."""

    plans: dict[str, Plan]
    profile_by_product: dict[str, str]

    @property
    def fitting(self) -> dict[str, Plan]:
        return {key: p for key, p in self.plans.items() if p.fits}

    @property
    def first(self) -> Plan:
        """The plan for the most preferred card that fits."""
        return next(iter(self.fitting.values()))

    def memory_for(self, node_rank: int) -> str:
        """The memory request of the pod of ``node_rank``: the largest of the fitting cards' plans, as the
        pod is made before it lands, and its trainer runs the plan of the card it lands on (sharded on one
        card, rank 0 loads the model on the CPU; replicated on another, straight onto the GPU)."""
        return max((p.resources.memory_for(node_rank) for p in self.fitting.values()), key=parse_quantity)

    def allowed_products(self) -> list[str]:
        return [product for product, key in self.profile_by_product.items() if self.plans[key].fits]

    def for_product(self, product: str) -> Plan | None:
        key = self.profile_by_product.get(product)
        return None if key is None else self.plans[key]


def planner_plan(spec: SFTJobSpec, profile: GpuProfile) -> Plan:
    """The planner's plan for the job on ``profile``, the user's resources applied (the production
    :data:`PlanFn`)."""
    return plan_job(spec, profile)


def plan_candidates(spec: SFTJobSpec, products: ProductMap, plan_fn: PlanFn = planner_plan) -> CandidatePlans:
    """Plans for every card the job may land on (:func:`sftjob.gpu_products.cards_for_job`); raises
    PlanningError when none can run it, the card its nodeSelector names included."""
    cards = cards_for_job(spec, products)
    plans = {key: _cached_plan(plan_fn, spec, profile) for key, profile in cards.profiles.items()}
    found = CandidatePlans(plans, cards.profile_by_product)
    if not found.fitting:
        raise PlanningError(Reason.DOES_NOT_FIT, _no_fit_message(spec, cards, plans))
    return found


def check_checkpoint_volume(spec: SFTJobSpec, plans: CandidatePlans) -> None:
    """Raises PlanningError when the claim the operator makes cannot hold the run (checkpoint sizes do
    not depend on the card)."""
    try:
        problem = too_small(spec, plans.first)
    except ValueError:  # a model the planner could not size has failed already; a stand-in plan_fn's
        return
    if problem is not None:
        raise PlanningError(Reason.CHECKPOINT_VOLUME_TOO_SMALL, problem)


def plan_status(plan: Plan) -> PlanStatus:
    return PlanStatus(
        gpu=plan.gpu,
        summary=plan.summary(),
        micro_batch_size=plan.training.micro_batch_size,
        gradient_accumulation_steps=plan.training.gradient_accumulation_steps,
        global_batch_size=plan.training.global_batch_size,
        gradient_checkpointing=plan.training.gradient_checkpointing,
        precision=plan.training.precision,
        estimated_peak_gib=round(plan.memory.total_gib, 2),
        capacity_gib=round(plan.memory.budget_gib, 2),
        fits=plan.fits,
    )


def _cached_plan(plan_fn: PlanFn, spec: SFTJobSpec, profile: GpuProfile) -> Plan:
    try:
        return _memo(plan_fn, spec.model_dump_json(by_alias=True, exclude_none=True), profile)
    except ValueError as err:  # the model cannot be sized, or the planner rejects the request
        raise PlanningError(Reason.UNKNOWN_MODEL_SIZE, str(err)) from err


@functools.lru_cache(maxsize=512)
def _memo(plan_fn: PlanFn, spec_json: str, profile: GpuProfile) -> Plan:
    return plan_fn(SFTJobSpec.model_validate_json(spec_json), profile)


def _no_fit_message(spec: SFTJobSpec, cards: GpuCards, plans: dict[str, Plan]) -> str:
    if not plans:
        return "no GPU profile is known for the products of spec.gpu.type"
    verdicts = [
        f"{key}: {(p.reasons or ['does not fit'])[-1].removeprefix('does not fit: ')}"
        for key, p in plans.items()
    ]
    suggestions = next((p.suggestions for p in plans.values() if p.suggestions), [])
    advice = f"; try: {'; '.join(suggestions[:3])}" if suggestions else ""
    where = spec.gpu.describe()
    if cards.selected is not None:
        where += f" narrowed by spec.nodeSelector {c.GFD_PRODUCT}={cards.selected}"
    return f"{spec.method} does not fit on {where}: {' | '.join(verdicts)}{advice}"
