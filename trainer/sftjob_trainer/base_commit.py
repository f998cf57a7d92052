"""The hub commit of the base model an attempt trains on: the one its checkpoints were trained on.

A hub model's ``model.revision`` (unset: ``main``) is a branch or a tag, which may move on while a job runs
for days. An attempt restarted after it moved would load another base under the adapters (or the tokenizer
and config of a full fine-tune) it resumes, without a word, and its output would name no base at all. So
an attempt loads a hub model at one commit (:func:`pin`): the one the newest complete checkpoint records
(``TrainState.model_commit``) when it is of the same model at the same ``model.revision``, else the one
that revision points at now. The config the attempt runs with names that commit as its ``model.revision``,
so the tokenizer, the config, the weights, a remote-code model's code, a merge's base and the adapter's
``adapter_config.json`` all name it too; what names the training (identity.py) stays the spec's, and a
resume of other training is refused as before. A ``model.path`` has no commit: nothing changes for it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from sftjob.config import TrainerConfig
from sftjob_trainer.checkpoints import newest_saved_state
from sftjob_trainer.distributed import DistContext
from sftjob_trainer.identity import compare, identity
from sftjob_trainer.model import COMMIT, resolve_commit

log = logging.getLogger(__name__)

# The identity fields (identity.identity) that say which base a checkpoint was trained on, and at which
# revision: a recorded commit is the job's only when they are the job's.
_BASE_FIELDS = ("model.name", "model.path", "model.revision")


def pin(config: TrainerConfig, ctx: DistContext) -> TrainerConfig:
    """Collective, before anything of the model loads: ``config`` with its hub model's ``model.revision``
    replaced by the commit this attempt trains on (:func:`_commit`), for the rest of the attempt. Rank 0
    looks it up and every rank loads its commit: a branch moving between the ranks' own lookups would give
    them different bases. ``config`` as it is for a ``model.path``, or when the commit is not known (the
    hub unreachable and nothing cached: the load then fails with its own error)."""
    source = config.model
    if source.name is None:
        return config
    commit: str | None = ctx.broadcast(_commit(config) if ctx.is_main else None)
    if commit is None:
        return config
    return config.model_copy(update={"model": source.model_copy(update={"revision": commit})})


def loaded(config: TrainerConfig) -> str | None:
    """The commit of the base a config :func:`pin` returned loads (``TrainState.model_commit``): its hub
    model's revision when that is a commit; None for a ``model.path``, or a revision :func:`pin` could not
    resolve."""
    revision = config.model.revision
    hub = config.model.name is not None
    return revision if hub and revision is not None and COMMIT.fullmatch(revision) else None


def _commit(config: TrainerConfig) -> str | None:
    """Rank 0: the commit the newest complete checkpoint records (:func:`_recorded`), else the one the
    job's revision points at now (``model.resolve_commit``)."""
    source = config.model
    recorded = _recorded(Path(config.checkpoints.dir), config)
    if recorded is None:
        commit = resolve_commit(source)
        if commit is not None:
            log.info(
                "loading commit %s of %s (model.revision %s)", commit, source.name, _shown(source.revision)
            )
        return commit
    if recorded != source.revision:
        log.info(
            "resuming on commit %s of %s, the one its checkpoints were trained on (model.revision %s may"
            " name another commit by now)",
            recorded,
            source.name,
            _shown(source.revision),
        )
    return recorded


def _recorded(root: Path, config: TrainerConfig) -> str | None:
    """The commit of the base the newest complete checkpoint in ``root`` was trained on, read from its
    state without loading it, when it was trained on this job's model at this job's ``model.revision``
    (unset and ``main`` being one, as identity.compare has them); None without one (a fresh start, an older
    trainer's checkpoint, another model or revision: the resume then says what it makes of it)."""
    try:
        saved = newest_saved_state(root)
    except (OSError, ValueError) as exc:
        log.info("the base commit of the newest checkpoint in %s is not known before it loads: %s", root, exc)
        return None
    commit = saved.get("model_commit") if isinstance(saved, dict) else None
    trained = saved.get("identity") if isinstance(saved, dict) else None
    if not isinstance(commit, str) or not isinstance(trained, dict):
        return None
    now = identity(config)
    base = compare(
        {key: trained[key] for key in _BASE_FIELDS if key in trained}, {key: now[key] for key in _BASE_FIELDS}
    )
    return commit if base.same else None


def _shown(revision: str | None) -> str:
    return "unset" if revision is None else revision
