{{- define "sglang-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "sglang-gateway.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "sglang-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sglang-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "sglang-gateway.labels" -}}
{{ include "sglang-gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | quote }}
app.kubernetes.io/part-of: sglang-gateway
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "sglang-gateway.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "sglang-gateway.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* The gateway.yaml text: configFile verbatim, or the config values through tpl. */}}
{{- define "sglang-gateway.configText" -}}
{{- $etcd := .Values.stateStore.etcdEndpoints -}}
{{- if .Values.configFile -}}
{{- if $etcd -}}
{{- fail "stateStore.etcdEndpoints is merged into `config`: with configFile, write state: {backend: etcd, etcd: {endpoints: ...}} in the file itself" -}}
{{- end -}}
{{- .Values.configFile -}}
{{- else -}}
{{- $cfg := deepCopy .Values.config -}}
{{- if $etcd -}}
{{- $_ := set $cfg "state" (dict "backend" "etcd" "etcd" (dict "endpoints" $etcd "prefix" .Values.stateStore.prefix)) -}}
{{- end -}}
{{- tpl (toYaml $cfg) . }}{{ "\n" }}
{{- end -}}
{{- end -}}

{{/* The config as data, for the ports and timeouts the pod spec must agree with. */}}
{{- define "sglang-gateway.configData" -}}
{{- $cfg := include "sglang-gateway.configText" . | fromYaml -}}
{{- if hasKey $cfg "Error" -}}
{{- fail (printf "the gateway config is not valid YAML: %s" (get $cfg "Error")) -}}
{{- end -}}
{{- $admin := $cfg.admin | default dict -}}
{{- if not (has ($admin.host | default "127.0.0.1") (list "0.0.0.0" "::")) -}}
{{- fail "config admin.host must be 0.0.0.0 (or ::): kubelet probes and Prometheus reach the pod IP" -}}
{{- end -}}
{{- $backends := $cfg.backends | default dict -}}
{{- if and (eq ($backends.discovery | default "static") "kubernetes") (not .Values.serviceAccount.automountToken) -}}
{{- fail "backends.discovery: kubernetes needs serviceAccount.automountToken: true (and rbac.create: true)" -}}
{{- end -}}
{{- $replicas := ternary 2 (int .Values.replicaCount) .Values.autoscaling.enabled -}}
{{- if and (eq ($backends.discovery | default "static") "registry") (gt $replicas 1) (ne (dig "state" "backend" "local" $cfg) "etcd") -}}
{{- fail "backends.discovery: registry on more than one replica needs state.backend: etcd (stateStore.etcdEndpoints, or a state: section in configFile): each replica would keep a registry of its own" -}}
{{- end -}}
{{- toJson $cfg -}}
{{- end -}}

{{- define "sglang-gateway.httpPort" -}}
{{- $cfg := include "sglang-gateway.configData" . | fromJson -}}
{{- dig "listen" "port" 8080 $cfg | int -}}
{{- end -}}

{{- define "sglang-gateway.adminPort" -}}
{{- $cfg := include "sglang-gateway.configData" . | fromJson -}}
{{- dig "admin" "port" 8081 $cfg | int -}}
{{- end -}}

{{- define "sglang-gateway.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.terminationGracePeriodSeconds -}}
{{- $cfg := include "sglang-gateway.configData" . | fromJson -}}
{{- add (int .Values.preStopSleepSeconds) (dig "timeouts" "shutdown_grace_s" 30 $cfg | ceil | int) 5 -}}
{{- else -}}
{{- .Values.terminationGracePeriodSeconds | int -}}
{{- end -}}
{{- end -}}
