"""A real Prometheus scrapes a real trainer run and the real operator; the dashboards and alerts must
work against what it holds.

Everything runs on loopback: the trainer (a tiny random Llama on the CPU) serves its metrics on a free
local port, the operator runs as a process against the local control plane and reconciles one SFTJob
through a restart after preemption, and Prometheus (the Debian `prometheus` package) scrapes both every second
with the chart's alert rules loaded. Nothing connects to a pod or node address of the fake cluster.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from helmchart import CHART, NAMESPACE, RELEASE, alert_groups
from operator_harness import wait_for

from sftjob import constants as c
from sftjob.failures import ExitCode
from sftjob_dev.cluster import Cluster, outside_pod_env
from sftjob_dev.ports import free_ports

pytestmark = [pytest.mark.e2e, pytest.mark.trainer]

ROOT = CHART.parents[1]
JOB = "prom-sft"
# What Grafana substitutes before a query reaches Prometheus. Scrapes are 1 s apart, so 15 s windows
# hold enough samples for rate() and friends.
GRAFANA_MACROS = {"$__rate_interval": "15s", "$__interval": "5s", "$__range": "2m"}
# dcgm-exporter needs an NVIDIA GPU and driver; its panels stay empty on this machine by design.
NEEDS_GPU_EXPORTER = "DCGM_"
DEADLINE = 240.0


def get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=10) as response:
        body: bytes = response.read()
        return body


def stop(process: subprocess.Popen[bytes], grace: float = 30) -> None:
    if process.poll() is None:
        process.send_signal(signal.SIGTERM)
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@dataclass
class Prometheus:
    url: str

    def query(self, expr: str) -> list[dict[str, Any]]:
        body = json.loads(get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr})))
        assert body["status"] == "success", (expr, body)
        result: list[dict[str, Any]] = body["data"]["result"]
        return result

    def api(self, path: str, **params: str) -> Any:
        body = json.loads(get(f"{self.url}/api/v1/{path}?" + urllib.parse.urlencode(params)))
        assert body["status"] == "success", (path, body)
        return body["data"]


@dataclass
class Scraped:
    prometheus: Prometheus
    namespace: str
    trainer_port: int
    operator_port: int
    rules_file: Path


def trainer_config(folder: Path, namespace: str, port: int) -> Path:
    from sftjob_trainer.tiny import make_tiny_model, write_dataset

    model = make_tiny_model(folder / "model")
    data = write_dataset(folder / "data.jsonl", "messages")
    config = {
        "job": {"namespace": namespace, "name": JOB, "attempt": 0},
        "model": {"path": str(model)},
        "dataset": {"path": str(data), "maxSeqLength": 64},
        "method": "lora",
        "lora": {"r": 4, "alpha": 8, "targetModules": ["q_proj", "v_proj"]},
        # Far more steps than the test waits for: the trainer must still be serving when queried.
        "training": {
            "maxSteps": 100000,
            "globalBatchSize": 4,
            "microBatchSize": 4,
            "precision": "fp32",
            "optimizer": "adamw_torch",
            "loggingEverySteps": 1,
            "dataloaderWorkers": 0,
        },
        "checkpoints": {"dir": str(folder / "checkpoints"), "everySteps": 10, "keep": 2},
        # Evaluated at every checkpoint: the dashboard's eval loss series exists too.
        "evaluation": {"fraction": 0.05},
        "outputDir": str(folder / "output"),
        "gpu": {"required": False},
        "report": {"enabled": False, "metricsPort": port},
        # A tracker: the dashboard's tracker-error series exists (at 0) too.
        "tracking": {"tensorboardDir": str(folder / "tensorboard")},
    }
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    return path


def sftjob(namespace: str) -> dict[str, Any]:
    return {
        "apiVersion": f"{c.API_GROUP}/{c.API_VERSION}",
        "kind": c.KIND,
        "metadata": {"name": JOB, "namespace": namespace},
        "spec": {
            "model": {"name": "meta-llama/Llama-3.1-8B-Instruct"},
            "dataset": {"name": "tatsu-lab/alpaca"},
            "gpu": {"type": "L40S", "count": 1},
            "restartPolicy": {"backoffSeconds": 0},
        },
    }


def prometheus_config(trainer_port: int, operator_port: int, namespace: str, rules: Path) -> dict[str, Any]:
    """Scrape both endpoints on loopback, labelled as the chart's monitors would label them."""
    return {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(rules)],
        "scrape_configs": [
            {
                # A PodMonitor's job label is "<its namespace>/<its name>" (the training rules match it).
                "job_name": f"{NAMESPACE}/{RELEASE}-sftjob-operator-trainers",
                "static_configs": [
                    {
                        "targets": [f"127.0.0.1:{trainer_port}"],
                        "labels": {"namespace": namespace, "pod": f"{JOB}-1-0"},
                    }
                ],
            },
            {
                # The ServiceMonitor's job label is the Service's name.
                "job_name": f"{RELEASE}-sftjob-operator-metrics",
                "static_configs": [
                    {"targets": [f"127.0.0.1:{operator_port}"], "labels": {"namespace": NAMESPACE}}
                ],
            },
        ],
    }


def pods_of(cluster: Cluster, namespace: str) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = cluster.kubectl_json(
        "-n", namespace, "get", "pods", "-l", f"{c.LABEL_JOB}={JOB}", "-o", "json"
    )["items"]
    return items


def running_attempt(cluster: Cluster, namespace: str, attempt: int) -> bool:
    return any(
        p["metadata"]["labels"].get(c.LABEL_ATTEMPT) == str(attempt) and p["status"].get("phase") == "Running"
        for p in pods_of(cluster, namespace)
    )


def preempt(cluster: Cluster, namespace: str, attempt: int) -> None:
    """End the attempt as a preempted trainer would (exit code 20 after its SIGTERM checkpoint)."""
    (pod,) = [
        p for p in pods_of(cluster, namespace) if p["metadata"]["labels"][c.LABEL_ATTEMPT] == str(attempt)
    ]
    cluster.kubectl(
        "-n",
        namespace,
        "annotate",
        "pod",
        pod["metadata"]["name"],
        "sim.sftjob.dev/outcome=fail",
        f"sim.sftjob.dev/exit-code={int(ExitCode.PREEMPTED)}",
        "sim.sftjob.dev/message=preempted (SIGTERM): checkpoint saved at step 0",
    )


@pytest.fixture(scope="module")
def scraped(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scraped]:
    prometheus_bin = shutil.which("prometheus")
    assert prometheus_bin, "install the Debian package: apt-get install -y --no-install-recommends prometheus"
    folder = tmp_path_factory.mktemp("prometheus")
    namespace = f"prom-{uuid.uuid4().hex[:6]}"
    trainer_port, operator_port, prometheus_port, liveness_port = free_ports(4)
    processes: list[subprocess.Popen[bytes]] = []
    env = outside_pod_env() | {"KUBECONFIG": str(cluster.kubeconfig), "HF_HUB_OFFLINE": "1"}

    def start(name: str, argv: list[str], extra_env: dict[str, str] | None = None) -> None:
        log = (folder / f"{name}.log").open("wb")
        processes.append(
            subprocess.Popen(argv, env=env | (extra_env or {}), stdout=log, stderr=subprocess.STDOUT)
        )

    try:
        config = trainer_config(folder, namespace, trainer_port)
        start("trainer", [sys.executable, "-m", "sftjob_trainer.train"], {"SFTJOB_CONFIG": str(config)})

        cluster.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "sftjob.io_sftjobs.yaml"))
        cluster.kubectl("create", "namespace", namespace)
        start(
            "operator",
            [
                sys.executable,
                "-m",
                "sftjob_operator",
                f"--namespace={namespace}",
                "--standalone",
                f"--metrics-port={operator_port}",
                f"--liveness=http://127.0.0.1:{liveness_port}/healthz",
                "--log-format=plain",
            ],
        )
        rules = folder / "rules.yaml"
        rules.write_text(yaml.safe_dump({"groups": alert_groups()}))
        (folder / "prometheus.yml").write_text(
            yaml.safe_dump(prometheus_config(trainer_port, operator_port, namespace, rules))
        )
        start(
            "prometheus",
            [
                prometheus_bin,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{prometheus_port}",
                "--log.level=warn",
            ],
        )
        prometheus = Prometheus(f"http://127.0.0.1:{prometheus_port}")

        # The operator's side: one job, preempted once, its second attempt running.
        cluster.kubectl("apply", "-f", "-", input=json.dumps(sftjob(namespace)))
        wait_for(
            "the first attempt's pod to run", lambda: running_attempt(cluster, namespace, 1), timeout=DEADLINE
        )
        preempt(cluster, namespace, 1)
        wait_for(
            "the second attempt to run", lambda: running_attempt(cluster, namespace, 2), timeout=DEADLINE
        )

        # The trainer's side: past its first checkpoints, with a minute of samples in Prometheus.
        def trainer_ready() -> bool:
            step = prometheus.query(f'sftjob_train_last_checkpoint_step{{sftjob="{JOB}"}} >= 20')
            samples = prometheus.query(f'count_over_time(sftjob_train_step{{sftjob="{JOB}"}}[1m]) >= 20')
            return bool(step and samples)

        wait_for("the trainer to checkpoint and be scraped", trainer_ready, timeout=DEADLINE)
        wait_for(
            "Prometheus to see the restart",
            lambda: bool(prometheus.query('sftjob_restarts_total{failure_class="Preempted"} >= 1')),
            timeout=60,
        )
        yield Scraped(prometheus, namespace, trainer_port, operator_port, rules)
    except BaseException:
        status = cluster.kubectl("-n", namespace, "get", "sftjobs,pods", "-o", "yaml", check=False).stdout
        sys.stderr.write(f"----- SFTJobs and pods -----\n{status[-6000:]}\n")
        for log in sorted(folder.glob("*.log")):
            sys.stderr.write(f"----- {log} -----\n{log.read_text(errors='replace')[-4000:]}\n")
        raise
    finally:
        for process in reversed(processes):
            stop(process)
        cluster.kubectl("delete", "namespace", namespace, "--wait=false", check=False)


def dashboard_queries() -> list[tuple[str, str, str]]:
    """(dashboard, panel title, PromQL) for every target of both dashboards."""
    out = []
    for path in sorted((CHART / "dashboards").glob("*.json")):
        dashboard = json.loads(path.read_text())
        for panel in dashboard["panels"]:
            for target in panel.get("targets", []):
                out.append((dashboard["uid"], panel["title"], target["expr"]))
    return out


def resolve(expr: str, namespace: str) -> str:
    for macro, value in GRAFANA_MACROS.items():
        expr = expr.replace(macro, value)
    return expr.replace("$namespace", namespace).replace("$sftjob", JOB).replace("$operator", ".+")


def test_every_dashboard_query_returns_series(scraped: Scraped) -> None:
    empty = []
    checked = 0
    for uid, title, expr in dashboard_queries():
        if NEEDS_GPU_EXPORTER in expr:
            continue
        checked += 1
        if not scraped.prometheus.query(resolve(expr, scraped.namespace)):
            empty.append(f"{uid} / {title}: {expr}")
    assert empty == []
    assert checked >= 40


def test_only_the_dcgm_panels_are_left_unchecked() -> None:
    skipped = [title for _, title, expr in dashboard_queries() if NEEDS_GPU_EXPORTER in expr]
    assert skipped == ["GPU utilisation (dcgm-exporter)"]


def test_dashboard_variables_find_the_job(scraped: Scraped) -> None:
    prometheus = scraped.prometheus
    assert scraped.namespace in prometheus.api("label/namespace/values", **{"match[]": "sftjob_train_step"})
    jobs = prometheus.api(
        "label/sftjob/values", **{"match[]": f'sftjob_train_step{{namespace="{scraped.namespace}"}}'}
    )
    assert jobs == [JOB]
    operators = prometheus.api("label/job/values", **{"match[]": "sftjob_operator_build_info"})
    assert operators == [f"{RELEASE}-sftjob-operator-metrics"]  # the fleet dashboard's operator variable


def metric_names(expr: str) -> set[str]:
    """Every sftjob_ metric an expression names (with or without a selector), and ``up``."""
    return set(re.findall(r"\b(sftjob_[a-zA-Z0-9_:]+)", expr)) | (
        {"up"} if re.search(r"\bup\{", expr) else set()
    )


def test_every_metric_an_alert_uses_is_scraped(scraped: Scraped) -> None:
    rules = [rule for group in alert_groups() for rule in group["rules"]]
    used = set().union(*(metric_names(rule["expr"]) for rule in rules))
    assert len(used) >= 10
    missing = [name for name in sorted(used) if not scraped.prometheus.api("series", **{"match[]": name})]
    assert missing == []


def test_prometheus_loads_and_evaluates_every_alert_rule(scraped: Scraped) -> None:
    def evaluated() -> list[dict[str, Any]]:
        groups = scraped.prometheus.api("rules")["groups"]
        return [r for g in groups for r in g["rules"]]

    wait_for(
        "every rule to be evaluated",
        lambda: all(r.get("lastEvaluation", "0001").startswith("20") for r in evaluated()),
        30,
    )
    rules = evaluated()
    assert {r["name"] for r in rules} == {rule["alert"] for g in alert_groups() for rule in g["rules"]}
    assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []


def test_promtool_accepts_the_rendered_alert_rules(scraped: Scraped) -> None:
    result = subprocess.run(
        ["promtool", "check", "rules", str(scraped.rules_file)], capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {sum(len(g['rules']) for g in alert_groups())} rules found" in result.stdout


@pytest.mark.parametrize("endpoint", ["trainer", "operator"])
def test_promtool_accepts_the_metrics_endpoint(scraped: Scraped, endpoint: str) -> None:
    port = scraped.trainer_port if endpoint == "trainer" else scraped.operator_port
    exposition = get(f"http://127.0.0.1:{port}/metrics")
    assert b"sftjob_" in exposition
    result = subprocess.run(["promtool", "check", "metrics"], input=exposition, capture_output=True)
    assert result.returncode == 0, (result.stdout + result.stderr).decode()
