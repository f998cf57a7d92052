"""The training alerts (SFTJobCheckpointTooOld, SFTJobTrainingStalled, SFTJobTrackerFailing,
SFTJobSlowerThanPlanned) over made-up series of one job's rank-0 trainer: when they fire and when they stay
quiet (a resume, a setup, an evaluation, a long checkpoint save, early stopping, a tracker that works, a
slow warm-up). All six training alerts count only the trainers this release's PodMonitor scrapes, not
another release's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import promrules
import yaml
from helmchart import NAMESPACE, RELEASE, helm, one, template_args
from promrules import quiet

# The Prometheus Operator labels the targets of a PodMonitor without jobLabel with
# job="<its namespace>/<its name>": here the chart's "<fullname>-trainers" in the release's namespace.
TRAINERS = f"{NAMESPACE}/{RELEASE}-sftjob-operator-trainers"
JOB_LABELS = f'job="{TRAINERS}",sftjob="j",namespace="n",pod="j-2-0",gpu="a800"'
LABELS = {"job": TRAINERS, "sftjob": "j", "namespace": "n", "pod": "j-2-0", "gpu": "a800"}


def run(tmp_path: Path, series: dict[str, str], checks: list[dict[str, Any]]) -> None:
    promrules.promtool_test(tmp_path, series, JOB_LABELS, checks)


def fires(minute: int, alert: str, description: str) -> dict[str, Any]:
    """``alert`` fires at ``minute`` for the job's series, saying ``description``."""
    return promrules.fires(minute, alert, LABELS, description)


CHECKPOINT = "SFTJobCheckpointTooOld"
STALLED = "SFTJobTrainingStalled"
TRACKER = "SFTJobTrackerFailing"


def trained_without_checkpoint(duration: str) -> str:
    return (
        f"n/j has trained for {duration} without completing a checkpoint; a restart now would lose that work."
    )


def test_a_resumed_attempt_is_not_paged_for_the_age_of_the_checkpoint_it_resumed_from(tmp_path: Path) -> None:
    # Attempt 2's pod comes up at 100m, resumed from a checkpoint saved at 5m (an hour-long outage);
    # its training loop starts at 110m and, at 90-minute threshold, saves nothing until 215m.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "_x100 300x120",
        "sftjob_train_attempt_start_timestamp_seconds": "_x100 0x9 6600x110",
        "sftjob_train_checkpoint_interval_seconds": "_x100 1800x120",
    }
    checks = [
        quiet(105, CHECKPOINT),
        quiet(130, CHECKPOINT),
        quiet(199, CHECKPOINT),
        fires(215, CHECKPOINT, trained_without_checkpoint("1h 45m 0s")),
    ]
    run(tmp_path, series, checks)


def test_an_attempt_that_never_completes_a_checkpoint_is_alerted(tmp_path: Path) -> None:
    # Step-based checkpoints whose interval is not measured yet (0): the threshold alone applies.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "0x300",
        "sftjob_train_attempt_start_timestamp_seconds": "60x300",
        "sftjob_train_checkpoint_interval_seconds": "0x300",
    }
    run(
        tmp_path,
        series,
        [quiet(60, CHECKPOINT), fires(300, CHECKPOINT, trained_without_checkpoint("4h 59m 0s"))],
    )


def test_an_attempt_still_setting_up_is_not_alerted_for_its_checkpoint_age(tmp_path: Path) -> None:
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "300x300",
        "sftjob_train_attempt_start_timestamp_seconds": "0x300",
        "sftjob_train_checkpoint_interval_seconds": "1800x300",
    }
    run(tmp_path, series, [quiet(300, CHECKPOINT)])


def test_a_sparse_checkpoint_interval_is_alerted_after_twice_the_interval_not_the_threshold(
    tmp_path: Path,
) -> None:
    # everyMinutes: 180, checkpoint and training start at 1m: overdue past 361m, fired 5 minutes on.
    series = {
        "sftjob_train_last_checkpoint_timestamp_seconds": "60x400",
        "sftjob_train_attempt_start_timestamp_seconds": "60x400",
        "sftjob_train_checkpoint_interval_seconds": "10800x400",
    }
    run(
        tmp_path,
        series,
        [
            quiet(180, CHECKPOINT),
            quiet(360, CHECKPOINT),
            fires(370, CHECKPOINT, trained_without_checkpoint("6h 9m 0s")),
        ],
    )


def test_a_stalled_job_is_alerted_once_it_has_made_no_step_for_stalled_minutes(tmp_path: Path) -> None:
    # Training since 1m, the last step (40) at 40m: 15 minutes without a step at 55m.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
    }
    checks = [quiet(54, STALLED), fires(56, STALLED, "n/j has been at step 40 for 15 minutes.")]
    run(tmp_path, series, checks)


def test_a_long_evaluation_is_not_alerted_as_stalled_but_a_hang_after_it_is(tmp_path: Path) -> None:
    # The last step (40) at 40m, then an evaluation from 41m to 71m (spec.evaluation), then nothing: a
    # stall from its end on, alerted stalledMinutes later.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
        'sftjob_train_phase{phase="evaluating"}': "0x40 1x30 0x30",
    }
    checks = [
        quiet(56, STALLED),
        quiet(71, STALLED),
        quiet(80, STALLED),
        quiet(86, STALLED),
        fires(87, STALLED, "n/j has been at step 40 for 15 minutes."),
    ]
    run(tmp_path, series, checks)


def test_the_checkpoint_saved_right_after_a_long_evaluation_is_not_alerted_as_stalled(tmp_path: Path) -> None:
    # The last step (40) at 40m, an evaluation from 41m to 71m, the checkpoint that follows it saved from
    # 71m to 74m, the next step at 75m: more than stalledMinutes without a step, none of it a stall.
    series = {
        "sftjob_train_step": "0+1x40 40x34 41+1x30",
        "sftjob_train_total_steps": "1000x110",
        "sftjob_train_attempt_start_timestamp_seconds": "60x110",
        'sftjob_train_phase{phase="evaluating"}': "0x40 1x30 0x40",
    }
    run(tmp_path, series, [quiet(minute, STALLED) for minute in (72, 73, 74, 75, 90, 105)])


def test_a_long_checkpoint_save_is_not_alerted_as_stalled_but_a_hang_after_it_is(tmp_path: Path) -> None:
    # The last step (40) at 40m, then a checkpoint save to slow storage from 41m to 71m (twice
    # stalledMinutes), then back to training but nothing: a stall from the save's end on, alerted
    # stalledMinutes later.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
        'sftjob_train_phase{phase="training"}': "1x40 0x30 1x30",
        'sftjob_train_phase{phase="saving"}': "0x40 1x30 0x30",
    }
    checks = [
        quiet(56, STALLED),
        quiet(65, STALLED),
        quiet(71, STALLED),
        quiet(80, STALLED),
        quiet(86, STALLED),
        fires(87, STALLED, "n/j has been at step 40 for 15 minutes."),
    ]
    run(tmp_path, series, checks)


def test_a_job_stopped_early_is_not_alerted_as_stalled_while_it_writes_its_output(tmp_path: Path) -> None:
    # Step 40 at 40m, its evaluation (41m to 51m) finds no improvement: the checkpoint is saved until 60m,
    # then early stopping makes step 40 the total and the output is written until 100m.
    series = {
        "sftjob_train_step": "0+1x40 40x60",
        "sftjob_train_total_steps": "1000x60 40x40",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
        'sftjob_train_phase{phase="evaluating"}': "0x40 1x10 0x50",
    }
    run(tmp_path, series, [quiet(minute, STALLED) for minute in (55, 60, 66, 67, 80, 100)])


def test_a_resumed_attempt_loading_its_model_is_not_alerted_as_stalled(tmp_path: Path) -> None:
    # Resumed at step 500: the step is known from the start, the loop starts at 61m, its first step
    # (slow: compiling, warming up) ends at 70m.
    series = {
        "sftjob_train_step": "500x69 501+1x30",
        "sftjob_train_total_steps": "1000x100",
        "sftjob_train_attempt_start_timestamp_seconds": "0x60 3660x39",
    }
    checks = [quiet(minute, STALLED) for minute in (20, 40, 60, 68, 90)]
    run(tmp_path, series, checks)


def test_a_job_hung_before_its_first_step_is_alerted_as_stalled(tmp_path: Path) -> None:
    series = {
        "sftjob_train_step": "0x60",
        "sftjob_train_total_steps": "1000x60",
        "sftjob_train_attempt_start_timestamp_seconds": "60x60",
    }
    run(tmp_path, series, [quiet(15, STALLED), fires(17, STALLED, "n/j has been at step 0 for 15 minutes.")])


def test_a_dropped_tracker_is_alerted_until_its_attempts_series_ends_and_not_during_setup(
    tmp_path: Path,
) -> None:
    attempt_2 = 'sftjob_train_tracking_active{tracker="wandb",pod="j-2-0"}'
    attempt_3 = 'sftjob_train_tracking_active{tracker="wandb",pod="j-3-0"}'
    series = {attempt_2: "_x2 1x3 0x9", attempt_3: "_x18 1x9"}  # none until started
    dropped = (
        "n/j is not logging to its wandb tracker: it failed to start, or failed to log three times in a row,"
        " and was dropped (its trainer log says why); training goes on, but that run gets nothing more from"
        " this attempt."
    )
    labels = LABELS | {"tracker": "wandb"}
    checks = [
        quiet(2, TRACKER),  # setting up: no tracker started yet
        quiet(5, TRACKER),
        promrules.fires(8, TRACKER, labels, dropped),
        quiet(23, TRACKER),  # attempt 2's series went stale with its pod, attempt 3 logs
    ]
    promrules.promtool_test(tmp_path, series, f'job="{TRAINERS}",sftjob="j",namespace="n",gpu="a800"', checks)


SLOWER = "SFTJobSlowerThanPlanned"


def slower(rate: int) -> str:
    return (
        f"n/j has trained at no more than {rate} tokens/s for 30 minutes, less than 0.5 of the rate its plan"
        " predicted for its GPUs."
    )


def test_a_job_slow_from_its_first_step_is_alerted_40_minutes_into_its_training(tmp_path: Path) -> None:
    # Planned at 1000 tokens/s, it trains at 300 from its first window on (a starved loader, NCCL over PCIe
    # after an NVLink went down): no faster past for SFTJobThroughputDropped to compare with. The loop
    # starts at 1m; the first 10 minutes are warm-up, then 30 minutes below half the plan.
    series = {
        "sftjob_train_planned_tokens_per_second": "1000x100",
        "sftjob_train_tokens_per_second": "0x2 300x100",
        "sftjob_train_step": "0+1x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
    }
    checks = [
        quiet(30, SLOWER),
        quiet(41, SLOWER),
        fires(42, SLOWER, slower(300)),
        fires(90, SLOWER, slower(300)),
    ]
    run(tmp_path, series, [*checks, quiet(90, "SFTJobThroughputDropped")])


def test_a_job_within_the_loose_ratio_of_its_plan_or_slow_only_while_warming_up_is_not_alerted(
    tmp_path: Path,
) -> None:
    # 60% of the plan (the planner is fitted on an H200 and predicts other cards to first order), and a
    # job whose first 10 minutes are slow (CUDA and NCCL start-up) before it reaches its plan.
    for measured in ("600x100", "100x10 900x90"):
        series = {
            "sftjob_train_planned_tokens_per_second": "1000x100",
            "sftjob_train_tokens_per_second": measured,
            "sftjob_train_step": "0+1x100",
            "sftjob_train_attempt_start_timestamp_seconds": "60x100",
        }
        run(tmp_path, series, [quiet(minute, SLOWER) for minute in (42, 60, 100)])


def test_a_slow_job_with_one_window_above_half_its_plan_in_30_minutes_is_not_alerted_then(
    tmp_path: Path,
) -> None:
    series = {
        "sftjob_train_planned_tokens_per_second": "1000x100",
        "sftjob_train_tokens_per_second": "300x49 800 300x50",  # 800 at 50m
        "sftjob_train_step": "0+1x100",
        "sftjob_train_attempt_start_timestamp_seconds": "60x100",
    }
    checks = [
        fires(49, SLOWER, slower(300)),
        quiet(50, SLOWER),
        quiet(80, SLOWER),
        fires(81, SLOWER, slower(300)),
    ]
    run(tmp_path, series, checks)


def test_a_slow_job_that_stops_stepping_is_handed_over_to_the_stall_alert(tmp_path: Path) -> None:
    # Slow from the start, then no step after 50m (hung): its last window's rate stays exported, but a
    # job without a step for stalledMinutes (15) is stalled, not slower than planned.
    series = {
        "sftjob_train_planned_tokens_per_second": "1000x120",
        "sftjob_train_tokens_per_second": "300x120",
        "sftjob_train_step": "0+1x50 50x70",
        "sftjob_train_total_steps": "1000x120",
        "sftjob_train_attempt_start_timestamp_seconds": "60x120",
    }
    checks = [
        fires(64, SLOWER, slower(300)),
        quiet(64, STALLED),
        quiet(65, SLOWER),
        fires(65, STALLED, "n/j has been at step 50 for 15 minutes."),
    ]
    run(tmp_path, series, checks)


# ---------------------------------------------------------------------------------------------------
# One release per team: each release's training rules see only the trainers its own PodMonitor scrapes.


def test_the_training_rules_match_the_job_label_of_their_releases_pod_monitor_in_every_selector() -> None:
    # Another release name and namespace than the other tests' (fixed) ones: the label follows both.
    sets = ("alerts.enabled=true", "metrics.podMonitor.enabled=true")
    out = helm(*template_args(sets=sets, namespace="team-b", release="other")).stdout
    docs = [d for d in yaml.safe_load_all(out) if d]
    monitor = one(docs, "PodMonitor")
    assert "jobLabel" not in monitor["spec"]  # else the targets' job label is a pod label's value
    job = f'job="{monitor["metadata"]["namespace"]}/{monitor["metadata"]["name"]}"'
    assert job == 'job="team-b/other-sftjob-operator-trainers"'
    (group,) = one(docs, "PrometheusRule")["spec"]["groups"]
    assert len(group["rules"]) == 6
    for rule in group["rules"]:
        selectors = re.findall(r"\b(sftjob_\w+)(\{[^}]*\})?", rule["expr"])
        assert selectors, rule["alert"]
        assert all(job in selector for _, selector in selectors), (rule["alert"], rule["expr"])


OTHER_TRAINER = 'job="team-b/other-sftjob-operator-trainers",sftjob="j",namespace="team-b",pod="j-1-0"'


def both_releases(series: dict[str, str]) -> dict[str, str]:
    """Each of ``series`` (a name, labels of its own allowed: its samples) from two trainers: this
    release's and one that another team's release scrapes (its own PodMonitor, namespace and job)."""
    ours = JOB_LABELS.removesuffix(',gpu="a800"')
    return {
        f"{name[:-1]},{trainer}}}" if name.endswith("}") else f"{name}{{{trainer}}}": values
        for name, values in series.items()
        for trainer in (ours, OTHER_TRAINER)
    }


def test_another_releases_trainers_are_not_alerted_by_this_release_but_its_own_are(tmp_path: Path) -> None:
    # Both teams' trainers go wrong the same way at once: a stall from 40m, no checkpoint ever, throughput
    # down to a tenth from 90m, 99% of GPU memory reserved, a dropped tracker. Each alert fires once, for
    # this release's trainer only.
    series = both_releases(
        {
            "sftjob_train_step": "0+1x40 40x140",
            "sftjob_train_total_steps": "1000x180",
            "sftjob_train_attempt_start_timestamp_seconds": "60x180",
            "sftjob_train_last_checkpoint_timestamp_seconds": "0x180",
            "sftjob_train_checkpoint_interval_seconds": "0x180",
            "sftjob_train_tokens_per_second": "1000x90 100x90",
            "sftjob_train_gpu_memory_reserved_bytes": "99x180",
            "sftjob_train_gpu_memory_total_bytes": "100x180",
            'sftjob_train_tracking_active{tracker="wandb"}': "0x180",
        }
    )
    dropped = (
        "n/j is not logging to its wandb tracker: it failed to start, or failed to log three times in a row,"
        " and was dropped (its trainer log says why); training goes on, but that run gets nothing more from"
        " this attempt."
    )
    checks = [
        fires(56, STALLED, "n/j has been at step 40 for 15 minutes."),
        fires(120, CHECKPOINT, trained_without_checkpoint("1h 59m 0s")),
        fires(
            130,
            "SFTJobThroughputDropped",
            "n/j trains at 100 tokens/s, less than 0.5 of its own rate an hour earlier.",
        ),
        fires(
            20,
            "SFTJobGPUMemoryNearlyFull",
            "n/j has 99% of GPU memory reserved; a longer batch may hit CUDA OOM.",
        ),
        promrules.fires(5, TRACKER, LABELS | {"tracker": "wandb"}, dropped),
    ]
    promrules.promtool_test(tmp_path, series, 'gpu="a800"', checks)
