"""The README's main-job command: the operator on the local cluster with real and simulated jobs.

``python -m sftjob_dev.demo up`` (what ``hack/demo.sh`` runs) brings the local cluster up, installs the
Helm chart into it, runs the operator on this machine as the chart's ServiceAccount (there is no
container runtime to run its Deployment, so the chart is installed with ``replicas=0`` and the same
process runs here with the Deployment's own arguments and environment), starts the local trainer
runner, applies a tiny job the runner backs with a real CPU trainer and the examples (whose pods KWOK
keeps Running on the fake GPU nodes), and shows the jobs moving. ``down`` stops the runner, the
operator and the cluster, leaving no process behind. PIDs are kept in ``<workdir>/local/demo.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from sftjob import constants as c
from sftjob_dev import processes
from sftjob_dev.cluster import REPO_ROOT, Cluster
from sftjob_dev.errors import ClusterError
from sftjob_dev.runner import STOP_GRACE_SECONDS, assets_dir, free_ports, local_dir

CHART = REPO_ROOT / "charts" / "sftjob-operator"
CRDS = REPO_ROOT / "crds"
EXAMPLES = REPO_ROOT / "examples"
DEMO_JOBS = EXAMPLES / "demo"
DEMO_JOB = "tiny-copy"
RELEASE = "sftjob-operator"
RELEASE_NAMESPACE = "sftjob-system"
NAMESPACE = "default"
MODEL_FOLDER = "tiny-llama"  # spec.model.path of the demo job
DATASET_FILE = "copy-task.jsonl"  # spec.dataset.path
DATASET_ROWS = 512
WATCH_SECONDS = 150.0
POLL_SECONDS = 2.0
START_TIMEOUT = 120.0
TOKEN_DURATION = "24h"
COMPONENTS = ("runner", "operator")  # stopped in this order
# The Deployment's flags the local operator replaces: its ports must be free ones on loopback.
LOCAL_FLAGS = ("--liveness", "--metrics-port", "--log-format")


def prepare_assets(workdir: Path) -> Path:
    """The tiny model and dataset the demo job names, where the runner mounts ``/model`` and ``/data``."""
    from sftjob_trainer.tiny import make_tiny_model, write_dataset

    root = assets_dir(workdir)
    model = root / "model" / MODEL_FOLDER
    if not (model / "config.json").is_file():
        make_tiny_model(model)
    data = root / "data" / DATASET_FILE
    if not data.is_file():
        write_dataset(data, "messages", rows=DATASET_ROWS)
    return root


def step(message: str) -> None:
    print(f"==> [{time.strftime('%H:%M:%S')}] {message}", flush=True)


class Demo:
    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.local = local_dir(cluster.workdir)
        self.state_file = self.local / "demo.json"

    # --- state ------------------------------------------------------------------------------------
    def _state(self) -> dict[str, Any]:
        try:
            state: dict[str, Any] = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {"pids": {}}
        return state

    def _record(self, name: str, pid: int) -> None:
        state = self._state()
        state["pids"][name] = pid
        state["python"] = sys.executable
        self.state_file.write_text(json.dumps(state, indent=2))

    def _running(self, name: str) -> bool:
        state = self._state()
        pid = state["pids"].get(name)
        return pid is not None and processes.is_running(pid, Path(state.get("python", sys.executable)))

    # --- up ---------------------------------------------------------------------------------------
    def up(self, watch_seconds: float) -> None:
        fresh = not self.cluster.is_up()
        step("local cluster: etcd, kube-apiserver, controller manager, scheduler, KWOK with fake GPU nodes")
        self.cluster.up()
        if fresh:
            self._clear_job_folders()
        self.local.mkdir(parents=True, exist_ok=True)
        step("tiny model and dataset for the demo job (CPU, no downloads)")
        prepare_assets(self.cluster.workdir)
        if self._running("operator"):
            step("operator already running")
        else:
            self._start_operator()
        if self._running("runner"):
            step("local trainer runner already running")
        else:
            step("local trainer runner (backs the demo job's pod with a real CPU trainer)")
            argv = [sys.executable, "-m", "sftjob_dev.runner", "--workdir", str(self.cluster.workdir)]
            self._record("runner", processes.start(argv, self.cluster.log("runner"), dict(os.environ)))
        step(f"the demo job {DEMO_JOB} (real trainer), then the examples (simulated by KWOK)")
        self.cluster.kubectl("-n", NAMESPACE, "apply", "-f", str(DEMO_JOBS))
        self._wait_scheduled(DEMO_JOB)
        self.cluster.kubectl("-n", NAMESPACE, "apply", "-f", str(EXAMPLES))
        step(f"watching the jobs (up to {watch_seconds:.0f}s, or until {DEMO_JOB} finishes)")
        self.watch(watch_seconds)
        self._hints()

    def _start_operator(self) -> None:
        helm = self.cluster.bin_dir / "helm"
        step(f"Helm chart {CHART.relative_to(REPO_ROOT)} as release {RELEASE_NAMESPACE}/{RELEASE}")
        result = subprocess.run(
            [
                str(helm), "upgrade", "--install", RELEASE, str(CHART),
                "--namespace", RELEASE_NAMESPACE, "--create-namespace",
                "--set", "replicas=0",  # the operator runs on this machine instead (no container runtime)
                "--wait", "--timeout", "120s",
            ],
            env={**os.environ, **self.cluster.env()},
            capture_output=True,
            text=True,
        )  # fmt: skip
        if result.returncode == 0:
            argv, env, kubeconfig = self._as_chart_deploys()
        else:
            print(
                f"warning: helm install failed, falling back to crds/ and the admin identity:\n"
                f"{result.stderr.strip()}",
                flush=True,
            )
            self.cluster.kubectl("apply", "-f", str(CRDS))
            argv, env, kubeconfig = ["--standalone"], {}, self.cluster.kubeconfig
        self.cluster.wait_established("sftjobs.sftjob.io")
        liveness, metrics = free_ports(2)
        argv = [a for a in argv if not a.startswith(LOCAL_FLAGS)]
        argv += [
            f"--liveness=http://127.0.0.1:{liveness}/healthz",
            f"--metrics-port={metrics}",
            "--log-format=plain",
        ]
        env = {**os.environ, **env, "KUBECONFIG": str(kubeconfig)}
        step(f"operator: python -m sftjob_operator {' '.join(argv)} (log {self.cluster.log('operator')})")
        pid = processes.start(
            [sys.executable, "-m", "sftjob_operator", *argv], self.cluster.log("operator"), env
        )
        self._record("operator", pid)
        processes.wait_until(
            lambda: _healthy(f"http://127.0.0.1:{liveness}/healthz"),
            component="operator",
            log=self.cluster.log("operator"),
            timeout=START_TIMEOUT,
            pid=pid,
        )
        print(f"operator metrics: http://127.0.0.1:{metrics}/metrics", flush=True)

    def _as_chart_deploys(self) -> tuple[list[str], dict[str, str], Path]:
        """The Deployment's arguments and plain environment, and a kubeconfig for its ServiceAccount."""
        deployments = self.cluster.kubectl_json(
            "-n", RELEASE_NAMESPACE, "get", "deployments", "-l", f"app.kubernetes.io/instance={RELEASE}"
        )["items"]
        if len(deployments) != 1:
            raise ClusterError(
                f"expected one operator Deployment in release {RELEASE}, found {len(deployments)}"
            )
        pod = deployments[0]["spec"]["template"]["spec"]
        container = pod["containers"][0]
        env = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        account = pod["serviceAccountName"]
        path = self.local / "operator.kubeconfig"
        self.cluster.service_account_kubeconfig(RELEASE_NAMESPACE, account, path, duration=TOKEN_DURATION)
        print(f"the operator runs as the chart's ServiceAccount {RELEASE_NAMESPACE}/{account}", flush=True)
        return list(container.get("args", [])), env, path

    def _wait_scheduled(self, job: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pods = self.cluster.kubectl_json("-n", NAMESPACE, "get", "pods", "-l", f"{c.LABEL_JOB}={job}")
            if any(p["spec"].get("nodeName") for p in pods["items"]):
                return
            time.sleep(1)
        print(f"warning: {job} has no scheduled pod after {timeout:.0f}s (kubectl describe sft {job})")

    def watch(self, seconds: float) -> None:
        """``kubectl get sft -w`` style: each row again whenever more than its age changed."""
        shown: dict[str, list[str]] = {}
        deadline = time.monotonic() + seconds
        while True:
            lines = self.cluster.kubectl("-n", NAMESPACE, "get", "sftjobs").stdout.splitlines()
            if not shown and lines:
                print(lines[0], flush=True)
            for line in lines[1:]:
                fields = line.split()
                if shown.get(fields[0]) != fields[:-1]:  # the last column is AGE
                    shown[fields[0]] = fields[:-1]
                    print(line, flush=True)
            phase = self.cluster.kubectl(
                "-n", NAMESPACE, "get", "sftjob", DEMO_JOB, "-o", "jsonpath={.status.phase}", check=False
            ).stdout
            if phase in ("Succeeded", "Failed") or time.monotonic() > deadline:
                return
            time.sleep(POLL_SECONDS)

    def _hints(self) -> None:
        workdir = self.cluster.workdir
        flag = "" if workdir == Cluster().workdir else f" --workdir {shlex.quote(str(workdir))}"
        job_dir = self.local / NAMESPACE / DEMO_JOB
        print(
            f"""
Everything keeps running. Look around:
  source <(.venv/bin/python -m sftjob_dev env{flag})
  kubectl get sft                         # all jobs; -o wide adds the plan
  kubectl describe sft {DEMO_JOB:<19}# conditions, plan, progress, events
  kubectl get pods -o wide                # trainer pods on the fake A800/A40/L40S nodes
  cat {job_dir}/checkpoints/final/summary.json   # the trainer's summary (spec.output.path "final")
  .venv/bin/tensorboard --logdir {job_dir}/checkpoints/tensorboard   # spec.tracking.tensorboard's curves
Logs: {self.cluster.logs_dir}/{{operator,runner,...}}.log; the real trainer: {job_dir}/*.log
Stop everything: hack/demo.sh down""",
            flush=True,
        )

    # --- down -------------------------------------------------------------------------------------
    def down(self) -> None:
        state = self._state()
        python = Path(state.get("python", sys.executable))
        for name in COMPONENTS:
            pid = state["pids"].get(name)
            # The runner waits for its trainers to save a checkpoint before it exits.
            if pid is not None and processes.stop(pid, python, grace=STOP_GRACE_SECONDS + 10):
                print(f"stopped {name} (PID {pid})", flush=True)
        self.state_file.unlink(missing_ok=True)
        self.cluster.down()
        self._clear_job_folders()

    def _clear_job_folders(self) -> None:
        """Jobs' checkpoints and logs live as long as the cluster; the tiny model, data and PIDs stay."""
        if not self.local.is_dir():
            return
        for entry in self.local.iterdir():
            if entry in (assets_dir(self.cluster.workdir), self.state_file):
                continue
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)


def _healthy(url: str) -> bool:
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(url, timeout=2) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sftjob_dev.demo", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["up", "down"])
    parser.add_argument(
        "--workdir", help="the cluster's run folder (default: $SFTJOB_CLUSTER_DIR or .run/cluster)"
    )
    parser.add_argument(
        "--watch-seconds", type=float, default=WATCH_SECONDS, help="how long `up` shows the jobs moving"
    )
    args = parser.parse_args(argv)
    demo = Demo(Cluster(args.workdir))
    try:
        if args.command == "up":
            demo.up(args.watch_seconds)
        else:
            demo.down()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: the cluster keeps running; `hack/demo.sh down` stops it", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
