"""Packing keeps examples whole, and every epoch says how many units it leaves out."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from sftjob.failures import TrainerError
from sftjob_trainer.batching import Schedule, make_units
from sftjob_trainer.data import IGNORE_INDEX, Example

pytestmark = pytest.mark.trainer


def test_packing_never_cuts_an_example() -> None:
    labels = np.where(np.arange(1500) < 1200, IGNORE_INDEX, np.arange(1500)).astype(np.int32)
    example = Example(np.arange(1500, dtype=np.int32), labels)
    assert make_units([example], 2048)[0].labels.tolist() == labels.tolist()
    with pytest.raises(ValueError, match="does not fit"):
        make_units([example], 1024)  # load_examples cuts to the row length first, counting what it cuts


def test_an_epoch_that_leaves_out_more_than_a_tenth_of_the_units_warns(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO):
        Schedule(units=50, micro_batch_size=4, accumulation=8, world_size=1, seed=0).validate()
    assert "WARNING" in caplog.text and "leaves out 18 (36.0%)" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.INFO):
        Schedule(units=330, micro_batch_size=4, accumulation=8, world_size=1, seed=0).validate()
    assert "leaves out 10 (3.0%)" in caplog.text and "WARNING" not in caplog.text


def test_a_dataset_smaller_than_one_step_fails() -> None:
    with pytest.raises(TrainerError, match="one optimizer step needs 32"):
        Schedule(units=31, micro_batch_size=4, accumulation=8, world_size=1, seed=0).validate()
