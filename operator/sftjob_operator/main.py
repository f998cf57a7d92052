"""``python -m sftjob_operator``: configure the operator from flags and environment, then run kopf.

Events are posted explicitly on job transitions only (kopf's own posting is turned down to WARNING),
logs are JSON, liveness is kopf's endpoint (default ``:8081/healthz``) and metrics are served apart
(default ``:8080/metrics``). Run one operator for a set of jobs: ``--peering`` names the kopf peering
object (``--standalone`` skips peering), whose pause stops kopf's watch streams when a second operator
joins, but not this operator's own workers, which keep passing over the jobs they last saw; the pause
tells that two run, it does not make that safe (docs/install.md, "Peering and replicas"). At start the
SFTJob CRD's schema revision is checked (:func:`check_crd`): a CRD left behind by an upgrade that skipped
it would silently drop the fields this operator writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kopf
from kubernetes import client
from kubernetes.client.exceptions import ApiException
from pydantic import ValidationError
from urllib3.exceptions import HTTPError

from sftjob import constants as c
from sftjob.kube_names import DNS_SUBDOMAIN, IMAGE
from sftjob_operator import handlers, metrics
from sftjob_operator.defaults import JobDefaults
from sftjob_operator.kube import REQUEST_TIMEOUT, Kube, connect
from sftjob_operator.reconcile_io import Context
from sftjob_operator.scheduling import default_products, parse_products

log = logging.getLogger(__name__)

DEFAULT_PEERING = "sftjob-operator"
DEFAULT_LIVENESS = "http://0.0.0.0:8081/healthz"
DEFAULT_METRICS_PORT = 8080
MAX_PORT = 65535
LOG_FORMATS = ("json", "plain")
# Below this a quiet job's resync is a busy loop.
MIN_RESYNC_SECONDS = 1.0
# The flag that sets each job default, for error messages.
DEFAULT_FLAGS = {
    "storage_class_name": "--checkpoint-storage-class",
    "size": "--checkpoint-size",
    "max_restarts": "--max-restarts",
    "backoff_seconds": "--backoff-seconds",
    "on_oom": "--on-oom",
}
CRD_NAME = f"{c.PLURAL}.{c.API_GROUP}"
CRD_UPDATE = (
    "kubectl apply --server-side -f crds/sftjob.io_sftjobs.yaml (this operator's release), or helm upgrade"
    " with crds.enabled=true (docs/install.md, Upgrading)"
)


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
        default=env("SFTJOB_METRICS_PORT", str(DEFAULT_METRICS_PORT)),
        help=f"Prometheus metrics port, 1-{MAX_PORT} (0: off)",
    )
    p.add_argument(
        "--image",
        default=env("SFTJOB_TRAINER_IMAGE", c.DEFAULT_TRAINER_IMAGE),
        help="trainer image for jobs that name none",
    )
    p.add_argument(
        "--image-min-driver-major",
        type=int,
        default=env("SFTJOB_IMAGE_MIN_DRIVER_MAJOR", str(c.MIN_DRIVER_MAJOR)),
        help="pods of --image only go to nodes whose nvidia.com/cuda.driver.major is at least this (0: any)",
    )
    p.add_argument(
        "--trainer-image-pull-secrets",
        default=env("SFTJOB_TRAINER_IMAGE_PULL_SECRETS", ""),
        help="comma-separated Secrets (in each job's namespace) trainer pods pull their image with",
    )
    p.add_argument(
        "--trainer-network-policy",
        action=argparse.BooleanOptionalAction,
        default=env("SFTJOB_TRAINER_NETWORK_POLICY", "true"),
        help="give each job a NetworkPolicy that lets only its own pods (and, on the metrics port, anyone)"
        " reach its trainers; SFTJOB_TRAINER_NETWORK_POLICY: true or false",
    )
    p.add_argument(
        "--gpu-products",
        default=env("SFTJOB_GPU_PRODUCTS"),
        help="JSON object (or @file) mapping GPU type to nvidia.com/gpu.product labels",
    )
    p.add_argument(
        "--resync-seconds",
        type=float,
        default=env("SFTJOB_RESYNC_SECONDS", str(handlers.RESYNC_SECONDS)),
        help="longest time between two passes over a job (at least 1)",
    )
    p.add_argument("--log-format", choices=LOG_FORMATS, default=env("SFTJOB_LOG_FORMAT", "json"))
    p.add_argument("-v", "--verbose", action="store_true")
    d = p.add_argument_group("defaults for SFTJobs that leave these unset (status.effective shows them)")
    d.add_argument(
        "--checkpoint-storage-class",
        default=env("SFTJOB_CHECKPOINT_STORAGE_CLASS"),
        help="StorageClass of the checkpoint claims the operator creates (empty: the cluster's default)",
    )
    d.add_argument(
        "--checkpoint-size", default=env("SFTJOB_CHECKPOINT_SIZE"), help="their size (default 100Gi)"
    )
    d.add_argument("--max-restarts", type=int, default=env("SFTJOB_MAX_RESTARTS"), help="default 3")
    d.add_argument("--backoff-seconds", type=int, default=env("SFTJOB_BACKOFF_SECONDS"), help="default 10")
    d.add_argument(
        "--on-oom", choices=["Replan", "Retry", "Fail"], default=env("SFTJOB_ON_OOM"), help="default Replan"
    )
    args = p.parse_args(argv)
    try:
        args.defaults = JobDefaults.of(
            storage_class_name=args.checkpoint_storage_class,
            size=args.checkpoint_size,
            max_restarts=args.max_restarts,
            backoff_seconds=args.backoff_seconds,
            on_oom=args.on_oom,
        )
    except ValidationError as err:
        problems = "; ".join(
            f"{DEFAULT_FLAGS.get(str(e['loc'][0]), e['loc'][0]) if e['loc'] else 'the defaults'}: {e['msg']}"
            for e in err.errors()
        )
        p.error(f"invalid job default: {problems}")
    if not (math.isfinite(args.resync_seconds) and args.resync_seconds >= MIN_RESYNC_SECONDS):
        p.error(
            f"--resync-seconds / SFTJOB_RESYNC_SECONDS must be a finite number of seconds >= "
            f"{MIN_RESYNC_SECONDS:g}, got {args.resync_seconds:g}"
        )
    port = args.metrics_port.strip()
    if not (re.fullmatch("[0-9]{1,5}", port) and int(port) <= MAX_PORT):
        p.error(
            f"--metrics-port / SFTJOB_METRICS_PORT must be a port number from 1 to {MAX_PORT}, or 0 (no"
            f" metrics), got {args.metrics_port!r}"
        )
    args.metrics_port = int(port)
    if args.log_format not in LOG_FORMATS:  # argparse checks the flag's choices, not a default
        p.error(
            f"--log-format / SFTJOB_LOG_FORMAT must be one of {', '.join(LOG_FORMATS)},"
            f" got {args.log_format!r}"
        )
    try:
        args.products = products_from(args.gpu_products)
    except (OSError, ValueError) as err:  # a file that cannot be read, bad JSON, a bad mapping
        p.error(f"--gpu-products / SFTJOB_GPU_PRODUCTS: {err}")
    if args.liveness and (problem := liveness_problem(args.liveness)):
        p.error(f"--liveness / SFTJOB_LIVENESS: {problem}, got {args.liveness!r}")
    if not args.standalone and not args.peering.strip():
        p.error("--peering / SFTJOB_PEERING: give the kopf peering's name, or --standalone")
    if any(not ns.strip() for ns in args.namespace):
        p.error("--namespace: give a namespace (or a pattern such as team-*), not an empty string")
    if args.image_min_driver_major < 0:
        p.error("--image-min-driver-major / SFTJOB_IMAGE_MIN_DRIVER_MAJOR must be >= 0 (0: any driver)")
    args.trainer_image_pull_secrets = tuple(
        name.strip() for name in args.trainer_image_pull_secrets.split(",") if name.strip()
    )
    bad = [name for name in args.trainer_image_pull_secrets if not re.fullmatch(DNS_SUBDOMAIN, name)]
    if bad:
        p.error(
            "--trainer-image-pull-secrets / SFTJOB_TRAINER_IMAGE_PULL_SECRETS must be comma-separated "
            f"Secret names (lowercase DNS subdomains), got {', '.join(map(repr, bad))}"
        )
    if isinstance(args.trainer_network_policy, str):  # not given as a flag: the environment's text
        if args.trainer_network_policy.strip().lower() not in ("true", "false"):
            p.error(
                f"SFTJOB_TRAINER_NETWORK_POLICY must be true or false, got {args.trainer_network_policy!r}"
            )
        args.trainer_network_policy = args.trainer_network_policy.strip().lower() == "true"
    if not re.fullmatch(IMAGE, args.image):
        p.error(
            f"--image / SFTJOB_TRAINER_IMAGE must be an image reference without spaces, got {args.image!r}"
        )
    return args


def liveness_problem(url: str) -> str | None:
    """What is wrong with a ``--liveness`` URL kopf could not serve (it would fail at start), or None."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:  # not a number, or above 65535
        return "the port must be a number from 1 to 65535"
    if parts.scheme != "http" or not parts.hostname:
        return "an http:// URL with a host is needed, e.g. http://0.0.0.0:8081/healthz"
    if port == 0 or not parts.path.startswith("/"):
        return "give a port from 1 to 65535 and a path, e.g. http://0.0.0.0:8081/healthz"
    return None


def products_from(value: str | None) -> dict[str, list[str]]:
    if not value:
        return default_products()
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    return parse_products(text)


def crd_problem(crd: Mapping[str, Any] | None) -> tuple[int, str] | None:
    """The log level and message for the SFTJob CRD found in the cluster (None: not installed), or None
    when its schema revision is this operator's. A CRD without the annotation predates revisions (0)."""
    if crd is None:
        return logging.ERROR, f"the CRD {CRD_NAME} is not installed: {CRD_UPDATE}"
    raw = str(((crd.get("metadata") or {}).get("annotations") or {}).get(c.ANNOTATION_SCHEMA_REVISION, 0))
    found = int(raw) if raw.isdigit() else 0
    if found < c.CRD_SCHEMA_REVISION:
        return logging.ERROR, (
            f"the CRD {CRD_NAME} has schema revision {found} ({c.ANNOTATION_SCHEMA_REVISION}), older than"
            f" this operator's {c.CRD_SCHEMA_REVISION}: the API server drops the spec and status fields, and"
            " skips the admission rules, added since (the operator marks specs they refuse InvalidSpec)."
            f" Update it: {CRD_UPDATE}"
        )
    if found > c.CRD_SCHEMA_REVISION:
        return logging.WARNING, (
            f"the CRD {CRD_NAME} has schema revision {found}, newer than this operator's"
            f" {c.CRD_SCHEMA_REVISION}: jobs using fields added since fail as invalid (InvalidSpec)"
        )
    return None


def check_crd(api: client.ApiClient) -> None:
    """Logs an SFTJob CRD older (or newer) than this operator. Best effort: a read that fails or is
    refused is a warning, never a reason not to start. It lists by name: the operator's RBAC has list and
    watch on CRDs (kopf's), not get."""
    try:
        response: Any = client.ApiextensionsV1Api(api).list_custom_resource_definition(
            field_selector=f"metadata.name={CRD_NAME}",
            _preload_content=False,
            _request_timeout=REQUEST_TIMEOUT,
        )
        items = json.loads(response.data)["items"]
    except ApiException as err:
        log.warning(
            "the CRD %s was not read (HTTP %s): its schema revision is unchecked", CRD_NAME, err.status
        )
        return
    except (HTTPError, OSError, ValueError, KeyError) as err:
        log.warning("the CRD %s was not read (%s): its schema revision is unchecked", CRD_NAME, err)
        return
    problem = crd_problem(items[0] if items else None)
    if problem is not None:
        log.log(*problem)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    kopf.configure(
        verbose=args.verbose,
        log_format=kopf.LogFormat.JSON if args.log_format == "json" else kopf.LogFormat.PLAIN,
    )
    if not args.verbose:  # kopf logs every watch-event handler's success at INFO: thousands a minute
        logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    handlers.Runtime.context = Context(
        products=args.products,
        image=args.image,
        image_min_driver_major=args.image_min_driver_major or None,
        trainer_image_pull_secrets=args.trainer_image_pull_secrets,
        trainer_network_policy=args.trainer_network_policy,
        defaults=args.defaults,
    )
    api = connect()
    check_crd(api)
    handlers.Runtime.kube = Kube(api)
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
