"""How the operator is set up before it reconciles: its flags are checked, and kopf is told to have
the API server send it only trainer pods."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import kopf
import pytest

from sftjob import constants as c
from sftjob_operator import handlers
from sftjob_operator.main import parse_args
from sftjob_operator.scheduling import default_products
from sftjob_operator.workqueue import WorkQueue


@pytest.mark.parametrize("value", ["0", "-5", "0.5", "inf", "nan", "1e999"])
def test_a_resync_period_below_a_second_or_not_finite_is_refused_naming_the_flag(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args([f"--resync-seconds={value}"])
    assert "--resync-seconds / SFTJOB_RESYNC_SECONDS must be a finite number of seconds >= 1" in (
        capsys.readouterr().err
    )


def test_a_resync_period_from_the_environment_is_checked_like_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SFTJOB_RESYNC_SECONDS", "0")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "SFTJOB_RESYNC_SECONDS" in capsys.readouterr().err
    monkeypatch.setenv("SFTJOB_RESYNC_SECONDS", "12.5")
    assert parse_args([]).resync_seconds == 12.5


def test_the_default_resync_period_is_the_handlers_one() -> None:
    assert parse_args([]).resync_seconds == handlers.RESYNC_SECONDS


def test_only_pods_with_the_job_label_are_listed_and_watched(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(handlers.Runtime, "queue", WorkQueue())
    monkeypatch.setattr(handlers.Runtime, "workers", [])
    settings = kopf.OperatorSettings()

    start: Any = handlers.configure  # kopf's decorators type them as its activity callbacks
    stop: Any = handlers.stop_workers

    async def start_and_stop() -> None:
        await start(settings=settings, sftjobs={}, trainer_pods={}, gpu_nodes={})
        await stop()

    asyncio.run(start_and_stop())
    selectors = settings.watching.label_selectors
    assert selectors.collect(kopf.Resource("", "v1", "pods")) == [c.LABEL_JOB]
    assert selectors.collect(kopf.Resource("metrics.k8s.io", "v1beta1", "pods")) == []
    assert selectors.collect(kopf.Resource("", "v1", "nodes")) == []
    assert selectors.collect(kopf.Resource(c.API_GROUP, c.API_VERSION, c.PLURAL)) == []


@pytest.mark.parametrize("value", ["abc", "-1", "65536", "80.5", ""])
def test_a_metrics_port_that_is_no_port_number_is_refused_naming_the_flag_and_the_variable(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SFTJOB_METRICS_PORT", value)
    with pytest.raises(SystemExit) as exited:
        parse_args([])
    assert exited.value.code == 2
    assert (
        "--metrics-port / SFTJOB_METRICS_PORT must be a port number from 1 to 65535"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--liveness=:8081/healthz"],
        ["--liveness=https://0.0.0.0:8081/healthz"],
        ["--liveness=http://0.0.0.0:99999/healthz"],
        ["--liveness=http://0.0.0.0:8081"],
        ["--peering="],
        ["--namespace="],
    ],
)
def test_a_liveness_url_peering_or_namespace_kopf_could_not_use_is_refused_before_it_starts(
    argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    flag = argv[0].split("=")[0]
    assert flag in capsys.readouterr().err


def test_the_default_liveness_url_and_an_ipv6_one_are_accepted() -> None:
    assert parse_args([]).liveness == "http://0.0.0.0:8081/healthz"
    assert parse_args(["--liveness=http://[::]:8081/healthz", "--standalone"]).liveness


@pytest.mark.parametrize(("value", "port"), [("0", 0), ("9090", 9090), ("65535", 65535)])
def test_a_metrics_port_may_be_any_port_or_zero_for_none(value: str, port: int) -> None:
    assert parse_args([f"--metrics-port={value}"]).metrics_port == port


def test_a_log_format_from_the_environment_is_checked_like_the_flag(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SFTJOB_LOG_FORMAT", "text")
    with pytest.raises(SystemExit):
        parse_args([])
    assert (
        "--log-format / SFTJOB_LOG_FORMAT must be one of json, plain, got 'text'" in capsys.readouterr().err
    )
    monkeypatch.setenv("SFTJOB_LOG_FORMAT", "plain")
    assert parse_args([]).log_format == "plain"


@pytest.mark.parametrize(
    ("value", "said"),
    [
        ("{not json", "the GPU product mapping is not JSON"),
        ("@/nonexistent/products.json", "No such file or directory"),
        ('{"A40": ["NVIDIA A40"]}', "products for A40 must be nvidia.com/gpu.product label values"),
        ('{"A40": ["NVIDIA-X"], "L40S": ["NVIDIA-X"]}', "'NVIDIA-X' is listed under both A40 and L40S"),
        ('{"A40": ["NVIDIA-L40S"]}', "listed under both A40 and L40S (L40S has it by default"),
    ],
)
def test_a_bad_gpu_product_mapping_is_refused_before_the_operator_starts(
    value: str, said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args([f"--gpu-products={value}"])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "--gpu-products / SFTJOB_GPU_PRODUCTS: " in err and said in err


def test_a_gpu_product_mapping_replaces_the_products_of_the_types_it_names(tmp_path: Path) -> None:
    mapping = tmp_path / "products.json"
    mapping.write_text('{"A40": ["NVIDIA-A40", "NVIDIA-A40-PCIE"]}')
    products = parse_args([f"--gpu-products=@{mapping}"]).products
    assert products["A40"] == ["NVIDIA-A40", "NVIDIA-A40-PCIE"]
    assert products["L40S"] == default_products()["L40S"]
