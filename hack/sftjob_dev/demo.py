"""The README's main-job command: the operator on the local cluster with real and simulated jobs.

``python -m sftjob_dev.demo up`` (what ``hack/demo.sh`` runs) brings the local cluster up, installs the
Helm chart into it, runs the operator on this machine as the chart's ServiceAccount (there is no
container runtime to run its Deployment, so the chart is installed with ``replicas=0`` and the same
process runs here with the Deployment's own arguments and environment), starts the local trainer
runner, applies a tiny job the runner backs with a real CPU trainer and the examples (whose pods KWOK
keeps Running on the fake GPU nodes), and shows the jobs moving. ``down`` stops the runner, the
operator and the cluster, leaving no process behind. PIDs are kept in ``<workdir>/local/demo.json``
with the fingerprint of the cluster's CA, so an operator or runner left from an earlier cluster is
stopped and started afresh instead of being reused.
"""

from __future__ import annotations

import argparse
import hashlib
import json
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
from sftjob_dev.cluster import LONG_LIVED_TOKEN, REPO_ROOT, Cluster, outside_pod_env
from sftjob_dev.errors import ClusterError
from sftjob_dev.ports import free_ports
from sftjob_dev.runner import STOP_GRACE_SECONDS, assets_dir, local_dir

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
COMPONENTS = ("runner", "operator")  # stopped in this order
ACTIVE_PHASES = ("Pending", "Running", "Restarting")  # the demo job still on its way to Succeeded
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
        state["cluster"] = self._cluster_id()
        self.state_file.write_text(json.dumps(state, indent=2))

    def _cluster_id(self) -> str:
        """The fingerprint of the cluster's CA: every `up` of a cluster makes a new one."""
        return hashlib.sha256(self.cluster.pki.ca_crt.read_bytes()).hexdigest()

    def _running(self, name: str) -> bool:
        state = self._state()
        pid = state["pids"].get(name)
        return pid is not None and processes.is_running(pid, Path(state.get("python", sys.executable)))

    def _stop_recorded(self) -> None:
        """Stop the recorded runner and operator (the runner first lets its trainers save a checkpoint)."""
        state = self._state()
        python = Path(state.get("python", sys.executable))
        for name in COMPONENTS:
            pid = state["pids"].get(name)
            if pid is not None and processes.stop(pid, python, grace=STOP_GRACE_SECONDS + 10):
                print(f"stopped {name} (PID {pid})", flush=True)
        self.state_file.unlink(missing_ok=True)

    def _stop_stale(self) -> None:
        """An operator or runner recorded under another cluster talks to an API server that is gone
        (its token and CA are that cluster's): stop it, so `up` starts both afresh."""
        state = self._state()
        if state["pids"] and state.get("cluster") != self._cluster_id():
            step("stopping the operator and runner left from an earlier cluster")
            self._stop_recorded()

    # --- up ---------------------------------------------------------------------------------------
    def up(self, watch_seconds: float) -> None:
        """Bring everything up and watch; raises ClusterError when the demo job or a process failed."""
        fresh = not self.cluster.is_up()
        step("local cluster: etcd, kube-apiserver, controller manager, scheduler, KWOK with fake GPU nodes")
        self.cluster.up()
        self.local.mkdir(parents=True, exist_ok=True)
        self._stop_stale()
        if fresh:
            self._clear_job_folders()
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
            self._record("runner", processes.start(argv, self.cluster.log("runner"), outside_pod_env()))
        step(f"the demo job {DEMO_JOB} (real trainer), then the examples (simulated by KWOK)")
        self.cluster.kubectl("-n", NAMESPACE, "apply", "-f", str(DEMO_JOBS))
        self._wait_scheduled(DEMO_JOB)
        self.cluster.kubectl("-n", NAMESPACE, "apply", "-f", str(EXAMPLES))
        step(f"watching the jobs (up to {watch_seconds:.0f}s, or until {DEMO_JOB} finishes)")
        self.watch(watch_seconds)
        self._verdict(watch_seconds)
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
            env={**outside_pod_env(), **self.cluster.env()},
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
        # Without the variables of a pod this may run in: the operator must act on the local cluster.
        env = {**outside_pod_env(), **env, "KUBECONFIG": str(kubeconfig)}
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
        # The cluster keeps running after the demo: the operator's token must outlast it.
        self.cluster.service_account_kubeconfig(RELEASE_NAMESPACE, account, path, duration=LONG_LIVED_TOKEN)
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
        """``kubectl get sft -w`` style: each row again whenever more than its age changed; until the
        demo job ends, the operator or the runner stops, or `seconds` pass."""
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
            ended = self._job_status().get("phase") in ("Succeeded", "Failed")
            if ended or self._stopped() or time.monotonic() > deadline:
                return
            time.sleep(POLL_SECONDS)

    def _job_status(self) -> dict[str, Any]:
        result = self.cluster.kubectl("-n", NAMESPACE, "get", "sftjob", DEMO_JOB, "-o", "json", check=False)
        if result.returncode != 0:
            return {}
        status: dict[str, Any] = json.loads(result.stdout).get("status") or {}
        return status

    def _stopped(self) -> list[str]:
        """The demo's own processes that no longer run."""
        return [name for name in COMPONENTS if not self._running(name)]

    def _verdict(self, watch_seconds: float) -> None:
        """Say how the demo job did; raise ClusterError when it failed or the operator or runner died."""
        status = self._job_status()
        phase = status.get("phase") or "without a phase"
        conditions: list[dict[str, str]] = status.get("conditions") or []
        running = next((x for x in conditions if x.get("type") == "Running"), {})
        why = ": ".join(filter(None, (running.get("reason"), running.get("message")))) or "no reason given"
        steps = (status.get("progress") or {}).get("summary")
        progress = f"{steps} steps" if steps else "no steps yet"
        logs = (
            f"operator log {self.cluster.log('operator')}, runner log {self.cluster.log('runner')}, "
            f"the trainer's {self.local / NAMESPACE / DEMO_JOB}/*.log"
        )
        stopped = self._stopped()
        if stopped:
            raise ClusterError(
                f"the {' and '.join(stopped)} stopped running ({DEMO_JOB} is {phase}, {progress}); "
                f"the end of each log says why: {logs}"
            )
        if phase == "Succeeded":
            step(f"{DEMO_JOB} Succeeded: {progress} trained for real on the CPU")
        elif phase in ACTIVE_PHASES:
            step(
                f"{DEMO_JOB} is still {phase} ({progress}, {why}) after the {watch_seconds:.0f}s "
                f"watch: it keeps going; `kubectl get sft {DEMO_JOB} -w` follows it"
            )
        else:
            raise ClusterError(
                f"{DEMO_JOB} is {phase} ({why}; {progress}); `kubectl describe sft {DEMO_JOB}` "
                f"shows its conditions and events; logs: {logs}"
            )

    def _hints(self) -> None:
        job_dir = self.local / NAMESPACE / DEMO_JOB
        summary = job_dir / "checkpoints" / "final" / "summary.json"
        tensorboard = job_dir / "checkpoints" / "tensorboard"
        lines = [
            "",
            "Everything keeps running. Look around:",
            f"  source <(.venv/bin/python -m sftjob_dev env{self.workdir_flag()})",
            "  kubectl get sft                         # all jobs; -o wide adds the plan",
            f"  kubectl describe sft {DEMO_JOB:<19}# conditions, plan, progress, events",
            "  kubectl get pods -o wide                # trainer pods on the fake A800/A40/L40S nodes",
        ]
        if summary.is_file():
            lines.append(f'  cat {summary}   # the trainer\'s summary (spec.output.path "final")')
        if tensorboard.is_dir():
            lines.append(
                f"  .venv/bin/tensorboard --logdir {tensorboard}   # spec.tracking.tensorboard's curves"
            )
        lines += [
            f"Logs: {self.cluster.logs_dir}/{{operator,runner,...}}.log; the real trainer: {job_dir}/*.log",
            f"Stop everything: hack/demo.sh down{self.workdir_flag()}",
        ]
        print("\n".join(lines), flush=True)

    def workdir_flag(self) -> str:
        """` --workdir DIR` when the cluster is not in the default run folder, for the printed commands."""
        workdir = self.cluster.workdir
        return "" if workdir == Cluster().workdir else f" --workdir {shlex.quote(str(workdir))}"

    # --- down -------------------------------------------------------------------------------------
    def down(self) -> None:
        self._stop_recorded()
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
    down = f"hack/demo.sh down{demo.workdir_flag()}"
    try:
        if args.command == "up":
            demo.up(args.watch_seconds)
        else:
            demo.down()
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        if args.command == "up":
            print(f"What did start keeps running; `{down}` stops all of it.", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"interrupted: the cluster keeps running; `{down}` stops it", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
