"""What the API server accepts as names, label keys and values, and quantities, as patterns.

The spec models (:mod:`sftjob.spec`, :mod:`sftjob.network`) check what a user writes with these, and
the CRD's schema and CEL rules hold the same regexes and wording (a unit test compares them), so an
admitted job's children are not refused for a name, a label or a size. ``SpecModel`` is the base of
every model of the SFTJob API.
"""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, StringConstraints
from pydantic.alias_generators import to_camel

# Names of Secrets, claims, StorageClasses and PriorityClasses: DNS-1123 subdomains, as the API server
# checks them in the children the operator creates.
_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
DNS_SUBDOMAIN = f"^{_SUBDOMAIN}$"
# A quantity above zero (a claim's size: the API server refuses a claim of 0 bytes).
POSITIVE_QUANTITY = r"^([0-9]*[1-9][0-9]*(\.[0-9]+)?|[0-9]+\.[0-9]*[1-9][0-9]*)(m|k|M|G|T|P|Ki|Mi|Gi|Ti|Pi)?$"
ENV_NAME = r"^[-._a-zA-Z][-._a-zA-Z0-9]*$"
SECRET_KEY = r"^\.?[-_a-zA-Z0-9][-._a-zA-Z0-9]*$"  # not '.', '..' or starting with '..'
IMAGE = r"^[^\x00-\x20\x7f]+$"  # no space or control character (RE2 and pydantic read \S apart)
# Label keys and values as Kubernetes validates them (a pod's nodeSelector, a toleration's key and value):
# an optional DNS-1123 subdomain prefix (at most MAX_LABEL_PREFIX characters) and '/', then a name of at
# most 63 characters. The CRD's CEL rules use the same two patterns.
LABEL_KEY = f"^({_SUBDOMAIN}/)?[A-Za-z0-9]([-A-Za-z0-9_.]{{0,61}}[A-Za-z0-9])?$"
LABEL_VALUE = r"^([A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?)?$"
MAX_LABEL_PREFIX = 253
LABEL_KEY_RULE = (
    "an optional DNS subdomain prefix of at most 253 characters and '/', then a name of at most 63"
    " letters, digits, '-', '_' or '.' that starts and ends with a letter or digit"
)
LABEL_VALUE_RULE = (
    "empty, or at most 63 letters, digits, '-', '_' or '.' that start and end with a letter or digit"
)

ObjectName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]
# A Kueue LocalQueue's name, which the pods carry as a label value (at most 63 characters).
QueueName = Annotated[str, StringConstraints(min_length=1, max_length=63, pattern=DNS_SUBDOMAIN)]
QUANTITY_RULE = "a quantity above zero such as 16, 500m, 128Gi or 1.5Ti"


def _positive_quantity(value: str) -> str:
    if not re.fullmatch(POSITIVE_QUANTITY, value):
        raise ValueError(f"{value!r} is not {QUANTITY_RULE}")
    return value


def _quantity_text(value: object) -> object:
    """A whole number as its text: ``cpu: 16`` unquoted is an integer in YAML, and the CRD admits it as
    Kubernetes does (int-or-string); a bool is not a number here."""
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# Checked by a validator rather than a pattern, so the message (here and the CRD's) says what is wanted.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity_text),
    StringConstraints(max_length=32),
    AfterValidator(_positive_quantity),
]


class SpecModel(BaseModel):
    """camelCase on the wire, snake_case in Python, unknown keys are errors, values never change."""

    model_config = ConfigDict(extra="forbid", frozen=True, alias_generator=to_camel, populate_by_name=True)


class SecretKeyRef(SpecModel):
    """A key of a Secret in the job's namespace, handed to the trainer as an environment variable."""

    name: ObjectName
    key: Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=SECRET_KEY)] = "token"


def valid_label_key(key: str) -> bool:
    """Whether ``key`` is a Kubernetes label key (what a nodeSelector or a toleration's key must be)."""
    prefix, slash, _ = key.partition("/")
    return re.fullmatch(LABEL_KEY, key) is not None and (not slash or len(prefix) <= MAX_LABEL_PREFIX)


def valid_label_value(value: str) -> bool:
    return re.fullmatch(LABEL_VALUE, value) is not None
