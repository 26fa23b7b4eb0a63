{{/* Names, labels and the pieces every workload shares. */}}

{{- define "adaflash.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "adaflash.fullname" -}}
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

{{/* "<fullname>-<component>" ; call with (dict "root" $ "component" "dataplane") */}}
{{- define "adaflash.componentName" -}}
{{- printf "%s-%s" (include "adaflash.fullname" .root | trunc 50 | trimSuffix "-") .component -}}
{{- end -}}

{{- define "adaflash.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "adaflash.selectorLabels" -}}
app.kubernetes.io/name: {{ include "adaflash.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "adaflash.labels" -}}
helm.sh/chart: {{ include "adaflash.chart" .root }}
{{ include "adaflash.selectorLabels" . }}
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
app.kubernetes.io/part-of: adaflash
{{- end -}}

{{/* ServiceAccount of a component */}}
{{- define "adaflash.serviceAccountName" -}}
{{- if .root.Values.serviceAccount.create -}}
{{- include "adaflash.componentName" . -}}
{{- else -}}
{{- default "default" .root.Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{/* image: call with (dict "root" $ "override" .Values.dataplane.image) */}}
{{- define "adaflash.image" -}}
{{- $o := .override | default dict -}}
{{- $repo := $o.repository | default .root.Values.image.repository -}}
{{- $tag := $o.tag | default .root.Values.image.tag | default .root.Chart.AppVersion -}}
image: {{ printf "%s:%s" $repo $tag | quote }}
imagePullPolicy: {{ $o.pullPolicy | default .root.Values.image.pullPolicy }}
{{- end -}}

{{- define "adaflash.controlplaneUrl" -}}
{{- printf "http://%s:%v" (include "adaflash.componentName" (dict "root" . "component" "controlplane")) .Values.controlplane.service.port -}}
{{- end -}}

{{/* true when the control plane has a database outside its pod */}}
{{- define "adaflash.externalDatabase" -}}
{{- if or .Values.secrets.databaseUrl.name (and .Values.postgresql.host .Values.secrets.postgresPassword.name) -}}true{{- end -}}
{{- end -}}

{{/* The adaflash YAML configuration rendered into the ConfigMap. */}}
{{- define "adaflash.config" -}}
{{- $v := .Values -}}
{{- $dp := dict "host" "0.0.0.0" "port" (int $v.dataplane.port) "mode" $v.dataplane.mode "admin_token_env" "ADAFLASH_ADMIN_TOKEN" "controlplane_url" (include "adaflash.controlplaneUrl" .) -}}
{{- if $v.dataplane.drafter }}{{- $_ := set $dp "drafter" $v.dataplane.drafter -}}{{- end -}}
{{- if $v.dataplane.adminPort }}{{- $_ := set $dp "admin_port" (int $v.dataplane.adminPort) -}}{{- end -}}
{{- $model := dict "target_id" $v.model.targetId "device" $v.model.device "dtype" $v.model.dtype -}}
{{- if $v.model.path }}{{- $_ := set $model "path" $v.model.path -}}{{- end -}}
{{- $cfg := dict
    "model" $model
    "dataplane" $dp
    "kafka" (dict "bootstrap" $v.kafka.bootstrap "partitions" (int $v.kafka.partitions) "consumer_group" $v.kafka.consumerGroup)
    "controlplane" (dict "host" "0.0.0.0" "port" (int $v.controlplane.port) "mlflow_tracking_uri" $v.mlflow.trackingUri)
    "telemetry" (dict "exporter" $v.telemetry.exporter "otlp_endpoint" $v.telemetry.otlpEndpoint "sample_ratio" $v.telemetry.sampleRatio "metrics_interval_s" $v.telemetry.metricsIntervalSeconds)
-}}
{{- $merged := mustMergeOverwrite $cfg (deepCopy ($v.config | default dict)) -}}
{{- toYaml $merged -}}
{{- end -}}

{{/* Environment shared by every AdaFlash container. Call with (dict "root" $ "service" "adaflash-dataplane") */}}
{{- define "adaflash.env" -}}
{{- $v := .root.Values -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: POD_IP
  valueFrom:
    fieldRef:
      fieldPath: status.podIP
- name: ADAFLASH_HOME
  value: /var/lib/adaflash
- name: ADAFLASH_CACHE
  value: /var/cache/adaflash
- name: HOME
  value: /var/lib/adaflash
- name: TMPDIR
  value: /tmp
- name: MLFLOW_DISABLE_TELEMETRY
  value: "true"
- name: TLDEXTRACT_PUBLIC_SUFFIX_LIST_URLS
  value: ""
- name: OTEL_SERVICE_NAME
  value: {{ .service | quote }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: "k8s.namespace.name=$(POD_NAMESPACE),k8s.pod.name=$(POD_NAME)"
{{- if $v.telemetry.otlpEndpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $v.telemetry.otlpEndpoint | quote }}
{{- end }}
{{- with $v.secrets.adminToken }}{{ if .name }}
- name: ADAFLASH_ADMIN_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with $v.secrets.mlflowCredentials }}{{ if .name }}
- name: MLFLOW_TRACKING_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .usernameKey }}
- name: MLFLOW_TRACKING_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .passwordKey }}
{{- end }}{{ end }}
{{- end -}}

{{/* Database and JWT settings of the control plane, its migration Job and reaper. */}}
{{- define "adaflash.controlplaneEnv" -}}
{{- $v := .Values -}}
- name: ADAFLASH_CONTROLPLANE__MLFLOW_TRACKING_URI
  value: {{ $v.mlflow.trackingUri | quote }}
{{- if $v.secrets.databaseUrl.name }}
- name: ADAFLASH_CONTROLPLANE__DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.databaseUrl.name }}
      key: {{ $v.secrets.databaseUrl.key }}
{{- else if and $v.postgresql.host $v.secrets.postgresPassword.name }}
- name: ADAFLASH_PG_PASSWORD
  valueFrom:
    secretKeyRef:
      name: {{ $v.secrets.postgresPassword.name }}
      key: {{ $v.secrets.postgresPassword.key }}
- name: ADAFLASH_CONTROLPLANE__DATABASE_URL
  value: {{ printf "postgresql+psycopg://%s:$(ADAFLASH_PG_PASSWORD)@%s:%v/%s?sslmode=%s" $v.postgresql.user $v.postgresql.host $v.postgresql.port $v.postgresql.database $v.postgresql.sslMode | quote }}
{{- end }}
{{- with $v.secrets.jwtSecret }}{{ if .name }}
- name: ADAFLASH_JWT_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- with $v.secrets.consoleSecret }}{{ if .name }}
- name: ADAFLASH_CONSOLE_SECRET
  valueFrom:
    secretKeyRef:
      name: {{ .name }}
      key: {{ .key }}
{{- end }}{{ end }}
{{- end -}}

{{- define "adaflash.envFrom" -}}
{{- if .Values.secrets.extraEnvFromSecret }}
envFrom:
  - secretRef:
      name: {{ .Values.secrets.extraEnvFromSecret }}
{{- end }}
{{- end -}}

{{/* GPU limits merged into a component's resources. Call with (dict "resources" .resources "gpu" .gpu) */}}
{{- define "adaflash.resources" -}}
{{- $res := deepCopy (.resources | default dict) -}}
{{- if .gpu.enabled -}}
{{- $limits := $res.limits | default dict -}}
{{- $_ := set $limits .gpu.resourceName (int .gpu.count) -}}
{{- $_ := set $res "limits" $limits -}}
{{- end -}}
{{- toYaml $res -}}
{{- end -}}

{{/* Scheduling fields of a component's pod spec */}}
{{- define "adaflash.scheduling" -}}
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
{{- end -}}

{{/* A NetworkPolicy peer (a one-item list) from {namespaceSelector, podSelector} */}}
{{- define "adaflash.peer" -}}
{{- $p := dict -}}
{{- if hasKey . "namespaceSelector" -}}{{- $_ := set $p "namespaceSelector" (.namespaceSelector | default dict) -}}{{- end -}}
{{- if hasKey . "podSelector" -}}{{- $_ := set $p "podSelector" (.podSelector | default dict) -}}{{- end -}}
{{- toYaml (list $p) -}}
{{- end -}}
