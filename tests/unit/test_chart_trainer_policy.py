"""The chart's ValidatingAdmissionPolicy on trainer pods, as `helm template` renders it.

The trainer's Role lets it PATCH its attempt's pods; the policy limits what such a PATCH may change to
the progress annotations. These tests check that the rendered policy names the keys, label and account
names the Python code uses, so the two cannot drift apart, and how values and the cluster's API
turn it on and off. tests/e2e/test_trainer_permissions.py runs the rules on a real API server.
"""

from __future__ import annotations

import re

import pytest
from helmchart import Manifest, find, helm, one, render, template_args

from sftjob import constants as c
from sftjob.config import JobRef
from sftjob_operator import builders

POLICY = "ValidatingAdmissionPolicy"
BINDING = "ValidatingAdmissionPolicyBinding"
API_KIND = "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy"
JOB = JobRef(namespace="team", name="llama", uid="u-1", attempt=1)


def policy() -> Manifest:
    return one(render(), POLICY)


def condition(name: str) -> str:
    expression: str = next(m for m in policy()["spec"]["matchConditions"] if m["name"] == name)["expression"]
    return expression


def variable(name: str) -> str:
    expression: str = next(v for v in policy()["spec"]["variables"] if v["name"] == name)["expression"]
    return expression


def test_the_policy_and_its_binding_are_named_after_the_release_and_deny() -> None:
    docs = render()
    binding = one(docs, BINDING)
    assert policy()["metadata"]["name"] == binding["metadata"]["name"] == "sft-sftjob-operator-trainer-pods"
    assert binding["spec"]["policyName"] == policy()["metadata"]["name"]
    assert binding["spec"]["validationActions"] == ["Deny"]
    assert "matchResources" not in binding["spec"]  # a cluster-scoped install has trainers everywhere
    assert policy()["spec"]["failurePolicy"] == "Fail"


def test_the_policy_matches_pod_updates_only_which_is_what_the_trainers_patch_arrives_as() -> None:
    (rule,) = policy()["spec"]["matchConstraints"]["resourceRules"]
    assert rule == {"apiGroups": [""], "apiVersions": ["v1"], "operations": ["UPDATE"], "resources": ["pods"]}
    (granted,) = builders.role(JOB, ["llama-1-0"])["rules"]
    # Every request the Role allows is one the policy sees: PATCH is admitted as UPDATE, and the Role
    # grants no subresource the policy would not match.
    assert granted["verbs"] == ["patch"]
    assert granted["apiGroups"] == rule["apiGroups"] and granted["resources"] == rule["resources"]


def by_a_trainer_account(docs: list[Manifest], username: str) -> bool:
    """Whether the rendered policy's ``by-a-trainer-account`` condition holds for ``username``: it is
    evaluated here as the API server would, after checking that it has exactly the shape read."""
    (found,) = [
        m for m in one(docs, POLICY)["spec"]["matchConditions"] if m["name"] == "by-a-trainer-account"
    ]
    expression = found["expression"]
    pattern = re.search(r"matches\('(.+?)'\)", expression)
    spared = re.search(r"!= '([^']+)'$", expression)
    assert pattern is not None and spared is not None
    assert expression == (
        f"request.userInfo.username.matches('{pattern.group(1)}')"
        f" && request.userInfo.username != '{spared.group(1)}'"
    )
    return re.match(pattern.group(1), username) is not None and username != spared.group(1)


def operator_account(docs: list[Manifest]) -> str:
    deployment = one(docs, "Deployment")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    return f"system:serviceaccount:{deployment['metadata']['namespace']}:{account}"


def test_the_policy_applies_to_trainer_accounts_and_not_to_the_operator() -> None:
    docs = render()
    trainer = f"system:serviceaccount:{JOB.namespace}:{builders.trainer_account_name(JOB.name)}"
    assert by_a_trainer_account(docs, trainer)
    assert operator_account(docs) == "system:serviceaccount:sftjob-system:sft-sftjob-operator"
    for other in (operator_account(docs), "system:node:gpu-1", "admin"):
        assert not by_a_trainer_account(docs, other)


@pytest.mark.parametrize(
    "sets",
    [("fullnameOverride=llm-trainer",), ("serviceAccount.create=false", "serviceAccount.name=sft-trainer")],
)
def test_an_operator_whose_account_name_ends_in_trainer_is_not_judged_as_a_trainer(
    sets: tuple[str, ...],
) -> None:
    # Its patch removing Kueue's finalizer from a deleted queued pod would otherwise be refused (its token
    # is bound to the operator's pod, not the trainer's), leaving that pod Terminating.
    docs = render(sets=sets)
    assert operator_account(docs).endswith("-trainer")
    assert not by_a_trainer_account(docs, operator_account(docs))
    assert by_a_trainer_account(
        docs, f"system:serviceaccount:{JOB.namespace}:{builders.trainer_account_name(JOB.name)}"
    )


POD_NAME_SUFFIX = "-[0-9]+-[0-9]+$"  # -<attempt>-<rank>


def test_the_policy_concerns_sftjob_pods_and_every_pod_a_trainer_role_may_name() -> None:
    """The Role holds pod names before the pods exist; one someone else created under such a name is
    matched by its name: ``<job>-<attempt>-<rank>`` for the caller ``<job>-trainer``."""
    expression = condition("on-an-sftjob-pod-or-one-its-role-may-name")
    assert f"'{c.LABEL_JOB}' in oldObject.metadata.labels" in expression
    assert c.LABEL_JOB in builders.labels(JOB, attempt=1, rank=0)
    assert expression.count(f"'{POD_NAME_SUFFIX}'") == 2
    assert "'system:serviceaccount:' + request.namespace + ':'" in expression
    name = builders.pod_name(JOB.name, 12, 3)
    job = re.sub(POD_NAME_SUFFIX, "", name)
    assert job != name and f"{job}-trainer" == builders.trainer_account_name(JOB.name)
    assert re.search(POD_NAME_SUFFIX, builders.trainer_account_name(JOB.name)) is None


def test_the_policy_refuses_a_pod_that_is_not_the_callers_jobs() -> None:
    assert variable("podJob").split("?")[1].strip() == f"oldObject.metadata.labels['{c.LABEL_JOB}'] : ''"
    assert any(
        "'system:serviceaccount:' + request.namespace + ':' + variables.podJob + '-trainer'"
        in v["expression"]
        for v in policy()["spec"]["validations"]
    )


def test_the_annotations_the_trainer_may_write_are_the_ones_it_reports() -> None:
    assert variable("reported") == f"['{c.ANNOTATION_PROGRESS}', '{c.ANNOTATION_CHECKPOINT}']"
    for validation in policy()["spec"]["validations"]:
        message = validation.get("message") or validation["messageExpression"]
        assert "may" in message and "own pod" in message


def test_spec_labels_owners_and_finalizers_must_stay_as_they_were() -> None:
    expressions = " ".join(v["expression"] for v in policy()["spec"]["validations"])
    for field in ("spec", "metadata.labels", "metadata.ownerReferences", "metadata.finalizers"):
        assert f"object.{field}" in expressions and f"oldObject.{field}" in expressions
    # Fields the API server moves on every write are never compared.
    for field in ("resourceVersion", "managedFields", "generation", "status"):
        assert field not in expressions + " ".join(v["expression"] for v in policy()["spec"]["variables"])


def test_a_token_bound_to_a_pod_may_only_update_that_pod() -> None:
    assert "request.userInfo.extra['authentication.kubernetes.io/pod-name']" in variable("tokenPod")
    assert any(
        v["expression"] == "variables.tokenPod.all(p, p == object.metadata.name)"
        for v in policy()["spec"]["validations"]
    )


def test_a_namespaced_install_binds_the_policy_in_its_watched_namespaces_only() -> None:
    binding = one(render("namespaced"), BINDING)
    (selector,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert selector == {
        "key": "kubernetes.io/metadata.name",
        "operator": "In",
        "values": ["team-a", "team-b"],
    }


def test_the_policy_can_be_turned_off() -> None:
    docs = render(sets=("trainerPodPolicy.enabled=false",))
    assert find(docs, POLICY) == [] and find(docs, BINDING) == []


def test_a_cluster_without_the_policy_api_is_refused_with_the_value_that_turns_it_off() -> None:
    """`helm install` sees the cluster's kinds (here given with --api-versions, as discovery would)."""
    without = helm(*template_args(), "--api-versions", "v1/Pod", check=False)
    assert without.returncode != 0
    assert "does not serve admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy" in without.stderr
    assert "trainerPodPolicy.enabled=false" in without.stderr
    served = helm(*template_args(), "--api-versions", "v1/Pod", "--api-versions", API_KIND)
    assert f"kind: {POLICY}" in served.stdout
    turned_off = helm(*template_args(sets=("trainerPodPolicy.enabled=false",)), "--api-versions", "v1/Pod")
    assert f"kind: {POLICY}" not in turned_off.stdout


def test_a_misspelt_policy_value_is_refused() -> None:
    result = helm(*template_args(sets=("trainerPodPolicy.enable=false",)), check=False)
    assert result.returncode != 0 and "additional properties 'enable' not allowed" in result.stderr


@pytest.mark.parametrize("release", ["r" * 53, "sftjob"])
def test_the_policy_names_fit_whatever_the_release_is_called(release: str) -> None:
    out = helm(*template_args(release=release), "--show-only", "templates/trainer-pod-policy.yaml").stdout
    names = re.findall(r"^  name: (\S+)$", out, flags=re.MULTILINE)
    assert len(names) == 2 and all(len(n) <= 253 and n.endswith("-trainer-pods") for n in names)
