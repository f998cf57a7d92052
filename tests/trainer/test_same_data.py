"""Ranks that read different data (a copy of the dataset per node) fail together with a DATA_ERROR instead of
hanging in collectives the others never join."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from sftjob.config import DatasetSource
from sftjob.failures import ExitCode
from sftjob_trainer.batching import make_units
from sftjob_trainer.data import IGNORE_INDEX, Example
from sftjob_trainer.same_data import DataCounts, difference
from sftjob_trainer.tiny import write_dataset
from tests.trainer.runs import RANKS, MakeConfig, torchrun, trainer_output

pytestmark = pytest.mark.trainer

# Rank 1 reads the config in SFTJOB_CONFIG_RANK1: another node's copy of the dataset.
RANK1_OWN_CONFIG = """
import os
if os.environ["RANK"] == "1":
    os.environ["SFTJOB_CONFIG"] = os.environ["SFTJOB_CONFIG_RANK1"]
from sftjob_trainer.train import main
main()
"""


# Rank 1 reaches the check long after rank 0, with collectives timing out in 3 s (NCCL's 30 min in a pod):
# one node downloads a big hub dataset that another has cached.
RANK1_LATE = """
import os, time
from datetime import timedelta
from sftjob_trainer import distributed, train

distributed.PROCESS_GROUP_TIMEOUT = timedelta(seconds=3)
if os.environ["RANK"] == "1":
    load_examples = train.load_examples

    def slow_download(*args, **kwargs):
        time.sleep(8)
        return load_examples(*args, **kwargs)

    train.load_examples = slow_download
train.main()
"""


def test_the_first_rank_that_read_other_data_than_rank_0_is_named() -> None:
    same, longer = DataCounts(128, 40, 5000, 0), DataCounts(168, 52, 6600, 0)
    files = DatasetSource(path="/data/train.jsonl")
    assert difference([same, same, same], files) is None
    problem = difference([same, longer, same, longer], files)
    assert problem is not None and problem.startswith("rank 1 (and 1 more ranks) read 168 rows (52 units")
    assert "rank 0 read 128 rows" in problem and "the dataset differs between nodes" in problem


def test_ranks_that_read_different_rows_of_a_hub_dataset_are_told_to_pin_its_revision() -> None:
    same, longer = DataCounts(128, 40, 5000, 0), DataCounts(168, 52, 6600, 0)
    hub = difference([same, longer], DatasetSource(name="org/data"))
    assert hub is not None and "pin spec.dataset.revision" in hub and "shared volume" not in hub
    files = difference([same, longer], DatasetSource(path="/data/train.jsonl"))
    assert files is not None and "a shared volume" in files and "revision" not in files


def _example(tokens: list[int], prompt: int = 2) -> Example:
    ids = np.array(tokens, dtype=np.int32)
    return Example(ids, np.where(np.arange(len(ids)) < prompt, IGNORE_INDEX, ids).astype(np.int32))


def test_ranks_holding_out_as_many_examples_but_other_ones_are_told_apart() -> None:
    units = make_units([_example(list(range(5, 15)))], None)
    held = [_example([5, 6, 7, 8]), _example([9, 10, 11])]
    other_lengths = [_example([5, 6, 7, 8, 9, 10]), _example([9, 10, 11])]  # more evaluation tokens
    other_tokens = [_example([5, 6, 7, 8]), _example([9, 10, 12])]  # as many tokens, other ones
    counts = [DataCounts.of(128, units, examples) for examples in (held, other_lengths, other_tokens)]
    assert {c.held_out for c in counts} == {2} and len(set(counts)) == 3
    assert DataCounts.of(128, units, list(held)) == counts[0]
    files = DatasetSource(path="/data")
    problem = difference(counts[:2], files)
    assert problem is not None and problem.startswith("rank 1 read 128 rows (1 units, 10 tokens, 2 held out")
    assert "2 held out with 5 target tokens" in problem and "2 held out with 3 target tokens" in problem
    assert difference([counts[0], counts[2]], files) is not None


def test_a_rank_that_reaches_the_data_check_long_after_the_others_is_waited_for(
    trainer_config: MakeConfig, termination_log: Path, tmp_path: Path
) -> None:
    config = trainer_config(
        training={"maxSteps": 2, "microBatchSize": 2, "gradientAccumulationSteps": 2},
        distributed={"nprocPerNode": RANKS, "sharding": "ddp"},
        checkpoints={"everySteps": 100},
    )
    script = tmp_path / "rank1_late.py"
    script.write_text(RANK1_LATE)
    assert torchrun(config, termination_log, [str(script)]) == ExitCode.OK, trainer_output(config)[-3000:]


def test_ranks_that_read_different_rows_all_exit_with_a_data_error_naming_the_rows(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {
        "training": {"microBatchSize": 2, "gradientAccumulationSteps": 2},
        "distributed": {"nprocPerNode": RANKS, "sharding": "ddp"},
    }
    config = trainer_config("messages", rows=128, name="node0", **overrides)
    other = json.loads(config.read_text())
    other["dataset"]["path"] = str(write_dataset(config.parent / "node1.jsonl", "messages", rows=168))
    rank1_config = config.parent / "config-node1.json"
    rank1_config.write_text(json.dumps(other))
    monkeypatch.setenv("SFTJOB_CONFIG_RANK1", str(rank1_config))
    script = config.parent / "rank1_own_config.py"
    script.write_text(RANK1_OWN_CONFIG)

    assert torchrun(config, termination_log, [str(script)]) != ExitCode.OK  # not hung: within the timeout
    log = (config.parent / "trainer.log").read_text(errors="replace")
    assert log.count(f"exiting with DATA_ERROR ({ExitCode.DATA_ERROR:d})") == RANKS, log[-3000:]
    assert termination_log.read_text().startswith(f"[exit {ExitCode.DATA_ERROR:d}] rank 1 read 168 rows")


def test_ranks_that_hold_out_as_many_but_different_examples_all_exit_with_a_data_error(
    trainer_config: MakeConfig, termination_log: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    overrides = {
        "training": {"microBatchSize": 2, "gradientAccumulationSteps": 2},
        "distributed": {"nprocPerNode": RANKS, "sharding": "ddp"},
        "evaluation": {"split": "validation"},
    }
    config = trainer_config("messages", rows=128, name="node0", **overrides)
    folders = {node: config.parent / node for node in ("node0", "node1")}
    for seed, folder in enumerate(folders.values(), start=3):  # the same training rows, other held-out ones
        write_dataset(folder / "train.jsonl", "messages", rows=128)
        write_dataset(folder / "validation.jsonl", "messages", rows=4, seed=seed)
    settings = json.loads(config.read_text())
    for node, folder in folders.items():
        settings["dataset"]["path"] = str(folder)
        (config.parent / f"config-{node}.json").write_text(json.dumps(settings))
    config = config.parent / "config-node0.json"
    monkeypatch.setenv("SFTJOB_CONFIG_RANK1", str(config.parent / "config-node1.json"))
    script = config.parent / "rank1_own_config.py"
    script.write_text(RANK1_OWN_CONFIG)

    assert torchrun(config, termination_log, [str(script)]) != ExitCode.OK  # not hung in the evaluation
    log = (config.parent / "trainer.log").read_text(errors="replace")
    assert log.count(f"exiting with DATA_ERROR ({ExitCode.DATA_ERROR:d})") == RANKS, log[-3000:]
    message = termination_log.read_text()
    assert message.startswith(f"[exit {ExitCode.DATA_ERROR:d}] rank 1 read 128 rows"), message
    assert message.count(" 4 held out with ") == 2, message
