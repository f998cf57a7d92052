"""The local cluster tool rejects bad input with one clear line, picks safe ports and builds correct
manifests and command lines, all without starting a cluster."""

from __future__ import annotations

import fcntl
import json
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from sftjob import constants as c
from sftjob_dev import binaries, components, processes
from sftjob_dev import cluster as cluster_module
from sftjob_dev.cli import main
from sftjob_dev.components import Layout
from sftjob_dev.errors import ClusterError
from sftjob_dev.nodes import NODE_TYPES, next_names, nodes_list, validate_pools
from sftjob_dev.pki import Pki
from sftjob_dev.ports import PORT_NAMES, choose_ports


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    try:
        code = main(list(argv))
    except SystemExit as e:  # argparse
        code = int(e.code or 0)
    return code, capsys.readouterr().err


def test_an_unknown_subcommand_exits_2_naming_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    code, err = run_cli(capsys, "explode")
    assert code == 2
    assert "invalid choice: 'explode'" in err


def test_a_negative_node_count_is_rejected(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, err = run_cli(capsys, "up", "--workdir", str(tmp_path), "--a800", "-1")
    assert code == 2
    assert "--a800" in err


def test_a_busy_api_port_fails_fast_with_one_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        code, err = run_cli(capsys, "up", "--workdir", str(tmp_path), "--api-port", str(port))
    assert code == 1
    assert err == f"error: port {port} on 127.0.0.1 (apiserver) is busy; pick another or omit it\n"


def test_up_without_go_and_without_binaries_says_go_is_missing(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "SFTJOB_CACHE": str(tmp_path / "cache"), "HOME": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "sftjob_dev.cluster", "up", "--workdir", str(tmp_path / "run")],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 1
    assert result.stderr.startswith("error: the Go toolchain (go) is not on PATH")
    assert len(result.stderr.strip().splitlines()) == 1


def test_nodes_and_status_without_a_running_cluster_fail_clearly(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    code, err = run_cli(capsys, "nodes", "--workdir", str(tmp_path), "--l40s", "1")
    assert code == 1
    assert err.startswith(f"error: no running cluster in {tmp_path}")
    code, _ = run_cli(capsys, "status", "--workdir", str(tmp_path))
    assert code == 1


def test_down_with_nothing_running_succeeds(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["down", "--workdir", str(tmp_path)]) == 0
    assert "nothing was running" in capsys.readouterr().out


def test_free_ports_are_distinct_and_bindable() -> None:
    ports = choose_ports()
    assert sorted(ports) == sorted(PORT_NAMES)
    assert len(set(ports.values())) == len(PORT_NAMES)


def test_an_explicit_port_is_kept_and_duplicates_are_rejected() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert choose_ports({"apiserver": free})["apiserver"] == free
    with pytest.raises(ClusterError, match="must differ"):
        choose_ports({"apiserver": free, "etcd": free})
    with pytest.raises(ClusterError, match="unknown port name"):
        choose_ports({"kubelet": free})


def test_new_node_names_continue_after_the_highest_existing_index() -> None:
    assert next_names("a40", 2, ["a40-0", "a40-3", "a800-7", "a40-x"]) == ["a40-4", "a40-5"]
    assert next_names("l40s", 1, []) == ["l40s-0"]


@pytest.mark.parametrize(
    ("pool", "product", "gpus", "memory", "compute"),
    [
        ("a800", "NVIDIA-A800-SXM4-80GB", "8", "81920", ("8", "0")),
        ("a40", "NVIDIA-A40", "4", "46068", ("8", "6")),
        ("l40s", "NVIDIA-L40S", "4", "46068", ("8", "9")),
    ],
)
def test_fake_nodes_carry_gpu_feature_discovery_labels_capacity_and_taint(
    pool: str, product: str, gpus: str, memory: str, compute: tuple[str, str]
) -> None:
    (node,) = nodes_list({pool: 1})["items"]
    labels = node["metadata"]["labels"]
    assert node["metadata"]["name"] == f"{pool}-0"
    assert labels[c.GFD_PRODUCT] == product
    assert labels[c.GFD_COUNT] == gpus
    assert labels[c.GFD_MEMORY] == memory
    assert (labels[c.GFD_COMPUTE_MAJOR], labels[c.GFD_COMPUTE_MINOR]) == compute
    assert labels["kubernetes.io/hostname"] == f"{pool}-0"
    assert node["metadata"]["annotations"]["kwok.x-k8s.io/node"] == "fake"
    assert node["status"]["capacity"][c.GPU_RESOURCE] == gpus
    assert node["status"]["allocatable"][c.GPU_RESOURCE] == gpus
    assert node["spec"]["taints"] == [{"key": c.GPU_TAINT_KEY, "value": "present", "effect": "NoSchedule"}]


def test_hundreds_of_nodes_are_one_list() -> None:
    manifest = nodes_list({"a800": 300, "a40": 100})
    assert manifest["kind"] == "List"
    assert len(manifest["items"]) == 400
    assert len({n["metadata"]["name"] for n in manifest["items"]}) == 400


@pytest.mark.parametrize("pools", [{"h100": 1}, {"a40": -1}, {"a40": True}])
def test_bad_pools_are_rejected_naming_the_pool(pools: dict[str, Any]) -> None:
    with pytest.raises(ClusterError, match=next(iter(pools))):
        validate_pools(pools)


def _layout(tmp_path: Path) -> Layout:
    ports = dict(zip(PORT_NAMES, range(20000, 20000 + len(PORT_NAMES)), strict=True))
    return Layout(tmp_path / "bin", tmp_path, Pki(tmp_path / "pki"), tmp_path / "kubeconfig", ports)


def test_every_component_listens_on_loopback_only(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    for name, command in components.COMMANDS.items():
        argv = command(layout)
        assert argv[0] == str(tmp_path / "bin" / name)
        for flag in argv[1:]:
            option, _, value = flag.partition("=")
            if any(word in option for word in ("address", "url", "listen", "etcd-servers", "server")):
                assert "127.0.0.1" in value, (name, flag)


def test_the_apiserver_enforces_rbac_and_fake_addresses_avoid_private_ranges(tmp_path: Path) -> None:
    layout = _layout(tmp_path)
    apiserver = components.apiserver(layout)
    assert "--authorization-mode=Node,RBAC" in apiserver
    assert f"--service-cluster-ip-range={components.SERVICE_CIDR}" in apiserver
    assert f"--cidr={components.POD_CIDR}" in components.kwok(layout)
    assert components.POD_CIDR.startswith("198.18.") and components.SERVICE_CIDR.startswith("198.19.")


def test_the_pod_stages_use_the_contract_annotations() -> None:
    stages = [doc for path in components.stage_files() for doc in yaml.safe_load_all(path.read_text()) if doc]
    pod_stages = {s["metadata"]["name"]: s for s in stages if s["spec"]["resourceRef"]["kind"] == "Pod"}
    text = json.dumps(pod_stages)
    for key in (c.SIM_OUTCOME, c.SIM_EXIT_CODE, c.SIM_MESSAGE, c.SIM_RUN_FOR, c.SIM_DISRUPTION):
        assert key in text
    outcomes = {
        value
        for stage in pod_stages.values()
        for expr in stage["spec"]["selector"]["matchExpressions"]
        if c.SIM_OUTCOME in expr["key"]
        for value in expr["values"]
    }
    assert outcomes == {"succeed", "fail", "oomkill"}
    assert "OOMKilled" in pod_stages["sftjob-pod-oomkill"]["spec"]["next"]["statusTemplate"]
    assert "exitCode: 137" in pod_stages["sftjob-pod-oomkill"]["spec"]["next"]["statusTemplate"]


def test_stop_never_signals_a_pid_that_runs_another_program() -> None:
    pid = processes.start(["sleep", "30"], Path("/dev/null"))
    try:
        assert processes.is_running(pid)
        assert processes.stop(pid, Path("/not/our/binary")) is False
        assert processes.is_running(pid)
    finally:
        assert processes.stop(pid, grace=2)
    assert not processes.is_running(pid)


def test_pools_of_every_known_type_have_a_cli_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["up", "--help"])
    out = capsys.readouterr().out
    assert all(f"--{pool}" in out for pool in NODE_TYPES)


def test_the_optional_cpu_pool_has_no_gpu_labels_capacity_or_taint() -> None:
    (node,) = nodes_list({"cpu": 1})["items"]
    assert c.GFD_PRODUCT not in node["metadata"]["labels"]
    assert c.GPU_RESOURCE not in node["status"]["capacity"]
    assert node["spec"]["taints"] == []


def test_a_second_up_on_the_same_run_folder_is_refused_while_one_runs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    with (tmp_path / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        code, err = run_cli(capsys, "up", "--workdir", str(tmp_path))
    assert code == 1
    assert err == f"error: another up/down is already running on {tmp_path}\n"


def test_free_ports_are_picked_after_a_first_build_so_nothing_takes_them_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []

    def build() -> Path:
        calls.append("build")
        return tmp_path

    def pick(explicit: dict[str, int] | None = None) -> dict[str, int]:
        calls.append("ports")
        return choose_ports(explicit)

    def start(*args: Any) -> None:
        raise ClusterError("stop before starting anything")

    monkeypatch.setattr(binaries, "ensure_built", build)
    monkeypatch.setattr(cluster_module, "choose_ports", pick)
    monkeypatch.setattr(cluster_module.Cluster, "_start", start)
    with pytest.raises(ClusterError, match="stop before starting anything"):
        cluster_module.Cluster(tmp_path).up()
    assert calls == ["build", "ports"]
