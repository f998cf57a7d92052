"""Operator at scale on the real control plane: SFTJobs against the floor of plain batch/v1 Jobs.

For each subject (``operator``, ``floor``) the harness starts its own local control plane (etcd,
kube-apiserver, controller manager, scheduler, KWOK) with N fake GPU nodes, creates jobs at a given
rate in cumulative stages (e.g. 100, 1,000, 5,000 live jobs) and, per stage, reports create -> pods
created / scheduled / Running latencies, jobs per second, the controller's CPU seconds and memory,
API server requests per job (split by verb and resource) and a quiet window's requests. Pods stay
Running (KWOK), so each job holds one GPU: the nodes must have a GPU per job.

    python benchmarks/operator_scale.py --nodes 500 --jobs 100,1000 --rate 100
    python benchmarks/operator_scale.py --nodes 1100 --jobs 100,1000,5000 --subject operator --profile

Writes ``<out>/<name>.json`` and ``<out>/<name>.md``; the control planes' logs stay in their run
folders (printed at the end).
"""

from __future__ import annotations

import argparse
import functools
import json
import shlex
import sys
import tempfile
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from kubernetes import client, config
from scale import REPO_ROOT, apimetrics, procstat, report
from scale.stage import Settings, run_probe, run_stage
from scale.subjects import Floor, Operator, Subject, component_pids
from scale.watch import Tracker
from scale.workload import DATASET, MODEL, demand, gpu_capacity, pools

from sftjob_dev import processes
from sftjob_dev.cluster import Cluster

NAMESPACE = "bench"
DESCRIPTIONS = {
    "operator": "one SFTJob per job; the sftjob operator makes its children and pod",
    "floor": (
        "one batch/v1 Job per job with the trainer pod's scheduling shape; the Job controller makes the pod"
    ),
}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nodes", type=int, default=500, help="fake GPU nodes, split 1:2:2 over A800/A40/L40S")
    p.add_argument("--jobs", default="100,1000", help="comma-separated live-job counts, one stage each")
    p.add_argument("--rate", type=float, default=100.0, help="creates offered per second")
    p.add_argument("--workers", type=int, default=16, help="concurrent create requests at most")
    p.add_argument(
        "--probe",
        type=int,
        default=100,
        help="jobs offered slowly after each stage to measure latency (0: none)",
    )
    p.add_argument("--probe-rate", type=float, default=10.0, help="the probe's creates per second")
    p.add_argument("--subject", choices=["operator", "floor", "both"], default="both")
    p.add_argument("--settle-timeout", type=float, default=300.0, help="seconds to wait for pods per stage")
    p.add_argument("--steady-seconds", type=float, default=30.0, help="quiet window after each stage")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--name", help="results file name without suffix (default: dated)")
    p.add_argument("--run-dir", type=Path, help="where the control planes' run folders go (default: temp)")
    p.add_argument("--profile", action="store_true", help="run the operator under cProfile (<name>.prof)")
    args = p.parse_args(argv)
    try:
        args.stages = sorted({int(x) for x in args.jobs.split(",") if x.strip()})
    except ValueError:
        p.error(f"--jobs must be comma-separated whole numbers, got {args.jobs!r}")
    if not args.stages or args.stages[0] < 1:
        p.error("--jobs needs at least one stage of >= 1 job")
    if args.nodes < 3 or args.rate <= 0 or args.workers < 1 or args.probe < 0 or args.probe_rate <= 0:
        p.error("--nodes must be >= 3, --rate and --probe-rate > 0, --workers >= 1 and --probe >= 0")
    total = args.stages[-1] + args.probe * len(args.stages)
    short = [t for t, need in demand(0, total).items() if need > gpu_capacity(pools(args.nodes))[t]]
    if short:
        p.error(
            f"{total} running jobs (stages and probes) need more {'/'.join(short)} GPUs than {args.nodes} "
            f"nodes have ({gpu_capacity(pools(args.nodes))}); use --nodes {-(-total * 5 // 24) + 3} or more"
        )
    return args


def api_client(cluster: Cluster, workers: int) -> client.ApiClient:
    configuration = client.Configuration()
    config.load_kube_config(config_file=str(cluster.kubeconfig), client_configuration=configuration)
    configuration.connection_pool_maxsize = workers + 4
    return client.ApiClient(configuration)


def make_subject(
    name: str, cluster: Cluster, api: client.ApiClient, args: argparse.Namespace, stem: str
) -> Subject:
    if name == "floor":
        return Floor(cluster, api, NAMESPACE)
    profile = args.out / f"{stem}.prof" if args.profile else None
    return Operator(cluster, api, NAMESPACE, cluster.workdir / "operator.log", profile)


def measure(name: str, args: argparse.Namespace, stem: str) -> dict[str, Any]:
    """One subject on its own fresh control plane, every stage in turn."""
    cluster = Cluster(tempfile.mkdtemp(prefix=f"sftjob-bench-{name}-", dir=args.run_dir))
    print(f"[{name}] starting a control plane with {args.nodes} nodes in {cluster.workdir}", flush=True)
    subject: Subject | None = None
    tracker: Tracker | None = None
    stages: list[dict[str, Any]] = []
    try:
        cluster.up(pools=pools(args.nodes), build=False, timeout=max(120.0, args.nodes / 4))
        api = api_client(cluster, args.workers)
        client.CoreV1Api(api).create_namespace(
            client.V1Namespace(metadata=client.V1ObjectMeta(name=NAMESPACE))
        )
        processes.wait_until(
            lambda: cluster.kubectl("-n", NAMESPACE, "get", "sa", "default", check=False).returncode == 0,
            component="kube-controller-manager (serviceaccount controller)",
            log=cluster.log("kube-controller-manager"),
            timeout=60,
        )
        subject = make_subject(name, cluster, api, args, stem)
        subject.start()
        tracker = Tracker(api, NAMESPACE, subject.kind)
        tracker.start()
        pids = {**component_pids(cluster), subject.controller: subject.controller_pid()}
        settings = Settings(
            args.rate, args.workers, args.settle_timeout, args.steady_seconds, args.probe, args.probe_rate
        )
        api_metrics = functools.partial(apimetrics.fetch, api)
        first = 0
        for live in args.stages:
            result = run_stage(subject, tracker, api_metrics, pids, first, max(live, first), settings)
            stages.append(result)
            pc = result["createToPodCreated"]
            print(
                f"[{name}] {live} live jobs: to pods created p50 {pc['p50']} p99 {pc['p99']} s "
                f"({pc['missing']} missing), {result['jobsPerSecond']} jobs/s, "
                f"{result['apiRequestsPerJob']} API requests/job, controller RSS "
                f"{result['controller']['rssMiB']} MiB",
                flush=True,
            )
            first = max(live, first)
            if settings.probe:
                result["probe"] = run_probe(subject, tracker, first, settings)
                pc = result["probe"]["createToPodCreated"]
                print(
                    f"[{name}] probe of {settings.probe} at {settings.probe_rate}/s with {first} live jobs: "
                    f"to pods created p50 {pc['p50']} p99 {pc['p99']} s ({pc['missing']} missing)",
                    flush=True,
                )
                first += settings.probe
    finally:
        if tracker is not None:
            tracker.stop()
        if subject is not None:
            subject.stop()
        cluster.down(quiet=True)
        print(f"[{name}] control plane stopped; logs in {cluster.logs_dir}", flush=True)
    return {"description": DESCRIPTIONS[name], "logs": str(cluster.workdir), "stages": stages}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    now = datetime.now(UTC)
    stem = args.name or f"operator-scale-{now:%Y-%m-%d}-{args.stages[-1]}"
    args.out.mkdir(parents=True, exist_ok=True)
    node_pools = pools(args.nodes)
    doc: dict[str, Any] = {
        "benchmark": "operator-scale",
        "date": now.isoformat(timespec="seconds"),
        "command": shlex.join(["python", "benchmarks/operator_scale.py", *argv]),
        "machine": procstat.machine(),
        "versions": report.versions(Cluster().bin_dir.name),
        "settings": {
            "nodes": args.nodes,
            "pools": node_pools,
            "gpuCapacity": sum(gpu_capacity(node_pools).values()),
            "stages": args.stages,
            "rate": args.rate,
            "workers": args.workers,
            "probe": args.probe,
            "probeRate": args.probe_rate,
            "steadySeconds": args.steady_seconds,
            "settleTimeout": args.settle_timeout,
            "job": {"model": MODEL, "dataset": DATASET, "method": "lora", "gpus": 1},
        },
        "subjects": {},
    }
    started = time.monotonic()
    names = ["floor", "operator"] if args.subject == "both" else [args.subject]
    for name in names:
        doc["subjects"][name] = measure(name, args, stem)
    subjects = doc["subjects"]
    if "operator" in subjects:
        doc["targets"] = report.targets(subjects["operator"]["stages"])
    if {"operator", "floor"} <= subjects.keys():
        doc["ratios"] = report.ratios(subjects["operator"]["stages"], subjects["floor"]["stages"])
    doc["wallSeconds"] = round(time.monotonic() - started, 1)
    (args.out / f"{stem}.json").write_text(json.dumps(doc, indent=2) + "\n")
    (args.out / f"{stem}.md").write_text(report.markdown(doc) + "\n")
    print(f"wrote {args.out / stem}.json and .md in {doc['wallSeconds']} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
