"""Developer tooling for sftjob: a real local Kubernetes control plane with fake A800/A40/L40S nodes.

`Cluster` starts etcd, kube-apiserver, kube-controller-manager, kube-scheduler and KWOK from binaries
built once by `hack/build-control-plane.sh`; `python -m sftjob_dev` (or `python -m sftjob_dev.cluster`)
drives it from a shell. Import the API from its modules: `from sftjob_dev.cluster import Cluster`.
"""
