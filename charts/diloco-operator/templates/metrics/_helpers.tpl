{{/*
Helpers of the metrics component (Service, ServiceMonitor).
*/}}

{{/*
Name of the metrics Service and ServiceMonitor.
*/}}
{{- define "diloco-operator.metrics.name" -}}
{{- printf "%s-metrics" (include "diloco-operator.fullname" .) | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of the metrics objects.
*/}}
{{- define "diloco-operator.metrics.labels" -}}
{{ include "diloco-operator.labels" . }}
app.kubernetes.io/component: metrics
{{- end }}

{{/*
Selector labels of the metrics Service (what the ServiceMonitor matches).
*/}}
{{- define "diloco-operator.metrics.selectorLabels" -}}
{{ include "diloco-operator.selectorLabels" . }}
app.kubernetes.io/component: metrics
{{- end }}
