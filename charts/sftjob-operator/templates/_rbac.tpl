{{/*
The operator's permissions, in one place. Every verb here is one the operator (or kopf under it) calls,
or one it must hold to grant it: Kubernetes only lets the operator create the per-job trainer Role
(patch on the job's own pods) if the operator holds those verbs itself.
tests/e2e/test_chart_install.py checks each rule against what the operator does when it runs as this
ServiceAccount. docs/install.md lists why each rule exists.
*/}}

{{/* Rules on namespaced objects: a ClusterRole in cluster scope, a Role per namespace otherwise. */}}
{{- define "sftjob.namespacedRules" -}}
# The SFTJobs: watched; patched by kopf only to drop the finalizer early builds added; deleted after
# spec.ttlSecondsAfterFinished; their status written through the status subresource.
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs"]
  verbs: ["list", "watch", "patch", "delete"]
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs/status"]
  verbs: ["patch"]
# No request uses it: the children's ownerReferences set blockOwnerDeletion, and clusters running the
# OwnerReferencesPermissionEnforcement admission plugin (OpenShift's default) refuse that to a creator
# that may not update the owner's finalizers.
- apiGroups: ["sftjob.io"]
  resources: ["sftjobs/finalizers"]
  verbs: ["update"]
# Trainer pods: created per attempt, watched (exit codes, progress annotations), deleted on suspend and
# restart; get when the watch lacks a pod long after its attempt started. patch is what each job's
# trainer Role grants on its own pods: Kubernetes lets the operator create that Role only if it holds it.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["create", "delete", "list", "watch", "get", "patch"]
# The job's other children. A create that finds the name taken gets the object to check that it is
# this job's (its ownerReference) before counting it as made.
# The trainer config (re-rendered for each attempt) and the per-job trainer Role (its pod names).
- apiGroups: [""]
  resources: ["configmaps"]
  verbs: ["create", "get", "patch"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["roles"]
  verbs: ["create", "get", "patch"]
# Created once per job and owned by it: the checkpoint volume, the rendezvous Service of multi-node
# jobs, the trainer's ServiceAccount and its RoleBinding. A multi-node job's own claims are also read
# (get) before its first attempt, to refuse one its nodes cannot all mount; one it cannot read is not checked.
- apiGroups: [""]
  resources: ["persistentvolumeclaims", "services", "serviceaccounts"]
  verbs: ["create", "get"]
- apiGroups: ["rbac.authorization.k8s.io"]
  resources: ["rolebindings"]
  verbs: ["create", "get"]
# Each job's NetworkPolicy (trainerNetworkPolicy.enabled): only its own pods reach its trainers.
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["create", "get"]
# Kueue's Workload of an attempt its queue holds (spec.queueName): read to say why it waits (the quota it
# lacks, a LocalQueue that does not exist). Without Kueue the read finds nothing and the reason is left out.
- apiGroups: ["kueue.x-k8s.io"]
  resources: ["workloads"]
  verbs: ["get"]
# Job transitions (Created, Running, Failed...) as Kubernetes events.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* kopf's namespaced peering, used by a namespaced install. */}}
{{- define "sftjob.namespacedPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  verbs: ["list", "watch"]
# Its keep-alives go to its own peering only, never to another kopf operator's.
- apiGroups: ["kopf.dev"]
  resources: ["kopfpeerings"]
  resourceNames: [{{ include "sftjob.peeringName" . | quote }}]
  verbs: ["patch"]
{{- end }}

{{/* Cluster-scoped reads, needed in both scopes. */}}
{{- define "sftjob.clusterReadRules" -}}
# GPU nodes, indexed in memory: which GPU types exist and where attempts land (nvidia.com/gpu.product).
- apiGroups: [""]
  resources: ["nodes"]
  verbs: ["list", "watch"]
# kopf notices the SFTJob CRD being installed, upgraded or removed while it runs; the operator lists it by
# name at start to check its sftjob.io/schema-revision.
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
{{- end }}

{{/* Namespace reads of a namespaced install: kopf lists and watches namespaces to learn whether the
       ones it serves exist; refused, it retries for about a minute before serving anything. */}}
{{- define "sftjob.namespaceReadRules" -}}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}

{{/* kopf's cluster-wide peering, used by a cluster-scoped install. */}}
{{- define "sftjob.clusterPeeringRules" -}}
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  verbs: ["list", "watch"]
# Its keep-alives go to its own peering only, never to another kopf operator's.
- apiGroups: ["kopf.dev"]
  resources: ["clusterkopfpeerings"]
  resourceNames: [{{ include "sftjob.peeringName" . | quote }}]
  verbs: ["patch"]
{{- end }}
