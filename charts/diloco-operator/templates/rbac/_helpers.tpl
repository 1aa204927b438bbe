{{/*
Helpers of the RBAC component. The operator's permissions are written once here and rendered
either into one ClusterRole (rbac.scope=cluster) or into a Role per watched namespace
(rbac.scope=namespace). Only the verbs the operator uses are granted.
*/}}

{{/*
Name of the operator's ClusterRole / Roles and their bindings.
*/}}
{{- define "diloco-operator.rbac.name" -}}
{{- include "diloco-operator.fullname" . }}
{{- end }}

{{/*
Labels of the RBAC objects.
*/}}
{{- define "diloco-operator.rbac.labels" -}}
{{ include "diloco-operator.labels" . }}
app.kubernetes.io/component: rbac
{{- end }}

{{/*
Rules on namespaced resources: what reconciling a DiLoCoJob touches in its own namespace.
*/}}
{{- define "diloco-operator.rbac.namespacedRules" -}}
# DiLoCoJobs: kopf watches them and patches annotations/finalizers; delete is for
# ttlSecondsAfterFinished.
- apiGroups: ["diloco.dev"]
  resources: ["dilocojobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["diloco.dev"]
  resources: ["dilocojobs/status"]
  verbs: ["get", "patch"]
# Children: the syncer Deployment and one StatefulSet per island.
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# Children: syncer and island Services, the trainer-config ConfigMap.
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The job's token Secret: generated when the user gives none, read to call the syncer.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "list", "watch", "create"]
# Island health comes from pod readiness.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# Events on DiLoCoJobs (kopf posts core events; the operator may use either API).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create", "patch"]
- apiGroups: ["events.k8s.io"]
  resources: ["events"]
  verbs: ["create", "patch"]
{{- end }}

{{/*
Rules on cluster-scoped resources, granted only with rbac.scope=cluster. kopf watches CRDs to
notice the DiLoCoJob CRD being (re)installed, and lists/watches namespaces when it is told to
watch specific namespaces (cluster-wide it does not need them).
*/}}
{{- define "diloco-operator.rbac.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["get", "list", "watch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}

{{/*
The subject every binding grants to: the operator's ServiceAccount.
*/}}
{{- define "diloco-operator.rbac.subjects" -}}
- kind: ServiceAccount
  name: {{ include "diloco-operator.serviceAccountName" . }}
  namespace: {{ .Release.Namespace }}
{{- end }}
