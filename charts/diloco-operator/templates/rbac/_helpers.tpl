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
Rules on namespaced resources: what reconciling a DiLoCoJob touches in its own namespace. Read
from the operator's code (kopf handlers and diloco_operator/kube.py); get/watch come with list
where list is needed, since they reveal nothing list does not.
*/}}
{{- define "diloco-operator.rbac.namespacedRules" -}}
# DiLoCoJobs: kopf lists/watches them and patches its annotations and finalizers; delete is
# for ttlSecondsAfterFinished.
- apiGroups: ["diloco.dev"]
  resources: ["dilocojobs"]
  verbs: ["get", "list", "watch", "patch", "delete"]
- apiGroups: ["diloco.dev"]
  resources: ["dilocojobs/status"]
  verbs: ["patch"]
# Children: created when absent (get when the name is taken, to see whose it is), then written
# with server-side apply (patch), listed by the job's label, deleted when islands are removed.
# kopf watches them for drift. NetworkPolicies: one per job (networkPolicy.enabled).
- apiGroups: ["apps"]
  resources: ["statefulsets", "deployments"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: [""]
  resources: ["services", "configmaps"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
- apiGroups: ["networking.k8s.io"]
  resources: ["networkpolicies"]
  verbs: ["get", "list", "watch", "create", "patch", "delete"]
# The job's credentials: the token Secret (created when the user gives none, patched when the job
# asks for a rotation) and the islands' credentials Secret (written with server-side apply), read
# by name. No list/watch: the operator never needs to see other Secrets.
- apiGroups: [""]
  resources: ["secrets"]
  verbs: ["get", "create", "patch"]
# Island health comes from pod readiness.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["get", "list", "watch"]
# kopf posts core/v1 Events on DiLoCoJobs.
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
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
