"""The local trainer runner: real CPU trainer processes behind chosen pods of the fake cluster.

KWOK plays the kubelet for the fake GPU nodes but runs nothing. For pods of SFTJobs annotated
``sftjob.dev/local-trainer: "true"`` this dev tool plays the container runtime instead: when such a pod
is Running it reads the trainer config the operator injected (the pod's ConfigMap), maps the in-pod
folders to ``<workdir>/local/<ns>/<job>/`` (checkpoints kept across attempts, so a new attempt resumes)
and ``<workdir>/local/assets/{model,data}`` (where the demo puts a tiny model and dataset), and starts
``python -m sftjob_trainer.train`` on the CPU as the job's trainer ServiceAccount, so progress reports
go through the real per-job RBAC. When the process exits, the runner steers the pod with the
``sim.sftjob.dev/*`` annotations so KWOK ends it as a real pod ends: the termination message, and the exit
code of the container's PID 1 (the launcher, passing on torchrun's), which is 1 for any failure (the
trainer's own code is the ``[exit N]`` tag its message starts with) and 128+N when the container is
killed by signal N. A pod deleted (suspend, restart, job deleted) or ended by someone else while its
process runs gets SIGTERM sent to the process: the trainer saves a checkpoint and exits, and the pod is
left alone.

It talks only to the API server on loopback, never to a pod or node IP. Each trainer's output is in
``<workdir>/local/<ns>/<job>/<pod>.log``. Run it with ``python -m sftjob_dev.runner --workdir DIR``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config, watch

from sftjob import constants as c
from sftjob.config import TrainerConfig
from sftjob.failures import ExitCode
from sftjob_dev.cluster import LONG_LIVED_TOKEN, Cluster, outside_pod_env
from sftjob_dev.errors import ClusterError
from sftjob_dev.localize import config_key, local_config, pod_env
from sftjob_dev.ports import free_ports
from sftjob_operator.builders import trainer_account_name
from sftjob_operator.pods import CONTAINER

log = logging.getLogger("sftjob_dev.runner")

POLL_SECONDS = 0.5
WATCH_SECONDS = 60
STOP_GRACE_SECONDS = 60.0  # the trainer finishes its step and saves a checkpoint on SIGTERM
RETRY_SECONDS = 5.0  # a pod's start or outcome that met a transient API error is tried again after this
MESSAGE_CHARS = 1000
TERMINAL_PHASES = ("Succeeded", "Failed")


def local_dir(workdir: Path) -> Path:
    """Everything the runner (and the demo) keeps beside the cluster's own state."""
    return workdir / "local"


def assets_dir(workdir: Path) -> Path:
    """``model/`` and ``data/`` here stand in for the pods' ``/model`` and ``/data`` volumes."""
    return local_dir(workdir) / "assets"


@dataclass
class Trainer:
    """One trainer process backing one pod."""

    namespace: str
    job: str
    pod: str
    uid: str
    proc: subprocess.Popen[bytes]
    termination_log: Path
    stopping_since: float | None = None  # set when the pod went away: never steer it then


class Runner:
    def __init__(self, cluster: Cluster, *, python: str = sys.executable) -> None:
        self.cluster = cluster
        self.root = local_dir(cluster.workdir)
        self.python = python
        api = config.new_client_from_config(str(cluster.kubeconfig))
        self.core = client.CoreV1Api(api)
        self.custom = client.CustomObjectsApi(api)
        self.trainers: dict[str, Trainer] = {}  # by pod uid
        self.done: set[str] = set()  # pod uids finished or not ours: never started again
        # Pods to try again, not before the time: their job's previous trainer still runs (0), or
        # starting met a transient API error.
        self.waiting: dict[str, tuple[float, dict[str, Any]]] = {}
        # Outcome annotations a transient API error kept off their pod: (namespace, pod) -> (time, them).
        self.unsteered: dict[tuple[str, str], tuple[float, dict[str, str]]] = {}
        self.events: queue.Queue[tuple[str, dict[str, Any]]] = queue.Queue()
        self.stop_requested = threading.Event()

    # --- the loop ---------------------------------------------------------------------------------
    def run(self) -> None:
        """Until SIGTERM/SIGINT: react to pod events, reap exited trainers; then stop them all (also
        when the loop fails, so no trainer outlives the runner)."""
        threading.Thread(target=self._watch, name="pod-watch", daemon=True).start()
        log.info("watching pods of SFTJobs annotated %s=true (workdir %s)", c.LOCAL_TRAINER, self.root)
        try:
            while not self.stop_requested.is_set():
                try:
                    kind, pod = self.events.get(timeout=POLL_SECONDS)
                except queue.Empty:
                    pass
                else:
                    self._on_pod(kind, pod)
                self._reap()
                self._retry_waiting()
                self._retry_unsteered()
        finally:
            self.stop_requested.set()  # the pod watch too
            self.shutdown()

    def _watch(self) -> None:
        """Every pod with the job label, as events; a fresh list (ADDED for each pod) after any error."""
        while not self.stop_requested.is_set():
            try:
                stream = watch.Watch().stream(
                    self.core.list_pod_for_all_namespaces,
                    label_selector=c.LABEL_JOB,
                    timeout_seconds=WATCH_SECONDS,
                )
                for event in stream:
                    obj = event["object"]
                    pod = (
                        obj if isinstance(obj, dict) else self.core.api_client.sanitize_for_serialization(obj)
                    )
                    self.events.put((event["type"], pod))
            except Exception as exc:
                if not self.stop_requested.is_set():
                    log.warning("pod watch failed, listing again: %s", exc)
                    time.sleep(1)

    def _on_pod(self, kind: str, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        uid, phase = meta["uid"], (pod.get("status") or {}).get("phase")
        trainer = self.trainers.get(uid)
        if trainer is not None:
            gone = kind == "DELETED" or meta.get("deletionTimestamp") or phase in TERMINAL_PHASES
            if gone and trainer.stopping_since is None:
                reason = "deleted" if kind == "DELETED" or meta.get("deletionTimestamp") else phase
                log.info(
                    "pod %s/%s %s: sending SIGTERM to its trainer", trainer.namespace, trainer.pod, reason
                )
                self._terminate(trainer)
            return
        annotations = meta.get("annotations") or {}
        self.waiting.pop(uid, None)
        if (
            kind == "DELETED"
            or uid in self.done
            or phase != "Running"
            or meta.get("deletionTimestamp")
            or c.SIM_OUTCOME in annotations
        ):
            return
        if self._busy(meta["namespace"], (meta.get("labels") or {}).get(c.LABEL_JOB, "")):
            # The previous pod's trainer is still saving its checkpoint: like a volume still attached.
            self.waiting[uid] = (0.0, pod)
            return
        try:
            self._start(pod)
        except Exception as exc:  # one bad pod must not stop the runner
            if _transient(exc):
                log.warning(
                    "cannot start a trainer for pod %s/%s yet (%s); trying again in %.0fs",
                    meta["namespace"],
                    meta["name"],
                    _describe(exc),
                    RETRY_SECONDS,
                )
                self.done.discard(uid)
                self.waiting[uid] = (time.monotonic() + RETRY_SECONDS, pod)
                return
            log.exception("cannot start a trainer for pod %s/%s: %s", meta["namespace"], meta["name"], exc)
            self.done.add(uid)
            message = f"local trainer runner: {exc}"
            self._steer(meta["namespace"], meta["name"], ExitCode.CONFIG_ERROR, message, preempted=False)

    def _busy(self, namespace: str, job: str) -> bool:
        return any(t.namespace == namespace and t.job == job for t in self.trainers.values())

    def _retry_waiting(self) -> None:
        now = time.monotonic()
        for not_before, pod in list(self.waiting.values()):
            if not_before <= now:
                self._on_pod("MODIFIED", pod)

    # --- starting ---------------------------------------------------------------------------------
    def _start(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
        job_name = (meta.get("labels") or {}).get(c.LABEL_JOB, "")
        if not self._is_local(namespace, job_name):
            self.done.add(uid)
            return
        self.done.add(uid)
        folder = self.root / namespace / job_name
        folder.mkdir(parents=True, exist_ok=True)
        mounts = {
            c.CHECKPOINT_MOUNT: folder / "checkpoints",
            c.OUTPUT_MOUNT: folder / "output",
            c.MODEL_MOUNT: assets_dir(self.cluster.workdir) / "model",
            c.DATASET_MOUNT: assets_dir(self.cluster.workdir) / "data",
        }
        injected, key = self._injected_config(pod)
        (port,) = free_ports(1)
        trainer_config, notes = local_config(injected, mounts, port)
        config_path = folder / f"{name}.config.json"
        config_path.write_text(trainer_config.to_json())
        termination_log = folder / f"{name}.termination-log"
        termination_log.unlink(missing_ok=True)
        env = {
            **outside_pod_env(),
            "OMP_NUM_THREADS": "1",  # a shared dev machine; the pod's own env may override it
            **pod_env(pod, CONTAINER, mounts),
            c.CONFIG_ENV: str(config_path),
            "POD_NAME": name,
            "POD_NAMESPACE": namespace,
            "NODE_NAME": (pod.get("spec") or {}).get("nodeName", ""),
            "SFTJOB_TERMINATION_LOG": str(termination_log),
            "KUBECONFIG": str(self._kubeconfig(namespace, job_name, folder)),
        }
        trainer_log = folder / f"{name}.log"
        with trainer_log.open("ab") as out:
            proc = subprocess.Popen(
                [self.python, "-m", "sftjob_trainer.train"],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        self.trainers[uid] = Trainer(namespace, job_name, name, uid, proc, termination_log)
        log.info(
            "pod %s/%s: trainer started (PID %d) from ConfigMap key %s; metrics http://127.0.0.1:%d/metrics;"
            " log %s; %s",
            namespace,
            name,
            proc.pid,
            key,
            port,
            trainer_log,
            "; ".join(notes),
        )

    def _is_local(self, namespace: str, job: str) -> bool:
        try:
            obj: Any = self.custom.get_namespaced_custom_object(
                c.API_GROUP, c.API_VERSION, namespace, c.PLURAL, job
            )
        except client.ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return (obj["metadata"].get("annotations") or {}).get(c.LOCAL_TRAINER) == "true"

    def _injected_config(self, pod: dict[str, Any]) -> tuple[TrainerConfig, str]:
        """The config the operator mounted into the pod: its ConfigMap, the key for the pod's card."""
        volumes = (pod.get("spec") or {}).get("volumes") or []
        source = next((v["configMap"] for v in volumes if v.get("configMap")), None)
        if source is None:
            raise ValueError("the pod mounts no ConfigMap with a trainer config")
        namespace = pod["metadata"]["namespace"]
        data = self.core.read_namespaced_config_map(source["name"], namespace).data or {}
        key = config_key(data, self._product((pod.get("spec") or {}).get("nodeName")))
        if key not in data:
            raise ValueError(f"ConfigMap {namespace}/{source['name']} has no {key}")
        return TrainerConfig.model_validate(json.loads(data[key])), f"{source['name']}/{key}"

    def _product(self, node: str | None) -> str | None:
        if not node:
            return None
        meta = self.core.read_node(node).metadata
        labels = (meta.labels if meta is not None else None) or {}
        product: str | None = labels.get(c.GFD_PRODUCT)
        return product

    def _kubeconfig(self, namespace: str, job: str, folder: Path) -> Path:
        """A kubeconfig for the job's trainer ServiceAccount, so the trainer has exactly its pod's RBAC."""
        account = trainer_account_name(job)
        path = folder / "trainer.kubeconfig"
        try:
            return self.cluster.service_account_kubeconfig(
                namespace, account, path, duration=LONG_LIVED_TOKEN
            )
        except ClusterError as exc:
            log.warning(
                "no token for ServiceAccount %s/%s (%s): the trainer reports as admin",
                namespace,
                account,
                exc,
            )
            return self.cluster.kubeconfig

    # --- ending -----------------------------------------------------------------------------------
    def _reap(self) -> None:
        for uid, trainer in list(self.trainers.items()):
            code = trainer.proc.poll()
            if code is None:
                if trainer.stopping_since and time.monotonic() - trainer.stopping_since > STOP_GRACE_SECONDS:
                    log.warning(
                        "trainer of %s/%s ignored SIGTERM: killing it", trainer.namespace, trainer.pod
                    )
                    _signal(trainer.proc, signal.SIGKILL)
                continue
            del self.trainers[uid]
            exit_code = min(code, 1) if code >= 0 else 128 - code  # torchrun's 0 or 1; killed: 128+N
            message = _last_line(trainer.termination_log)
            if trainer.stopping_since is not None:
                log.info(
                    "pod %s/%s gone; its trainer exited with %d: %s",
                    trainer.namespace,
                    trainer.pod,
                    exit_code,
                    message,
                )
                continue
            log.info(
                "pod %s/%s: trainer exited with %d: %s", trainer.namespace, trainer.pod, exit_code, message
            )
            # A SIGTERM this runner did not send (a test's) stands for a preemption: the pod says so.
            preempted = code == ExitCode.PREEMPTED
            self._steer(trainer.namespace, trainer.pod, exit_code, message, preempted=preempted)

    def _steer(self, namespace: str, pod: str, exit_code: int, message: str, *, preempted: bool) -> None:
        """Have KWOK end the pod as the process ended: Succeeded with 0, else Failed with the code (and
        the DisruptionTarget condition of a preempted pod)."""
        annotations = {c.SIM_OUTCOME: "succeed" if exit_code == 0 else "fail", c.SIM_MESSAGE: message}
        if exit_code:
            annotations[c.SIM_EXIT_CODE] = str(exit_code)
        if preempted:
            annotations[c.SIM_DISRUPTION] = "PreemptionByScheduler"
        self._annotate(namespace, pod, annotations)

    def _annotate(self, namespace: str, pod: str, annotations: dict[str, str]) -> None:
        try:
            self.core.patch_namespaced_pod(pod, namespace, {"metadata": {"annotations": annotations}})
        except Exception as exc:
            if _transient(exc):
                log.warning(
                    "cannot annotate pod %s/%s yet (%s); trying again in %.0fs",
                    namespace,
                    pod,
                    _describe(exc),
                    RETRY_SECONDS,
                )
                self.unsteered[(namespace, pod)] = (time.monotonic() + RETRY_SECONDS, annotations)
            elif not isinstance(exc, client.ApiException):
                raise
            elif exc.status != 404:  # a pod already gone needs no outcome
                log.warning("cannot annotate pod %s/%s: %s", namespace, pod, exc.reason)

    def _retry_unsteered(self) -> None:
        now = time.monotonic()
        for (namespace, pod), (not_before, outcome) in list(self.unsteered.items()):
            if not_before <= now:
                del self.unsteered[(namespace, pod)]
                self._annotate(namespace, pod, outcome)

    def _terminate(self, trainer: Trainer) -> None:
        trainer.stopping_since = time.monotonic()
        _signal(trainer.proc, signal.SIGTERM)

    def shutdown(self) -> None:
        """SIGTERM every trainer (each saves a checkpoint) and wait for them; pods are left as they are."""
        for trainer in self.trainers.values():
            if trainer.stopping_since is None:
                self._terminate(trainer)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for trainer in self.trainers.values():
            try:
                trainer.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                _signal(trainer.proc, signal.SIGKILL)
                trainer.proc.wait()
        log.info("stopped %d trainer(s)", len(self.trainers))
        self.trainers.clear()


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Signal the trainer and its dataloader workers (its own process group)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _transient(exc: BaseException) -> bool:
    """An API error that may pass: the server overloaded or restarting (429, 5xx), or no connection."""
    if isinstance(exc, client.ApiException):
        return exc.status == 429 or (exc.status or 0) >= 500
    return isinstance(exc, (urllib3.exceptions.HTTPError, ConnectionError))


def _describe(exc: BaseException) -> str:
    if isinstance(exc, client.ApiException):
        return f"HTTP {exc.status} {exc.reason}"
    return f"{type(exc).__name__}: {exc}"


def _last_line(path: Path) -> str:
    try:
        lines = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return lines[-1][:MESSAGE_CHARS] if lines else ""


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sftjob_dev.runner",
        description="Back pods of SFTJobs annotated sftjob.dev/local-trainer=true with CPU trainers.",
    )
    parser.add_argument(
        "--workdir", help="the cluster's run folder (default: $SFTJOB_CLUSTER_DIR or .run/cluster)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    cluster = Cluster(args.workdir)
    if not cluster.is_up():
        print(
            f"error: no running cluster in {cluster.workdir}; run `python -m sftjob_dev up` first",
            file=sys.stderr,
        )
        return 1
    runner = Runner(cluster)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: runner.stop_requested.set())
    runner.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
