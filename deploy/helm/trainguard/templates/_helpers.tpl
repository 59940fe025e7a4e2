{{/* Names and shared snippets of the trainguard chart. */}}

{{- define "trainguard.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "trainguard.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "trainguard.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "trainguard.redisName" -}}
{{ include "trainguard.fullname" . }}-redis
{{- end -}}

{{/* The bundled NATS chart's StatefulSet and headless Service are named after the release. */}}
{{- define "trainguard.natsName" -}}
{{- if contains "nats" .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-nats" .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{/* TRAINGUARD_NATS_URL: every server of the cluster, so clients fail over between them. */}}
{{- define "trainguard.natsUrl" -}}
{{- if .Values.natsUrls -}}
{{- join "," .Values.natsUrls -}}
{{- else -}}
{{- $scheme := ternary "tls" "nats" .Values.nats.config.nats.tls.enabled -}}
{{- $name := include "trainguard.natsName" . -}}
{{- $urls := list -}}
{{- range $i := until (int .Values.nats.config.cluster.replicas) -}}
{{- $urls = append $urls (printf "%s://%s-%d.%s-headless.%s.svc:4222" $scheme $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- join "," $urls -}}
{{- end -}}
{{- end -}}

{{/* TRAINGUARD_REDIS_URL: the sentinels of the bundled set, or the URL given. */}}
{{- define "trainguard.redisUrl" -}}
{{- if .Values.redis.url -}}
{{- .Values.redis.url -}}
{{- else -}}
{{- $name := include "trainguard.redisName" . -}}
{{- $hosts := list -}}
{{- range $i := until (int .Values.redis.replicas) -}}
{{- $hosts = append $hosts (printf "%s-%d.%s-headless.%s.svc:26379" $name $i $name $.Release.Namespace) -}}
{{- end -}}
{{- printf "redis+sentinel://%s/%s/0" (join "," $hosts) .Values.redis.masterSet -}}
{{- end -}}
{{- end -}}

{{/* Non-empty when the bridge has a sink to notify (values, or TRAINGUARD_*_URL in its env). */}}
{{- define "trainguard.bridgeSinks" -}}
{{- $b := .Values.services.bridge -}}
{{- $env := $b.env | default dict -}}
{{- if or $b.alertmanagerUrl $b.webhookUrl $b.slackWebhook.secretName (hasKey $env "TRAINGUARD_ALERTMANAGER_URL") (hasKey $env "TRAINGUARD_WEBHOOK_URL") (hasKey $env "TRAINGUARD_SLACK_WEBHOOK_URL") -}}
sinks
{{- end -}}
{{- end -}}

{{/* Whether the service `name` is deployed: every one, the bridge only with a sink. */}}
{{- define "trainguard.deployed" -}}
{{- if or (ne .name "bridge") (include "trainguard.bridgeSinks" .root) -}}
yes
{{- end -}}
{{- end -}}

{{/* The role a service runs as: its own, or `service` (a plugin's, the bridge's). */}}
{{- define "trainguard.role" -}}
{{- ternary . "service" (has . (list "detector" "diagnoser" "remediator" "checkpointer")) -}}
{{- end -}}
