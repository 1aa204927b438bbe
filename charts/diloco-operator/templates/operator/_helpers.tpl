{{/*
Helpers of the operator component (Deployment, ServiceAccount).
*/}}

{{/*
Name of the operator Deployment and its pods.
*/}}
{{- define "diloco-operator.operator.name" -}}
{{- include "diloco-operator.fullname" . }}
{{- end }}

{{/*
Labels of the operator's resources.
*/}}
{{- define "diloco-operator.operator.labels" -}}
{{ include "diloco-operator.labels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
Selector labels of the operator pods.
*/}}
{{- define "diloco-operator.operator.selectorLabels" -}}
{{ include "diloco-operator.selectorLabels" . }}
app.kubernetes.io/component: operator
{{- end }}

{{/*
The operator pods' selector labels as name=value pairs (DILOCO_OPERATOR_POD_LABELS): jobs'
NetworkPolicies let these pods reach their syncers.
*/}}
{{- define "diloco-operator.operator.selectorLabelPairs" -}}
{{- $pairs := list }}
{{- range $name, $value := include "diloco-operator.operator.selectorLabels" . | fromYaml }}
{{- $pairs = append $pairs (printf "%s=%s" $name $value) }}
{{- end }}
{{- join "," $pairs }}
{{- end }}

{{/*
Image reference: repository@digest when a digest is given, else repository:tag with the tag
defaulting to the chart's appVersion (the Dockerfile builds the same version).
*/}}
{{- define "diloco-operator.operator.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}
{{- end }}

{{/*
Arguments of `diloco` in the operator container. The image's ENTRYPOINT is `diloco` and its CMD
is `operator`; these args replace the CMD, so they start with the subcommand.
*/}}
{{- define "diloco-operator.operator.args" -}}
- operator
- --standalone
- --health-port
- {{ .Values.operator.healthPort | quote }}
- --metrics-port
- {{ .Values.operator.metricsPort | quote }}
{{- range .Values.watchNamespaces }}
- --namespace
- {{ . | quote }}
{{- end }}
{{- with .Values.operator.extraArgs }}
{{ toYaml . }}
{{- end }}
{{- end }}
