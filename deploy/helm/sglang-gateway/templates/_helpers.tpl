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

{{/* Where stateStore.tls's and stateStore.auth's Secrets are mounted (outside the
ConfigMap's read-only mount, which a mount point cannot be made in). */}}
{{- define "sglang-gateway.etcdTlsDir" -}}/etc/sglang-gateway-etcd/tls{{- end -}}
{{- define "sglang-gateway.etcdAuthDir" -}}/etc/sglang-gateway-etcd/auth{{- end -}}

{{/* The state.etcd keys stateStore.tls and stateStore.auth stand for (JSON): the mounted
files' paths and the username, never what the Secrets hold. Fails on a combination the
gateway would refuse. */}}
{{- define "sglang-gateway.etcdCredentials" -}}
{{- $out := dict -}}
{{- $tls := .Values.stateStore.tls | default dict -}}
{{- if $tls.secretName -}}
{{- if and $tls.certKey (not $tls.keyKey) -}}
{{- fail "stateStore.tls.certKey without stateStore.tls.keyKey: a client certificate needs its key (set both, or both to '' for the CA alone)" -}}
{{- end -}}
{{- if and $tls.keyKey (not $tls.certKey) -}}
{{- fail "stateStore.tls.keyKey without stateStore.tls.certKey: a key needs its client certificate (set both, or both to '' for the CA alone)" -}}
{{- end -}}
{{- if not (or $tls.caKey $tls.certKey) -}}
{{- fail "stateStore.tls.secretName is set but caKey, certKey and keyKey are all empty: nothing to mount" -}}
{{- end -}}
{{- range .Values.stateStore.etcdEndpoints -}}
{{- if hasPrefix "http://" . -}}
{{- fail (printf "stateStore.tls needs https:// etcd endpoints, not %s" .) -}}
{{- end -}}
{{- end -}}
{{- $dir := include "sglang-gateway.etcdTlsDir" . -}}
{{- if $tls.caKey -}}
{{- $_ := set $out "ca_file" (printf "%s/ca.crt" $dir) -}}
{{- end -}}
{{- if $tls.certKey -}}
{{- $_ := set $out "cert_file" (printf "%s/tls.crt" $dir) -}}
{{- $_ := set $out "key_file" (printf "%s/tls.key" $dir) -}}
{{- end -}}
{{- end -}}
{{- $auth := .Values.stateStore.auth | default dict -}}
{{- $password := $auth.passwordSecret | default dict -}}
{{- if and $password.name (not $auth.username) -}}
{{- fail "stateStore.auth.passwordSecret without stateStore.auth.username: etcd checks a password for a user name" -}}
{{- end -}}
{{- if $auth.username -}}
{{- if not (and $password.name $password.key) -}}
{{- fail "stateStore.auth.username needs stateStore.auth.passwordSecret.name and .key: the password comes from a mounted Secret, never the ConfigMap" -}}
{{- end -}}
{{- $_ := set $out "username" $auth.username -}}
{{- $_ := set $out "password_file" (printf "%s/password" (include "sglang-gateway.etcdAuthDir" .)) -}}
{{- end -}}
{{- if and $out (not .Values.stateStore.etcdEndpoints) (not .Values.configFile) -}}
{{- fail "stateStore.tls and stateStore.auth are etcd's credentials: set stateStore.etcdEndpoints too (or a configFile with a state: section)" -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The gateway.yaml text: configFile verbatim, or the config values through tpl. */}}
{{- define "sglang-gateway.configText" -}}
{{- $etcd := .Values.stateStore.etcdEndpoints -}}
{{- $credentials := include "sglang-gateway.etcdCredentials" . | fromJson -}}
{{- if .Values.configFile -}}
{{- if $etcd -}}
{{- fail "stateStore.etcdEndpoints is merged into `config`: with configFile, write state: {backend: etcd, etcd: {endpoints: ...}} in the file itself" -}}
{{- end -}}
{{- .Values.configFile -}}
{{- else -}}
{{- $cfg := deepCopy .Values.config -}}
{{- if $etcd -}}
{{- $state := dict "endpoints" $etcd "prefix" .Values.stateStore.prefix -}}
{{- $_ := set $cfg "state" (dict "backend" "etcd" "etcd" (merge $state $credentials)) -}}
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
{{- if .Values.configFile -}}
{{- range $key, $value := include "sglang-gateway.etcdCredentials" . | fromJson -}}
{{- if ne (dig "state" "etcd" $key "" $cfg | toString) $value -}}
{{- fail (printf "stateStore.tls/auth mount the etcd credentials, but configFile's state.etcd.%s is not %s: write `%s: %s` there" $key $value $key $value) -}}
{{- end -}}
{{- end -}}
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
