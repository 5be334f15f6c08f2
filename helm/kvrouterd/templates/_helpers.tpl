{{/* Chart name, truncated to the 63 characters a label value allows. */}}
{{- define "kvrouterd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name: release-chart unless the release name already contains it. */}}
{{- define "kvrouterd.fullname" -}}
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

{{- define "kvrouterd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kvrouterd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrouterd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvrouterd.labels" -}}
helm.sh/chart: {{ include "kvrouterd.chart" . }}
{{ include "kvrouterd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/* The bridge's pods: another name, so the router's Service, PDB and HPA never select them. */}}
{{- define "kvrouterd.bridgeSelectorLabels" -}}
app.kubernetes.io/name: {{ include "kvrouterd.name" . | trunc 56 | trimSuffix "-" }}-bridge
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kvrouterd.bridgeLabels" -}}
helm.sh/chart: {{ include "kvrouterd.chart" . }}
{{ include "kvrouterd.bridgeSelectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: bridge
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "kvrouterd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvrouterd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* repository@digest when a digest is given, else repository:tag (tag defaults to appVersion). */}}
{{- define "kvrouterd.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/* The namespace discovery watches: the configured one, else the release's. */}}
{{- define "kvrouterd.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.config.discovery.kubernetes.namespace }}
{{- end }}

{{- define "kvrouterd.tlsDir" -}}
/etc/kvrouterd/tls
{{- end }}

{{- define "kvrouterd.authDir" -}}
/etc/kvrouterd/auth
{{- end }}

{{/*
The Secret holding the accepted control-RPC token(s): auth.secretName, or the one the chart
generates (templates/auth-secret.yaml).
*/}}
{{- define "kvrouterd.authSecretName" -}}
{{- .Values.auth.secretName | default (printf "%s-auth" (include "kvrouterd.fullname" . | trunc 58 | trimSuffix "-")) }}
{{- end }}

{{/*
The kvrouterd config file: .Values.config, plus the sections the chart owns because they name
ports or files it mounts (metrics listener, TLS and auth-token paths) and the event bus switch
(events.bus kind and url from eventBus). The listen address is passed as a flag, which wins
over the file. The bridge reads the same file.
*/}}
{{- define "kvrouterd.config" -}}
{{- $cfg := deepCopy .Values.config }}
{{- if .Values.metrics.enabled }}
{{- $_ := set $cfg "metrics" (dict "listen" (printf "%s:%d" .Values.bindAddress (int .Values.ports.metrics))) }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $dir := include "kvrouterd.tlsDir" . }}
{{- $tls := dict "cert_file" (printf "%s/tls.crt" $dir) "key_file" (printf "%s/tls.key" $dir) }}
{{- if .Values.tls.clientAuth }}
{{- $_ := set $tls "ca_file" (printf "%s/ca.crt" $dir) }}
{{- $_ := set $tls "require_client_cert" true }}
{{- end }}
{{- $_ := set $cfg "tls" $tls }}
{{- end }}
{{- if .Values.eventBus.enabled }}
{{- $events := default (dict) $cfg.events }}
{{- $bus := default (dict) $events.bus }}
{{- $_ := set $bus "kind" "nats" }}
{{- $_ := set $bus "url" .Values.eventBus.url }}
{{- $_ := set $events "bus" $bus }}
{{- $_ := set $cfg "events" $events }}
{{- end }}
{{- if .Values.auth.enabled }}
{{- $token := printf "%s/%s" (include "kvrouterd.authDir" .) .Values.auth.secretKey }}
{{- $_ := set $cfg "auth" (dict "token_file" $token "protect" .Values.auth.protect) }}
{{- end }}
{{- toYaml $cfg }}
{{- end }}

{{/*
Probe action. Plaintext: the kubelet's native gRPC probe against grpc.health.v1 (service "").
TLS: the kubelet's gRPC probe cannot do TLS, so the container asks itself over TLS with the
mounted certificates (the same check as the image's HEALTHCHECK); the Secret must hold ca.crt
(cert-manager's do) and, for mTLS, the server's own pair doubles as the probe's client cert.
*/}}
{{- define "kvrouterd.probeAction" -}}
{{- if .Values.tls.enabled }}
{{- $dir := include "kvrouterd.tlsDir" . }}
{{- $client := ternary (printf "open('%s/tls.key','rb').read(), open('%s/tls.crt','rb').read()" $dir $dir) "None, None" .Values.tls.clientAuth -}}
exec:
  command:
    - python
    - -c
    - {{ printf "import sys, grpc; from grpc_health.v1 import health_pb2 as h, health_pb2_grpc as g; c = grpc.ssl_channel_credentials(open('%s/ca.crt','rb').read(), %s); ch = grpc.secure_channel('127.0.0.1:%d', c, options=[('grpc.ssl_target_name_override', '%s')]); r = g.HealthStub(ch).Check(h.HealthCheckRequest(service=''), timeout=2); sys.exit(0 if r.status == h.HealthCheckResponse.SERVING else 1)" $dir $client (int .Values.ports.grpc) .Values.tls.serverName | quote }}
{{- else -}}
grpc:
  port: {{ .Values.ports.grpc }}
  service: ""
{{- end }}
{{- end }}
