{{/* Names and labels. */}}
{{- define "liverl.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "liverl.labels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{/* Selector labels of one role: (dict "root" $ "component" "gate"). */}}
{{- define "liverl.selector" -}}
app.kubernetes.io/name: {{ .root.Chart.Name }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "liverl.image" -}}
{{- $tag := ternary .root.Values.image.gpuTag .root.Values.image.tag (and .root.Values.gpu (default false .gpu)) -}}
{{- printf "%s:%s" .root.Values.image.repository $tag -}}
{{- end -}}

{{- define "liverl.rolePrefix" -}}
{{- if .Values.credentials.rolePrefix -}}
{{- .Values.credentials.rolePrefix -}}
{{- else -}}
{{- $p := regexReplaceAll "[^a-z0-9_]" (lower .Values.topicsPrefix) "_" -}}
{{- if regexMatch "^[0-9]" $p }}_{{ end }}{{ $p }}_
{{- end -}}
{{- end -}}

{{/* A serving node's gateway URL, as the router and the fleet name it: (dict "root" $ "node" "node-0"). */}}
{{- define "liverl.nodeURL" -}}
{{- $fn := include "liverl.fullname" .root -}}
{{- printf "http://%s-serve-%s-0.%s-serve.%s.svc.%s:%d" $fn .node $fn .root.Release.Namespace .root.Values.clusterDomain (int .root.Values.serve.gatewayPort) -}}
{{- end -}}

{{/* serving.fleet as JSON: every node's name -> its gateway URL. */}}
{{- define "liverl.fleet" -}}
{{- $fleet := dict -}}
{{- range .Values.serve.nodes -}}
{{- $_ := set $fleet .name (include "liverl.nodeURL" (dict "root" $ "node" .name)) -}}
{{- end -}}
{{- toJson $fleet -}}
{{- end -}}

{{/* The Secret of one role: (dict "root" $ "key" "gate" "secret" .Values.gate.secret). */}}
{{- define "liverl.secretName" -}}
{{- default (printf "%s-%s" .root.Values.credentials.secretPrefix .key) .secret -}}
{{- end -}}

{{/*
The environment of one process: (dict "root" $ "key" ROLE-KEY "user" ROLE-NAME "files" (list SETTING=FILE ...)
"extra" LIST-OF-ENV). ROLE-KEY names the password files (gate, node-node-0), ROLE-NAME the database role and Redis
user (gate, node_node-0); files are the key files the role mounts, each with the setting that points at it.
*/}}
{{- define "liverl.env" -}}
{{- $v := .root.Values -}}
{{- $user := ternary (printf "%s%s" (include "liverl.rolePrefix" .root) .user) "" $v.credentials.perRole -}}
{{- $dbUser := default $v.registry.user $user -}}
{{- $redisUser := default $v.redis.user $user -}}
- name: LIVERL__TOPICS__PREFIX
  value: {{ $v.topicsPrefix | quote }}
- name: LIVERL__STATE_DIR
  value: /var/lib/liverl/state
- name: LIVERL__BROKER__BOOTSTRAP
  value: {{ required "kafka.bootstrap is required" $v.kafka.bootstrap | quote }}
- name: LIVERL__BROKER__PARTITIONS
  value: {{ $v.kafka.partitions | quote }}
- name: LIVERL__BROKER__SECURITY_PROTOCOL
  value: {{ $v.kafka.securityProtocol | quote }}
{{- if hasPrefix "SASL" $v.kafka.securityProtocol }}
- name: LIVERL__BROKER__SASL_MECHANISM
  value: {{ $v.kafka.saslMechanism | quote }}
- name: LIVERL__BROKER__SASL_USERNAME
  value: {{ required "kafka.saslUsername is required with SASL" $v.kafka.saslUsername | quote }}
{{- end }}
{{- if $v.kafka.saslConfigSecret }}
- name: LIVERL_CONFIG
  value: /etc/liverl/broker/config.toml
{{- end }}
{{- if $v.kafka.tlsSecret }}
- name: LIVERL__BROKER__SSL_CAFILE
  value: /etc/liverl/kafka/ca.crt
{{- if $v.kafka.tlsClientCert }}
- name: LIVERL__BROKER__SSL_CERTFILE
  value: /etc/liverl/kafka/tls.crt
- name: LIVERL__BROKER__SSL_KEYFILE
  value: /etc/liverl/kafka/tls.key
{{- end }}
{{- end }}
- name: LIVERL__REDIS__URL
  value: {{ printf "%s://%s%s:%d/%d" $v.redis.scheme (ternary (printf "%s@" $redisUser) "" (ne $redisUser "")) (required "redis.host is required" $v.redis.host) (int $v.redis.port) (int $v.redis.db) | quote }}
- name: LIVERL__REGISTRY__URL
  value: {{ printf "postgresql+psycopg://%s@%s:%d/%s%s" (required "a registry user is required" $dbUser) (required "registry.host is required" $v.registry.host) (int $v.registry.port) $v.registry.database (ternary (printf "?%s" $v.registry.options) "" (ne $v.registry.options "")) | quote }}
{{- if $v.credentials.perRole }}
- name: LIVERL__REGISTRY__PASSWORD_FILE
  value: {{ printf "/etc/liverl/keys/db-%s.password" .key | quote }}
- name: LIVERL__REDIS__PASSWORD_FILE
  value: {{ printf "/etc/liverl/keys/redis-%s.password" .key | quote }}
{{- end }}
- name: LIVERL__REGISTRY__BLOB_DIR
  value: {{ required "registry.blobDir is required" $v.registry.blobDir | quote }}
{{- if $v.s3.endpoint }}
- name: AWS_ENDPOINT_URL
  value: {{ $v.s3.endpoint | quote }}
{{- end }}
{{- if $v.s3.region }}
- name: AWS_REGION
  value: {{ $v.s3.region | quote }}
{{- end }}
{{- if .s3Secret }}
- name: AWS_SHARED_CREDENTIALS_FILE
  value: /etc/liverl/s3/credentials
{{- end }}
{{- range .files }}
{{- $kv := splitList "=" . }}
- name: {{ printf "LIVERL__%s" (index $kv 0 | upper | replace "." "__") }}
  value: {{ printf "/etc/liverl/keys/%s" (index $kv 1) | quote }}
{{- end }}
- name: LIVERL__SERVING__HOST
  value: "0.0.0.0"
- name: LIVERL__SERVING__FLEET
  value: {{ include "liverl.fleet" .root | quote }}
{{- if $v.product }}
- name: LIVERL__PRODUCT
  value: {{ $v.product | quote }}
{{- end }}
{{- if $v.model.path }}
- name: LIVERL__MODEL__PATH
  value: {{ $v.model.path | quote }}
{{- end }}
{{- range $section, $fields := $v.config }}
{{- range $field, $value := $fields }}
- name: {{ printf "LIVERL__%s__%s" $section $field | upper }}
  value: {{ ternary $value (toJson $value) (kindIs "string" $value) | quote }}
{{- end }}
{{- end }}
{{- with .extra }}
{{ toYaml . }}
{{- end }}
{{- with $v.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{/* The volume mounts every process has: its keys, and the broker's and S3's files when configured. */}}
{{- define "liverl.secretMounts" -}}
- name: keys
  mountPath: /etc/liverl/keys
  readOnly: true
{{- if .root.Values.kafka.saslConfigSecret }}
- name: broker-config
  mountPath: /etc/liverl/broker
  readOnly: true
{{- end }}
{{- if .root.Values.kafka.tlsSecret }}
- name: kafka-tls
  mountPath: /etc/liverl/kafka
  readOnly: true
{{- end }}
{{- if .s3Secret }}
- name: s3
  mountPath: /etc/liverl/s3
  readOnly: true
{{- end }}
{{- end -}}

{{/* The volumes behind them: (dict "root" $ "secret" SECRET-NAME "s3Secret" NAME-OR-EMPTY). */}}
{{- define "liverl.secretVolumes" -}}
- name: keys
  secret:
    secretName: {{ .secret }}
    defaultMode: 0440
    optional: false
{{- if .root.Values.kafka.saslConfigSecret }}
- name: broker-config
  secret:
    secretName: {{ .root.Values.kafka.saslConfigSecret }}
    defaultMode: 0440
    optional: false
{{- end }}
{{- if .root.Values.kafka.tlsSecret }}
- name: kafka-tls
  secret:
    secretName: {{ .root.Values.kafka.tlsSecret }}
    defaultMode: 0440
    optional: false
{{- end }}
{{- if .s3Secret }}
- name: s3
  secret:
    secretName: {{ .s3Secret }}
    defaultMode: 0440
    optional: false
{{- end }}
{{- end -}}

{{/* Prometheus's scrape annotations for a port. */}}
{{- define "liverl.scrape" -}}
{{- if .root.Values.metrics.annotations }}
prometheus.io/scrape: "true"
prometheus.io/port: {{ .port | quote }}
prometheus.io/path: /metrics
{{- end }}
{{- end -}}

{{/* What every pod shares: security context, scheduling, pull secrets. */}}
{{- define "liverl.podCommon" -}}
automountServiceAccountToken: false
enableServiceLinks: false
securityContext:
  {{- toYaml .root.Values.podSecurityContext | nindent 2 }}
{{- with .root.Values.imagePullSecrets }}
imagePullSecrets:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.nodeSelector }}
nodeSelector:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.tolerations }}
tolerations:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- with .role.affinity }}
affinity:
  {{- toYaml . | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The model volume's mount, for the processes that load the base model (serve, learn, gate). */}}
{{- define "liverl.modelMount" -}}
{{- if .Values.model.volume }}
- name: model
  mountPath: {{ .Values.model.mountPath }}
  readOnly: true
{{- end }}
{{- end -}}

{{- define "liverl.modelVolume" -}}
{{- if .Values.model.volume }}
- name: model
  {{- toYaml .Values.model.volume | nindent 2 }}
{{- end }}
{{- end -}}

{{/* The learner pod's ranks run: torchrun and each `liverl.cli learn` worker it started (LIVERL_LEARN_RANKS). */}}
{{- define "liverl.ranksProbe" -}}
import glob, os, sys
n = 0
for p in glob.glob('/proc/[0-9]*/cmdline'):
    try:
        n += b'liverl.cli\x00learn' in open(p, 'rb').read()
    except OSError:
        pass
sys.exit(0 if n >= 1 + int(os.environ['LIVERL_LEARN_RANKS']) else 1)
{{- end -}}

{{/* Ready: rank 0 serves its metrics at the pod's address (it holds the lease); the other pods once their ranks run. */}}
{{- define "liverl.rank0Probe" -}}
import os, sys, urllib.request
if os.environ['NODE_RANK'] == '0':
    urllib.request.urlopen('http://%s:{{ .Values.learn.metricsPort }}/readyz' % os.environ['POD_IP'], timeout=4)
{{ include "liverl.ranksProbe" . }}
{{- end -}}
