"""``python -m sftjob_operator``: configure the operator from flags and environment, then run kopf.

Events are posted explicitly on job transitions only (kopf's own posting is turned down to WARNING),
logs are JSON, liveness is kopf's endpoint (default ``:8081/healthz``) and metrics are served apart
(default ``:8080/metrics``). Run one replica: ``--peering`` names the kopf peering that keeps a second
operator (a developer's, an old pod during a rollout) paused, ``--standalone`` skips peering.
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

import kopf

from sftjob.constants import DEFAULT_TRAINER_IMAGE
from sftjob_operator import handlers, metrics
from sftjob_operator.kube import Kube, connect
from sftjob_operator.reconcile import Context
from sftjob_operator.scheduling import default_products, parse_products

DEFAULT_PEERING = "sftjob-operator"
DEFAULT_LIVENESS = "http://0.0.0.0:8081/healthz"
DEFAULT_METRICS_PORT = 8080


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="sftjob_operator", description="Run the SFTJob operator.")
    p.add_argument(
        "-n", "--namespace", action="append", default=[], help="watch only this namespace (repeatable)"
    )
    peering = p.add_mutually_exclusive_group()
    peering.add_argument("--standalone", action="store_true", help="run without kopf peering")
    peering.add_argument(
        "--peering", default=env("SFTJOB_PEERING", DEFAULT_PEERING), help="kopf peering name"
    )
    p.add_argument(
        "--liveness", default=env("SFTJOB_LIVENESS", DEFAULT_LIVENESS), help="liveness endpoint URL"
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("SFTJOB_METRICS_PORT", DEFAULT_METRICS_PORT)),
        help="Prometheus metrics port (0: off)",
    )
    p.add_argument(
        "--image",
        default=env("SFTJOB_TRAINER_IMAGE", DEFAULT_TRAINER_IMAGE),
        help="trainer image for jobs that name none",
    )
    p.add_argument(
        "--gpu-products",
        default=env("SFTJOB_GPU_PRODUCTS"),
        help="JSON object (or @file) mapping GPU type to nvidia.com/gpu.product labels",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=float(env("SFTJOB_RESYNC_SECONDS", handlers.RESYNC_SECONDS)),
        help="longest time between two passes over a job",
    )
    p.add_argument("--log-format", choices=["json", "plain"], default=env("SFTJOB_LOG_FORMAT", "json"))
    p.add_argument("-v", "--verbose", action="store_true")
    return p.parse_args(argv)


def products_from(value: str | None) -> dict[str, list[str]]:
    if not value:
        return default_products()
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    return parse_products(text)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    if not args.verbose:  # kopf logs every watch-event handler's success at INFO: thousands a minute
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.Runtime.context = Context(products=products_from(args.gpu_products), image=args.image)
    handlers.Runtime.kube = Kube(connect())
    handlers.Runtime.resync_seconds = args.resync_seconds
    if args.metrics_port:
        metrics.serve(args.metrics_port)
    kopf.run(
        clusterwide=not args.namespace,
        namespaces=args.namespace,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        liveness_endpoint=args.liveness or None,
    )
