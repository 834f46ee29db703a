{{/* Names, labels and the pieces every pod shares. */}}

{{- define "pipeserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "pipeserve.fullname" -}}
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

{{- define "pipeserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Standard labels; callers add app.kubernetes.io/component. */}}
{{- define "pipeserve.labels" -}}
helm.sh/chart: {{ include "pipeserve.chart" . }}
{{ include "pipeserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: pipeserve
{{- end }}

{{- define "pipeserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pipeserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* "repository:tag", the tag defaulting to the chart's appVersion. Arg: the image values. */}}
{{- define "pipeserve.image" -}}
{{- $tag := .image.tag | default .root.Chart.AppVersion -}}
{{- printf "%s:%s" .image.repository $tag -}}
{{- end }}

{{/* The pod-level securityContext of every pod: non-root uid 10001 (the images' USER), seccomp. */}}
{{- define "pipeserve.podSecurityContext" -}}
runAsNonRoot: true
runAsUser: 10001
runAsGroup: 10001
fsGroup: 10001
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/* The container-level securityContext of every container. */}}
{{- define "pipeserve.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end }}

{{/* Scheduling of a Deployment's pods. Arg: the component's values. */}}
{{- define "pipeserve.scheduling" -}}
{{- with .nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{- define "pipeserve.imagePullSecrets" -}}
{{- with .Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end }}

{{/* The Secret (name, key) that holds the L3 URL, or nothing when redis.mode is none. */}}
{{- define "pipeserve.redisSecretName" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecret -}}
{{- else if and (eq .Values.redis.mode "internal") .Values.redis.internal.auth.existingSecret -}}
{{- .Values.redis.internal.auth.existingSecret -}}
{{- else if ne .Values.redis.mode "none" -}}
{{- printf "%s-redis" (include "pipeserve.fullname" .) -}}
{{- end -}}
{{- end }}

{{- define "pipeserve.redisSecretKey" -}}
{{- if and (eq .Values.redis.mode "external") .Values.redis.external.existingSecret -}}
{{- .Values.redis.external.existingSecretKey -}}
{{- else if and (eq .Values.redis.mode "internal") .Values.redis.internal.auth.existingSecret -}}
{{- .Values.redis.internal.auth.urlKey -}}
{{- else -}}
url
{{- end -}}
{{- end }}

{{/* The RBAC kind the operator gets: ClusterRole when it watches every namespace. */}}
{{- define "pipeserve.operatorRoleKind" -}}
{{- if .Values.operator.watchNamespace }}Role{{ else }}ClusterRole{{ end -}}
{{- end }}

{{/* The router's --models file (router/upstream/models_file.py): router.pipelines, each served name once. */}}
{{- define "pipeserve.routerModels" -}}
{{- $seen := dict }}
{{- range .Values.router.pipelines }}
{{- if hasKey $seen .model }}
{{- fail (printf "router.pipelines: the model %q is served twice" .model) }}
{{- end }}
{{- $_ := set $seen .model true }}
{{- end }}
{{- toYaml .Values.router.pipelines }}
{{- end }}

{{/* The InferencePipeline autoscaling scales: autoscaling.pipeline, else router.pipeline. */}}
{{- define "pipeserve.scaledPipeline" -}}
{{- .Values.autoscaling.pipeline | default .Values.router.pipeline -}}
{{- end }}

{{/* The Prometheus name of autoscaling.metric (docs/metrics.md). */}}
{{- define "pipeserve.scaleMetric" -}}
{{- if eq .Values.autoscaling.metric "kvUsage" }}pipeserve:kv_cache_usage_perc{{ else }}pipeserve:num_requests_waiting{{ end -}}
{{- end }}
