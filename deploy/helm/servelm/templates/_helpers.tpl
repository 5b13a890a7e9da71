{{/* Names and labels shared by every template. */}}
{{- define "servelm.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "servelm.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "servelm.selectorLabels" -}}
app.kubernetes.io/name: {{ include "servelm.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "servelm.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "servelm.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "servelm.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "servelm.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "servelm.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "servelm.secretName" -}}
{{- default (printf "%s-keys" (include "servelm.fullname" .)) .Values.apiKeys.existingSecret -}}
{{- end -}}

{{/* The workload's kind after the chart's own checks of exclusive options. */}}
{{- define "servelm.validate" -}}
{{- if and .Values.autoscaling.hpa.enabled .Values.autoscaling.keda.enabled -}}
{{- fail "autoscaling.hpa.enabled and autoscaling.keda.enabled are exclusive: KEDA creates its own HPA" -}}
{{- end -}}
{{- if not (has .Values.kind (list "Deployment" "StatefulSet")) -}}
{{- fail (printf "kind must be Deployment or StatefulSet, got %q" .Values.kind) -}}
{{- end -}}
{{- if and (eq .Values.kind "StatefulSet") .Values.persistence.existingClaim -}}
{{- fail "persistence.existingClaim is for a Deployment: a StatefulSet claims one volume per pod" -}}
{{- end -}}
{{- if gt (len (compact (list .Values.database.url .Values.database.existingSecret .Values.registry.url (ternary "bundled" "" .Values.database.bundled.enabled)))) 1 -}}
{{- fail "give one control database: database.url, database.existingSecret, registry.url (its older name) or database.bundled.enabled" -}}
{{- end -}}
{{- if and .Values.database.bundled.enabled (not .Values.database.bundled.password) -}}
{{- fail "database.bundled.enabled needs database.bundled.password" -}}
{{- end -}}
{{- if gt (len (compact (list .Values.redis.url .Values.redis.existingSecret (ternary "bundled" "" .Values.redis.bundled.enabled)))) 1 -}}
{{- fail "give one Redis: redis.url, redis.existingSecret or redis.bundled.enabled" -}}
{{- end -}}
{{- if and .Values.ray.enabled (not .Values.ray.model) -}}
{{- fail "ray.enabled needs ray.model (the model path the Ray Serve replicas serve)" -}}
{{- end -}}
{{- end -}}

{{/* The pod's container resources, with nvidia.com/gpu when gpu.count > 0. */}}
{{- define "servelm.resources" -}}
{{- $res := deepCopy .Values.resources -}}
{{- if gt (int .Values.gpu.count) 0 -}}
{{- $_ := set $res.requests "nvidia.com/gpu" (int .Values.gpu.count) -}}
{{- $_ := set $res.limits "nvidia.com/gpu" (int .Values.gpu.count) -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* A bundled service's name and labels: its own app name, so the server's Service, PDB and NetworkPolicy
(which select servelm's name and instance) never select it. */}}
{{- define "servelm.serviceName" -}}
{{- printf "%s-%s" (include "servelm.fullname" .root) .service | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "servelm.serviceSelector" -}}
app.kubernetes.io/name: {{ printf "%s-%s" (include "servelm.name" .root) .service }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
{{- end -}}

{{- define "servelm.serviceLabels" -}}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{ include "servelm.serviceSelector" . }}
app.kubernetes.io/component: {{ .service }}
app.kubernetes.io/part-of: {{ include "servelm.name" .root }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
{{- end -}}
