"""What the evaluations decide: when training stops early, and which weights the output is written from.

``spec.evaluation.earlyStopping`` ends training once ``patience`` evaluations in a row have not lowered
the lowest loss so far by more than ``minDelta``; ``spec.evaluation.finalModel`` Best writes the output
from the saved checkpoint with the lowest loss (or from the final weights when theirs is lower still).
Both read and write only :class:`~sftjob_trainer.checkpoints.TrainState`, which every checkpoint
carries: a resumed attempt goes on counting where the interrupted one stopped. Every rank computes the
same decisions from the same all-reduced losses, so no rank stops alone.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any

from sftjob.config import EvaluationSettings, TrainerConfig
from sftjob.constants import CHECKPOINT_PREFIX
from sftjob_trainer import checkpoint_loading, checkpoints
from sftjob_trainer.checkpoints import Trainables, TrainState
from sftjob_trainer.distributed import DistContext

log = logging.getLogger("sftjob_trainer")


def measured_on(state: TrainState, eval_set: dict[str, Any]) -> None:
    """This attempt evaluates on ``eval_set`` (``evaluation.fingerprint``), recorded in ``state``. Losses a
    resumed state measured on another set (an OOM re-plan cut held-out examples shorter or dropped some, a
    job recreated with another evaluation, a dataset changed in place) compare with none of this
    attempt's: the lowest and the best loss, the patience count and the last evaluation start again, with
    a warning, so that neither early stopping nor finalModel Best weighs one set's loss against another's.
    A state that records no set (an older trainer's) is taken to have measured on this one."""
    before, state.eval_set = state.eval_set, eval_set
    if not before or before == eval_set:
        return
    if state.eval_step is not None or state.lowest_eval_loss is not None or state.best_step is not None:
        log.warning(
            "resuming at step %d with other held-out examples (%s, was %s): the losses evaluated so far"
            " (lowest %s, best checkpoint %s) are not compared with this set's; early stopping and the"
            " best checkpoint start again",
            state.step,
            _described(eval_set),
            _described(before),
            state.lowest_eval_loss,
            state.best_step,
        )
    state.eval_loss = state.eval_step = state.lowest_eval_loss = None
    state.best_step = state.best_eval_loss = None
    state.evals_without_improvement = 0


def _described(eval_set: dict[str, Any]) -> str:
    return f"{eval_set.get('examples')} examples, {eval_set.get('targets')} target tokens"


def evaluated(state: TrainState, settings: EvaluationSettings) -> None:
    """Count the evaluation just recorded in ``state`` towards early stopping."""
    loss = state.eval_loss
    if loss is None or not math.isfinite(loss):
        state.evals_without_improvement += 1
    elif state.lowest_eval_loss is None:
        state.lowest_eval_loss, state.evals_without_improvement = loss, 0
    else:
        min_delta = settings.early_stopping.min_delta if settings.early_stopping else 0.0
        if loss < state.lowest_eval_loss - min_delta:
            state.evals_without_improvement = 0
        else:
            state.evals_without_improvement += 1
        state.lowest_eval_loss = min(state.lowest_eval_loss, loss)


def stops_early(state: TrainState, settings: EvaluationSettings | None) -> bool:
    """Whether the evaluations so far end training (``earlyStopping.patience`` without improvement)."""
    early = settings.early_stopping if settings is not None else None
    return early is not None and state.evals_without_improvement >= early.patience


def saving(state: TrainState) -> None:
    """A checkpoint of ``state.step`` is about to be saved: it becomes the best one when its weights
    were evaluated and their loss is the lowest of any saved checkpoint's."""
    if state.eval_step != state.step or state.eval_loss is None or not math.isfinite(state.eval_loss):
        return
    if state.best_eval_loss is None or state.eval_loss < state.best_eval_loss:
        state.best_step, state.best_eval_loss = state.step, state.eval_loss


def output_step(state: TrainState, settings: EvaluationSettings | None) -> int | None:
    """The checkpoint whose weights the output is written from, or None for the weights in memory: the
    last step's, or the best checkpoint's unless the final weights evaluated lower still."""
    if settings is None or settings.final_model != "Best" or state.best_step is None:
        return None
    if state.best_step == state.step:
        return None
    final = state.eval_loss if state.eval_step == state.step else None
    if final is not None and state.best_eval_loss is not None and final < state.best_eval_loss:
        return None
    return state.best_step


def load_output(config: TrainerConfig, parts: Trainables, state: TrainState, ctx: DistContext) -> int:
    """Collective: the weights the output is written from into the model (:func:`output_step`); returns
    their step. A best checkpoint that is gone, broken or whose tensors do not load leaves the last
    step's, with a warning (``checkpoint_loading.load_weights`` leaves the model as it was); only the storage
    failing, or permission denied, stops the run."""
    step = output_step(state, config.evaluation)
    if step is None:
        return state.step
    path = Path(config.checkpoints.dir) / f"{CHECKPOINT_PREFIX}{step}"
    problem = ctx.broadcast(checkpoints.problem(path) if ctx.is_main else None)
    if problem is None:
        problem = checkpoint_loading.load_weights(path, parts, ctx)
    if problem is not None:
        log.warning(
            "the best checkpoint %s cannot be read (%s): the output is the last step's", path, problem
        )
        return state.step
    log.info("the output is written from %s (evaluation loss %.4f)", path, state.best_eval_loss)
    return step
