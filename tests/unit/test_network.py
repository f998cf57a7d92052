"""spec.network and spec.podAnnotations: RDMA devices for multi-node pods, what the planner assumes
between nodes, and annotations on the trainer pods."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError
from test_builders import JOB, fake_plan

from sftjob.gpus import profile_for_type
from sftjob.job_plan import plan_job
from sftjob.network import NetworkSpec, inter_node_gbs
from sftjob.spec import SFTJobSpec
from sftjob_operator import pods
from sftjob_operator.planning import plan_candidates
from sftjob_operator.scheduling import default_products, node_affinity

RDMA = {"resourceName": "rdma/rdma_shared_device_a", "count": 2}


def spec(**changes: Any) -> SFTJobSpec:
    body: dict[str, Any] = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "dataset": {"name": "org/chats"}}
    return SFTJobSpec.model_validate(body | changes)


def container(s: SFTJobSpec) -> dict[str, Any]:
    plans = plan_candidates(s, default_products(), fake_plan)
    affinity = node_affinity(s.gpu.candidates(), default_products())
    made = pods.trainer_pod(JOB, s, plans, rank=0, affinity=affinity, image="t:1")
    return dict(made["spec"]["containers"][0])


def test_multi_node_pods_request_the_rdma_devices_and_stay_in_the_restricted_profile() -> None:
    c = container(spec(gpu={"type": "A800", "count": 8, "nodes": 2}, network={"rdma": RDMA}))
    assert c["resources"]["requests"]["rdma/rdma_shared_device_a"] == "2"
    assert c["resources"]["limits"]["rdma/rdma_shared_device_a"] == "2"
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}  # an added one never reaches uid 1000
    assert c["securityContext"]["allowPrivilegeEscalation"] is False


def test_single_node_pods_request_no_rdma_devices_and_keep_the_restricted_profile() -> None:
    c = container(spec(gpu={"type": "A800", "count": 8}, network={"rdma": RDMA}))
    assert "rdma/rdma_shared_device_a" not in c["resources"]["requests"]
    assert c["securityContext"]["capabilities"] == {"drop": ["ALL"]}


def test_pod_annotations_reach_every_trainer_pod() -> None:
    s = spec(podAnnotations={"k8s.v1.cni.cncf.io/networks": "roce-a"}, gpu={"type": "A40", "nodes": 2})
    plans = plan_candidates(s, default_products(), fake_plan)
    affinity = node_affinity(s.gpu.candidates(), default_products())
    for rank in (0, 1):
        made = pods.trainer_pod(JOB, s, plans, rank=rank, affinity=affinity, image="t:1")
        assert made["metadata"]["annotations"]["k8s.v1.cni.cncf.io/networks"] == "roce-a"  # and Kueue's


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"podAnnotations": {"bad key": "x"}}, "is not an annotation key"),
        ({"podAnnotations": {"sftjob.io/progress": "{}"}}, "annotations under sftjob.io"),
        ({"podAnnotations": {"team.sftjob.io/x": "y"}}, "annotations under sftjob.io"),
        ({"network": {"rdma": {"resourceName": "rdma"}}}, "not an extended resource name"),
        ({"network": {"rdma": {"resourceName": "x.kubernetes.io/hca"}}}, "not an extended resource name"),
        ({"network": {"rdma": {"resourceName": "nvidia.com/gpu"}}}, "which spec.gpu requests"),
        ({"network": {"rdma": {"resourceName": "requests.example.com/hca"}}}, "starting 'requests.'"),
        ({"network": {"rdma": {"resourceName": "a." * 123 + "io/hca"}}}, "domain is longer than 244"),
        ({"network": {"bandwidthGbps": 0}}, "greater than or equal to 1"),
    ],
)
def test_bad_network_and_annotation_input_is_refused_with_the_reason(changes: Any, words: str) -> None:
    with pytest.raises(ValidationError, match=words):
        spec(**changes)


def test_the_planner_assumes_rdma_or_tcp_bandwidth_unless_the_spec_gives_it() -> None:
    assert inter_node_gbs(NetworkSpec()) == 25 / 8
    assert inter_node_gbs(NetworkSpec.model_validate({"rdma": RDMA})) == 200 / 8
    assert inter_node_gbs(NetworkSpec.model_validate({"rdma": RDMA, "bandwidthGbps": 800})) == 100


def test_a_multi_node_plan_is_faster_over_rdma_and_says_which_link_it_assumed() -> None:
    gpu = {"type": "A800", "count": 8, "nodes": 2}
    full = {"model": {"name": "meta-llama/Llama-3.1-8B"}, "method": "full", "gpu": gpu}
    tcp = plan_job(spec(**full), profile_for_type("A800"))
    rdma = plan_job(spec(**full, network={"rdma": RDMA}), profile_for_type("A800"))
    assert rdma.predicted_tokens_per_second > tcp.predicted_tokens_per_second
    assert any("over TCP sockets" in r for r in tcp.reasons)
    assert any("~25 GB/s per node over RDMA" in r for r in rdma.reasons)
