{{/*
Chart-wide helpers: names and labels shared by every component.
*/}}

{{/*
Short name of the chart (nameOverride wins).
*/}}
{{- define "diloco-operator.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: release-chart, or the release name alone when it already contains the chart name.
Truncated to 63 characters because some Kubernetes name fields are limited to that (DNS-1123).
*/}}
{{- define "diloco-operator.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
chart label: name-version with `+` (not allowed in label values) replaced.
*/}}
{{- define "diloco-operator.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that never change over the release's life: used in selectors.
*/}}
{{- define "diloco-operator.selectorLabels" -}}
app.kubernetes.io/name: {{ include "diloco-operator.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Labels on every resource of the chart.
*/}}
{{- define "diloco-operator.labels" -}}
helm.sh/chart: {{ include "diloco-operator.chart" . }}
{{ include "diloco-operator.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: diloco-operator
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Name of the ServiceAccount the operator runs as.
*/}}
{{- define "diloco-operator.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "diloco-operator.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Cross-field checks the JSON schema cannot phrase clearly. Included by the Deployment so that a
bad combination fails `helm template` / `helm install` with a message naming the values.
*/}}
{{- define "diloco-operator.validateValues" -}}
{{- if and (eq .Values.rbac.scope "namespace") (empty .Values.watchNamespaces) }}
{{- fail "rbac.scope=namespace needs watchNamespaces: list the namespaces the operator may watch (e.g. --set 'watchNamespaces={team-a,team-b}'), or use rbac.scope=cluster" }}
{{- end }}
{{- if and .Values.metrics.serviceMonitor.enabled (not .Values.metrics.service.enabled) }}
{{- fail "metrics.serviceMonitor.enabled=true needs metrics.service.enabled=true: the ServiceMonitor selects the metrics Service" }}
{{- end }}
{{- end }}
