{{/*
Helpers shared by the templates. Object names are fixed by values (not derived from the
release name): the Workload Identity bindings made with gcloud name the Kubernetes service
accounts, and the Airflow sub-chart's values name the ConfigMap, so both must be predictable.
*/}}

{{/* Standard labels on every object this chart creates. */}}
{{- define "slipway.labels" -}}
app.kubernetes.io/name: slipway
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: slipway
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* An image reference from {repository, tag, digest}: the digest wins over the tag. */}}
{{- define "slipway.image" -}}
{{- if .digest -}}
{{- printf "%s@%s" .repository .digest -}}
{{- else -}}
{{- printf "%s:%s" .repository (toString .tag) -}}
{{- end -}}
{{- end -}}

{{/* The Google service account of a Kubernetes one: explicit, else <name>@<project>. */}}
{{- define "slipway.gsa" -}}
{{- $sa := index .root.Values.serviceAccounts .which -}}
{{- if $sa.gcpServiceAccount -}}
{{- $sa.gcpServiceAccount -}}
{{- else -}}
{{- printf "%s@%s.iam.gserviceaccount.com" $sa.name .root.Values.gcp.projectId -}}
{{- end -}}
{{- end -}}

{{/* The Dataflow project: dataflow.projectId, else gcp.projectId. */}}
{{- define "slipway.dataflowProject" -}}
{{- .Values.dataflow.projectId | default .Values.gcp.projectId -}}
{{- end -}}

{{/* The Dataflow worker service account: explicit, else slipway-dataflow@<project>. */}}
{{- define "slipway.dataflowServiceAccount" -}}
{{- .Values.dataflow.serviceAccount | default (printf "slipway-dataflow@%s.iam.gserviceaccount.com" .Values.gcp.projectId) -}}
{{- end -}}
