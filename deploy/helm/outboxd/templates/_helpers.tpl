{{- define "outboxd.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "outboxd.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "outboxd.selector" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "outboxd.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/* The database password file, mounted where $PGPASSFILE points. */}}
{{- define "outboxd.pgpassEnv" -}}
{{- if .Values.database.passfileSecret }}
- name: PGPASSFILE
  value: /etc/outboxd/pgpass/pgpass
{{- end }}
{{- end -}}
{{- define "outboxd.pgpassVolumeMount" -}}
{{- if .Values.database.passfileSecret }}
- name: pgpass
  mountPath: /etc/outboxd/pgpass
  readOnly: true
{{- end }}
{{- end -}}
{{- define "outboxd.pgpassVolume" -}}
{{- if .Values.database.passfileSecret }}
- name: pgpass
  secret:
    secretName: {{ .Values.database.passfileSecret }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* The server's configuration file: what the chart decides, then server.config. */}}
{{- define "outboxd.serverConfig" -}}
{{- if hasKey .Values.server.config "shutdown-timeout" }}
{{- fail "server.config.shutdown-timeout: set server.shutdownTimeoutSeconds instead (the pod's grace period follows it)" }}
{{- end }}
{{- if and (not .Values.server.tokensSecret) (not .Values.server.insecureNoAuth) }}
{{- fail "server.tokensSecret is empty: give the token file's Secret, or set server.insecureNoAuth (outboxd serve refuses a non-loopback listener without tokens)" }}
{{- end }}
{{- $c := dict
  "database-url" .Values.database.url
  "listen" (printf "0.0.0.0:%v" .Values.server.ports.grpc)
  "http-listen" (printf "0.0.0.0:%v" .Values.server.ports.http)
  "shutdown-timeout" (printf "%vs" .Values.server.shutdownTimeoutSeconds)
  "log-format" "json" -}}
{{- if .Values.server.tokensSecret }}
{{- $_ := set $c "token-file" "/etc/outboxd/tokens/tokens" }}
{{- end }}
{{- if .Values.server.insecureNoAuth }}
{{- $_ := set $c "insecure-no-auth" true }}
{{- end }}
{{- if .Values.server.tls.secret }}
{{- $_ := set $c "tls-cert" "/etc/outboxd/tls/tls.crt" }}
{{- $_ := set $c "tls-key" "/etc/outboxd/tls/tls.key" }}
{{- if .Values.server.tls.clientCA }}
{{- $_ := set $c "tls-client-ca" "/etc/outboxd/tls/ca.crt" }}
{{- end }}
{{- end }}
{{- toYaml (mergeOverwrite $c .Values.server.config) }}
{{- end -}}

{{/* A relay's configuration file. */}}
{{- define "outboxd.relayConfig" -}}
{{- $r := .relay -}}
{{- $v := .root.Values -}}
{{- if hasKey ($r.config | default dict) "drain-timeout" }}
{{- fail (printf "relay %s: config.drain-timeout: set relayDefaults.drainTimeoutSeconds instead (the pod's grace period follows it)" $r.name) }}
{{- end }}
{{- if and $v.server.tls.clientCA (not $r.tlsSecret) }}
{{- fail (printf "relay %s: server.tls.clientCA (mutual TLS) needs the relay's client certificate: set its tlsSecret" $r.name) }}
{{- end }}
{{- if and $r.routeSecret (or $r.sink $r.sinkSecret) }}
{{- fail (printf "relay %s: routeSecret replaces sink and sinkSecret (give the sinks in the routes)" $r.name) }}
{{- end }}
{{- $c := dict
  "server" (printf "%s:%v" (include "outboxd.fullname" .root) $v.server.ports.grpc)
  "drain-timeout" (printf "%vs" $v.relayDefaults.drainTimeoutSeconds)
  "log-format" "json" -}}
{{- if $r.sink }}
{{- $_ := set $c "sink" $r.sink }}
{{- end }}
{{- if $r.tokenSecret }}
{{- $_ := set $c "token-file" "/etc/outboxd/token/token" }}
{{- end }}
{{- if $v.server.tls.secret }}
{{- $_ := set $c "tls" true }}
{{- end }}
{{- if $r.tlsSecret }}
{{- $_ := set $c "tls-ca" "/etc/outboxd/tls/ca.crt" }}
{{- $_ := set $c "tls-cert" "/etc/outboxd/tls/tls.crt" }}
{{- $_ := set $c "tls-key" "/etc/outboxd/tls/tls.key" }}
{{- end }}
{{- toYaml (mergeOverwrite $c ($r.config | default dict)) }}
{{- end -}}
