{{/* Names and labels shared by every template of the chart. */}}

{{- define "sftjob.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: the release name alone when it already contains the chart's name.
       At most 55 characters, so that the longest name made from it, the Service "<fullname>-metrics",
       fits in the 63 characters of a DNS label. */}}
{{- define "sftjob.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sftjob.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "sftjob.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sftjob.name" . | quote }}
app.kubernetes.io/instance: {{ .Release.Name | quote }}
{{- end }}

{{- define "sftjob.labels" -}}
helm.sh/chart: {{ include "sftjob.chart" . | quote }}
{{ include "sftjob.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sftjob
{{- end }}

{{- define "sftjob.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "sftjob.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* Fails when the liveness and metrics ports are the same: the second server could not bind. */}}
{{- define "sftjob.checkPorts" -}}
{{- if eq (int .Values.liveness.port) (int .Values.metrics.port) }}
{{- fail (printf "liveness.port and metrics.port are both %d: the operator serves them from two servers, so they must differ" (int .Values.liveness.port)) }}
{{- end }}
{{- end }}

{{/* kopf's --liveness URL. kopf binds the URL's host exactly (asyncio makes an IPv6 socket IPv6-only),
       so liveness.host picks the family; an IPv6 address goes in brackets, given with or without them. */}}
{{- define "sftjob.livenessUrl" -}}
{{- $host := .Values.liveness.host | trimPrefix "[" | trimSuffix "]" }}
{{- if contains ":" $host }}
{{- $host = printf "[%s]" $host }}
{{- end }}
{{- printf "http://%s:%d/healthz" $host (int .Values.liveness.port) }}
{{- end }}

{{/* A duration of the form the schema allows (numbers with ms, s, m or h, e.g. 1m30s), in milliseconds. */}}
{{- define "sftjob.durationMs" -}}
{{- $ms := 0 }}
{{- $unitMs := dict "ms" 1 "s" 1000 "m" 60000 "h" 3600000 }}
{{- range regexFindAll "[0-9]+(ms|s|m|h)" . -1 }}
{{- $number := regexFind "^[0-9]+" . }}
{{- $ms = add $ms (mul (int $number) (get $unitMs (trimPrefix $number .))) }}
{{- end }}
{{- $ms }}
{{- end }}

{{/* Fails when a monitor's scrapeTimeout is longer than its interval: the Prometheus Operator rejects
       such a monitor and scrapes nothing of it. Takes (dict "name" "metrics.podMonitor" "monitor" ...). */}}
{{- define "sftjob.checkScrapeTimeout" -}}
{{- $interval := .monitor.interval }}
{{- $timeout := .monitor.scrapeTimeout }}
{{- if gt (int (include "sftjob.durationMs" $timeout)) (int (include "sftjob.durationMs" $interval)) }}
{{- fail (printf "%s.scrapeTimeout (%s) is longer than %s.interval (%s): the Prometheus Operator rejects such a monitor and nothing is scraped; set %s.scrapeTimeout to at most %s" .name $timeout .name $interval .name $interval) }}
{{- end }}
{{- end }}

{{- define "sftjob.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The namespaces a namespaced install serves. Fails early when the list is empty, and when it is
       set without scope namespaced (a cluster-scoped install would silently serve every namespace). */}}
{{- define "sftjob.watchNamespaces" -}}
{{- if eq .Values.operator.scope "namespaced" }}
{{- if not .Values.operator.watchNamespaces }}
{{- fail "operator.watchNamespaces must list at least one namespace when operator.scope is namespaced" }}
{{- end }}
{{- toJson .Values.operator.watchNamespaces }}
{{- else }}
{{- if .Values.operator.watchNamespaces }}
{{- fail (printf "operator.watchNamespaces (%s) is only used with operator.scope=namespaced: set operator.scope=namespaced to serve only these namespaces, or empty the list to serve every namespace" (join ", " .Values.operator.watchNamespaces)) }}
{{- end }}
{{- toJson list }}
{{- end }}
{{- end }}

{{/* The peering object's name: one per release, so two releases never pause each other. */}}
{{- define "sftjob.peeringName" -}}
{{- .Release.Name }}
{{- end }}

{{- define "sftjob.runbookUrl" -}}
{{- printf "%s#%s" .root.Values.alerts.runbookBaseUrl .anchor }}
{{- end }}

