"""The operator's metrics keep the names of the cross-team contract and count what a pass changed."""

from __future__ import annotations

import re
import socket
from datetime import UTC, datetime, timedelta
from pathlib import Path
from urllib.request import urlopen

import pytest
from prometheus_client import REGISTRY

from sftjob.attempts import AttemptRecord
from sftjob.failures import FailureClass
from sftjob.job_status import Condition, GpuStatus, SFTJobStatus
from sftjob_operator import handlers, metrics

NOW = datetime(2026, 1, 1, 12, 0, tzinfo=UTC)
CONTRACT = {
    "sftjob_operator_reconcile_total", "sftjob_operator_reconcile_duration_seconds", "sftjob_jobs",
    "sftjob_operator_pods_created_total", "sftjob_restarts_total", "sftjob_oom_replans_total",
    "sftjob_job_time_to_scheduled_seconds", "sftjob_job_time_to_training_started_seconds",
    "sftjob_recovery_duration_seconds", "sftjob_restart_lost_steps", "sftjob_operator_watch_events_total",
    "sftjob_operator_build_info", "sftjob_jobs_finished_total",
}  # fmt: skip


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


def test_every_contract_metric_is_registered() -> None:
    names = {m.name for m in REGISTRY.collect()}
    counters = {n.removesuffix("_total") for n in CONTRACT}
    assert counters <= names


def test_the_first_running_pass_observes_the_time_to_training() -> None:
    before = sample("sftjob_job_time_to_training_started_seconds_count")
    running = SFTJobStatus(phase="Running", attempt=1)
    metrics.observe_pass(old=SFTJobStatus(), new=running, created=NOW - timedelta(seconds=7), now=NOW)
    assert sample("sftjob_job_time_to_training_started_seconds_count") == before + 1
    metrics.observe_pass(old=running, new=running, created=NOW, now=NOW)
    assert sample("sftjob_job_time_to_training_started_seconds_count") == before + 1


def test_a_job_that_ends_is_counted_once_by_its_result() -> None:
    before = sample("sftjob_jobs_finished_total", result="Failed")
    running, failed = SFTJobStatus(phase="Running", attempt=1), SFTJobStatus(phase="Failed", attempt=1)
    metrics.observe_pass(old=running, new=failed, created=NOW, now=NOW)
    metrics.observe_pass(old=failed, new=failed, created=NOW, now=NOW)  # a later pass, e.g. after a restart
    assert sample("sftjob_jobs_finished_total", result="Failed") == before + 1


def test_a_restart_is_counted_by_the_class_of_the_failure_before_it() -> None:
    failed = AttemptRecord(attempt=1, end_time=NOW, reason=FailureClass.CUDA_OOM, lost_steps=12)
    old = SFTJobStatus(attempt=1, attempts=[failed])
    new = SFTJobStatus(
        attempt=2, restarts=1, attempts=[failed, AttemptRecord(attempt=2, ladder_step="halve")]
    )
    before = sample("sftjob_restarts_total", failure_class="CudaOOM")
    replans = sample("sftjob_oom_replans_total")
    metrics.observe_pass(old=old, new=new, created=NOW, now=NOW)
    assert sample("sftjob_restarts_total", failure_class="CudaOOM") == before + 1
    assert sample("sftjob_oom_replans_total") == replans + 1


def test_scheduling_time_is_observed_when_the_scheduled_condition_turns_true() -> None:
    before = sample("sftjob_job_time_to_scheduled_seconds_count")
    scheduled = Condition(type="Scheduled", status="True", reason="PodsBound", last_transition_time=NOW)
    metrics.observe_pass(
        old=SFTJobStatus(attempt=1), new=SFTJobStatus(attempt=1, conditions=[scheduled]), created=NOW, now=NOW
    )
    assert sample("sftjob_job_time_to_scheduled_seconds_count") == before + 1


def test_the_jobs_gauge_counts_known_jobs_by_phase_and_gpu_type() -> None:
    running = SFTJobStatus(phase="Running", gpu=GpuStatus(type="A40"))
    metrics.track_job("ns", "a", running)
    metrics.track_job("ns", "b", running)
    assert sample("sftjob_jobs", phase="Running", gpu_type="A40") == 2
    metrics.track_job("ns", "a", SFTJobStatus(phase="Succeeded", gpu=GpuStatus(type="A40")))
    assert sample("sftjob_jobs", phase="Running", gpu_type="A40") == 1
    assert sample("sftjob_jobs", phase="Succeeded", gpu_type="A40") == 1
    metrics.track_job("ns", "a", None)
    metrics.track_job("ns", "b", None)
    assert sample("sftjob_jobs", phase="Running", gpu_type="A40") == 0
    assert sample("sftjob_jobs", phase="Succeeded", gpu_type="A40") == 0


def test_restart_counters_exist_at_zero_for_every_failure_class_before_the_first_restart() -> None:
    metrics.create_series()
    for failure_class in FailureClass:
        assert (
            REGISTRY.get_sample_value("sftjob_restarts_total", {"failure_class": str(failure_class)})
            is not None
        )
    assert REGISTRY.get_sample_value("sftjob_jobs_finished_total", {"result": "Succeeded"}) is not None


def test_reconcile_counters_exist_at_zero_for_every_result_before_the_first_pass() -> None:
    metrics.create_series()
    for result in metrics.RECONCILE_RESULTS:
        assert REGISTRY.get_sample_value("sftjob_operator_reconcile_total", {"result": result}) is not None


def test_every_result_a_pass_is_counted_by_is_one_the_not_reconciling_alert_knows() -> None:
    source = Path(handlers.__file__).read_text()
    counted = set(re.findall(r'result="(\w+)"', source))
    assert counted and counted <= set(metrics.RECONCILE_RESULTS)


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as probe:
            probe.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_the_metrics_endpoint_answers_on_ipv6_and_ipv4_alike() -> None:
    server = metrics.serve(0)
    try:
        port = server.server_port
        for url in (f"http://[::1]:{port}/metrics", f"http://127.0.0.1:{port}/metrics"):
            with urlopen(url, timeout=5) as response:
                assert b"sftjob_operator_build_info" in response.read(), url
    finally:
        server.shutdown()
        server.server_close()
