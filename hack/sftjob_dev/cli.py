"""Command line of the local cluster tool: `up`, `down`, `status`, `env` and `nodes`.

Every failure a user can fix ends with one `error: ...` line on stderr and a non-zero exit code:
1 for a ClusterError (busy port, missing Go, a component that did not become ready), 2 for bad
arguments, 130 when interrupted.
"""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Sequence

from sftjob_dev.cluster import START_TIMEOUT, WORKDIR_ENV, Cluster
from sftjob_dev.errors import ClusterError
from sftjob_dev.nodes import DEFAULT_POOLS, NODE_TYPES


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {value}")
    return value


def _port(text: str) -> int:
    value = _count(text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port between 1 and 65535, got {value}")
    return value


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--workdir",
        help=f"run folder for state and logs (default: ${WORKDIR_ENV} or .run/cluster in the repo)",
    )
    parser = argparse.ArgumentParser(
        prog="python -m sftjob_dev.cluster",
        description="A local Kubernetes control plane with fake GPU nodes.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="{up,down,status,env,nodes}")
    up = sub.add_parser("up", parents=[common], help="build if needed, start everything, add GPU nodes")
    for pool in NODE_TYPES:
        up.add_argument(
            f"--{pool}",
            type=_count,
            default=DEFAULT_POOLS[pool],
            help=f"{pool} nodes (default {DEFAULT_POOLS[pool]})",
        )
    up.add_argument("--api-port", type=_port, help="kube-apiserver port on 127.0.0.1 (default: a free one)")
    up.add_argument("--no-build", action="store_true", help="fail instead of building missing binaries")
    up.add_argument("--timeout", type=float, default=START_TIMEOUT, help="seconds to wait for each component")
    sub.add_parser("down", parents=[common], help="stop every recorded process; keep the logs")
    sub.add_parser("status", parents=[common], help="which components run, and the API URL")
    sub.add_parser("env", parents=[common], help="print export lines for KUBECONFIG and PATH")
    nodes = sub.add_parser("nodes", parents=[common], help="add fake GPU nodes to a running cluster")
    for pool in NODE_TYPES:
        nodes.add_argument(f"--{pool}", type=_count, default=0, help=f"{pool} nodes to add")
    return parser


def _pools(args: argparse.Namespace) -> dict[str, int]:
    return {pool: getattr(args, pool) for pool in NODE_TYPES}


def _status(cluster: Cluster) -> int:
    status = cluster.status()
    for name, running in status.items():
        print(f"{name:<24} {'running' if running else 'stopped'}")
    if all(status.values()):
        print(f"API server: {cluster.api_url}\nkubeconfig: {cluster.kubeconfig}")
        return 0
    return 1


def run(args: argparse.Namespace) -> int:
    cluster = Cluster(args.workdir)
    if args.command == "up":
        ports = {"apiserver": args.api_port} if args.api_port else None
        cluster.up(_pools(args), ports=ports, build=not args.no_build, timeout=args.timeout)
        hint = f"python -m sftjob_dev.cluster env --workdir {shlex.quote(str(cluster.workdir))}"
        print(f'kubeconfig: {cluster.kubeconfig}\nnext: eval "$({hint})"')
        return 0
    if args.command == "down":
        cluster.down()
        return 0
    if args.command == "status":
        return _status(cluster)
    if args.command == "env":
        for key, value in cluster.env().items():
            print(f"export {key}={shlex.quote(value)}")
        return 0
    if not cluster.is_up():
        raise ClusterError(f"no running cluster in {cluster.workdir}; run `up` first")
    pools = _pools(args)
    added = cluster.add_nodes(pools)
    print(
        f"added {len(added)} nodes ({', '.join(f'{n} {pool}' for pool, n in pools.items() if n) or 'none'})"
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        return run(args)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
