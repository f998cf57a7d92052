"""API server request counts from its own ``apiserver_request_total``, split by verb and resource.

Read over the admin credentials (``GET /metrics``, loopback only) before and after a stage; the
difference is every client's requests in that stage: the harness's creates, the controller under
test, the scheduler's bindings and KWOK's pod status updates. The split by verb and resource says whose
they are (``POST configmaps`` is the operator's, ``POST pods/binding`` the scheduler's). KWOK's node
lease renewals and node status updates are background, counted apart; health checks and metric reads are
left out.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

from kubernetes import client

COUNTER = "apiserver_request_total"
_LINE = re.compile(rf"^{COUNTER}\{{(?P<labels>[^}}]*)\}} (?P<value>\S+)")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
LEFT_OUT = frozenset({"GET /metrics", "GET /healthz", "GET /readyz", "GET /livez"})
# The fake kubelets' heartbeats, whatever the jobs do: a lease renewal per node every few seconds, and
# node status updates (KWOK's node stage). Neither subject writes nodes.
BACKGROUND = ("leases.coordination.k8s.io", "nodes", "nodes/status")
WRITES = frozenset({"PATCH", "PUT", "POST", "UPDATE", "APPLY"})


def fetch(api: client.ApiClient) -> str:
    """The API server's metrics text, through the client's own connection (no kubectl discovery)."""
    request = api.param_serialize("GET", "/metrics", auth_settings=["BearerToken"])
    response: Any = api.call_api(*request)
    return str(response.read().decode())


def parse(text: str) -> Counter[str]:
    """Requests so far by ``"VERB resource[.group][/subresource]"`` or ``"VERB /path"``."""
    counts: Counter[str] = Counter()
    for line in text.splitlines():
        match = _LINE.match(line)
        if match is None:
            continue
        labels = dict(_LABEL.findall(match.group("labels")))
        counts[key(labels)] += int(float(match.group("value")))
    return counts


def key(labels: dict[str, str]) -> str:
    verb, resource, sub = labels.get("verb", "?"), labels.get("resource"), labels.get("subresource")
    if not resource:  # a non-resource URL: the path is in the subresource label
        return f"{verb} /{(sub or '').lstrip('/')}"
    if labels.get("group"):
        resource = f"{resource}.{labels['group']}"
    return f"{verb} {resource}/{sub}" if sub else f"{verb} {resource}"


def delta(before: Counter[str], after: Counter[str]) -> Counter[str]:
    """Requests between two readings, without health checks and metric reads."""
    return Counter(
        {k: after[k] - before.get(k, 0) for k in after if after[k] > before.get(k, 0) and k not in LEFT_OUT}
    )


def split(counts: Counter[str]) -> tuple[Counter[str], Counter[str]]:
    """(requests attributable to the jobs, background requests)."""
    background = Counter({k: v for k, v in counts.items() if _heartbeat(k)})
    return counts - background, background


def _heartbeat(key: str) -> bool:
    verb, _, resource = key.partition(" ")
    return resource.startswith("leases.coordination.k8s.io") or (verb in WRITES and resource in BACKGROUND)


def per(counts: Counter[str], divisor: float, top: int = 15) -> dict[str, float]:
    """The largest ``top`` entries divided by ``divisor`` (requests per job), largest first."""
    if divisor <= 0:
        return {}
    return {k: round(v / divisor, 3) for k, v in counts.most_common(top)}
