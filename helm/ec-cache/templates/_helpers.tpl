{{/* vim: set filetype=mustache: */}}

{{- define "ec-cache.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/*
Full name: release-chart, or the release name alone when it already contains the
chart name. Truncated to 54 characters so "<fullname>-headless" stays a valid name.
*/}}
{{- define "ec-cache.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 54 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 54 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{- define "ec-cache.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "ec-cache.selectorLabels" -}}
app.kubernetes.io/name: {{ include "ec-cache.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "ec-cache.labels" -}}
helm.sh/chart: {{ include "ec-cache.chart" . }}
{{ include "ec-cache.selectorLabels" . }}
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/component: cache
app.kubernetes.io/part-of: ec-cache
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "ec-cache.headlessName" -}}
{{- printf "%s-headless" (include "ec-cache.fullname" .) -}}
{{- end -}}

{{- define "ec-cache.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "ec-cache.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "ec-cache.image" -}}
{{- $tag := .Values.image.tag | default .Chart.AppVersion | toString -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository $tag -}}
{{- end -}}
{{- end -}}

{{/* True ("true") when the chart creates the S3 credentials Secret. */}}
{{- define "ec-cache.createSecret" -}}
{{- $c := .Values.s3Credentials -}}
{{- if and (not $c.existingSecret) (or $c.accessKeyId $c.secretAccessKey) -}}true{{- end -}}
{{- end -}}

{{/* Name of the Secret holding the S3 credentials, or "" when none is used. */}}
{{- define "ec-cache.secretName" -}}
{{- if .Values.s3Credentials.existingSecret -}}
{{- .Values.s3Credentials.existingSecret -}}
{{- else if include "ec-cache.createSecret" . -}}
{{- printf "%s-s3" (include "ec-cache.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/*
The server's non-secret environment, EC_* name -> string value. The ConfigMap is
rendered from this one dict, so the checksum annotation changes whenever any of
these values change.
*/}}
{{- define "ec-cache.configEnv" -}}
{{- $c := .Values.config -}}
EC_HOST: {{ $c.host | toString | quote }}
EC_PORT: {{ $c.port | int | toString | quote }}
EC_DATA_DIR: {{ $c.dataDir | toString | quote }}
EC_DISK_MAX_BYTES: {{ include "ec-cache.sizeString" $c.diskMaxBytes | quote }}
EC_MAX_BODY_BYTES: {{ include "ec-cache.sizeString" $c.maxBodyBytes | quote }}
EC_WRITE_MODE: {{ $c.writeMode | toString | quote }}
EC_LOG_LEVEL: {{ $c.logLevel | toString | quote }}
EC_S3_ENDPOINT_URL: {{ $c.s3.endpointUrl | toString | quote }}
EC_S3_BUCKET: {{ $c.s3.bucket | toString | quote }}
EC_S3_PREFIX: {{ $c.s3.prefix | toString | quote }}
EC_S3_REGION: {{ $c.s3.region | toString | quote }}
EC_S3_CREATE_BUCKET: {{ ternary "true" "false" (eq (toString $c.s3.createBucket) "true") | quote }}
{{- $optional := list
  (list "EC_LOG_FORMAT" $c.logFormat "")
  (list "EC_S3_CONNECT_TIMEOUT" $c.s3.connectTimeout "")
  (list "EC_S3_READ_TIMEOUT" $c.s3.readTimeout "")
  (list "EC_S3_MAX_ATTEMPTS" $c.s3.maxAttempts "")
  (list "EC_S3_MAX_POOL_CONNECTIONS" $c.s3.maxPoolConnections "")
  (list "EC_S3_MULTIPART_THRESHOLD" $c.s3.multipartThreshold "size")
  (list "EC_S3_MULTIPART_PART_SIZE" $c.s3.multipartPartSize "size")
  (list "EC_S3_MULTIPART_CONCURRENCY" $c.s3.multipartConcurrency "")
  (list "EC_S3_GET_CHUNK_SIZE" $c.s3.getChunkSize "size")
  (list "EC_S3_GET_PART_SIZE" $c.s3.getPartSize "size")
  (list "EC_S3_GET_CONCURRENCY" $c.s3.getConcurrency "")
  (list "EC_S3_GET_BUFFER_BYTES" $c.s3.getBufferBytes "size")
  (list "EC_S3_UNAVAILABLE_COOLDOWN" $c.s3.unavailableCooldown "")
  (list "EC_S3_VERIFY_TLS" $c.s3.verifyTls "")
  (list "EC_WRITEBACK_QUEUE_MAX_ENTRIES" $c.writeback.queueMaxEntries "")
  (list "EC_WRITEBACK_QUEUE_MAX_BYTES" $c.writeback.queueMaxBytes "size")
  (list "EC_WRITEBACK_WORKERS" $c.writeback.workers "")
  (list "EC_WRITEBACK_RETRY_MIN" $c.writeback.retryMin "")
  (list "EC_WRITEBACK_RETRY_MAX" $c.writeback.retryMax "")
  (list "EC_WRITEBACK_DRAIN_TIMEOUT" $c.writeback.drainTimeout "")
  (list "EC_ANONYMOUS" $c.anonymous "")
  (list "EC_METRICS_PUBLIC" $c.metricsPublic "")
  (list "EC_METRICS_NAMESPACES" $c.metricsNamespaces "")
  (list "EC_MAX_CONCURRENT_UPLOADS" $c.maxConcurrentUploads "")
  (list "EC_MAX_CONCURRENT_DOWNLOADS" $c.maxConcurrentDownloads "")
  (list "EC_BODY_READ_TIMEOUT" $c.bodyReadTimeout "")
  (list "EC_UPLOAD_MIN_RATE" $c.uploadMinRate "size")
  (list "EC_UPLOAD_RATE_GRACE" $c.uploadRateGrace "")
  (list "EC_UPLOAD_TIMEOUT" $c.uploadTimeout "")
  (list "EC_DISK_COMMIT_DELAY" $c.diskCommitDelay "")
  (list "EC_MAX_HEADER_BYTES" $c.maxHeaderBytes "size")
  (list "EC_MAX_CONNECTIONS" $c.maxConnections "")
  (list "EC_KEEPALIVE_TIMEOUT" $c.keepaliveTimeout "")
  (list "EC_HEADER_TIMEOUT" $c.headerTimeout "")
  (list "EC_SEND_TIMEOUT" $c.sendTimeout "")
  (list "EC_CLAIM_MAX_LEASE" $c.claimMaxLease "")
  (list "EC_CLAIM_MAX_KEYS" $c.claimMaxKeys "")
  (list "EC_CLAIM_MAX_WAITERS" $c.claimMaxWaiters "")
  (list "EC_CLAIM_MAX_WAIT" $c.claimMaxWait "")
  (list "EC_SHUTDOWN_TIMEOUT" $c.shutdownTimeout "")
}}
{{- range $optional }}
{{- $value := index . 1 }}
{{- if not (kindIs "invalid" $value) }}
{{ index . 0 }}: {{ ternary (include "ec-cache.sizeString" $value) (include "ec-cache.scalar" $value) (eq (index . 2) "size") | quote }}
{{- end }}
{{- end }}
{{- if .Values.auth.tokensFile.existingSecret }}
EC_AUTH_TOKENS_FILE: {{ printf "%s/%s" (trimSuffix "/" .Values.auth.tokensFile.mountPath) .Values.auth.tokensFile.key | quote }}
{{- end }}
{{- end -}}

{{/* True ("true") when the chart creates the auth tokens Secret. */}}
{{- define "ec-cache.createAuthSecret" -}}
{{- if and (not .Values.auth.tokens.existingSecret) .Values.auth.tokens.value -}}true{{- end -}}
{{- end -}}

{{/* Name of the Secret holding EC_AUTH_TOKENS, or "". */}}
{{- define "ec-cache.authSecretName" -}}
{{- if .Values.auth.tokens.existingSecret -}}
{{- .Values.auth.tokens.existingSecret -}}
{{- else if include "ec-cache.createAuthSecret" . -}}
{{- printf "%s-auth" (include "ec-cache.fullname" .) -}}
{{- end -}}
{{- end -}}

{{/* A size value as text: integers stay integers (YAML numbers arrive as floats). */}}
{{- define "ec-cache.sizeString" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- printf "%d" (int64 .) -}}
{{- else -}}
{{- . | toString | trim -}}
{{- end -}}
{{- end -}}

{{/* A scalar as the server reads it: whole floats without an exponent (1e+07 -> 10000000). */}}
{{- define "ec-cache.scalar" -}}
{{- if and (kindIs "float64" .) (eq (float64 .) (float64 (int64 .))) -}}
{{- printf "%d" (int64 .) -}}
{{- else -}}
{{- toString . -}}
{{- end -}}
{{- end -}}

{{/*
Parse a size into bytes. dict "value" V "server" true: the server's rules (plain
bytes or K/M/G/T with optional i and B, case-insensitive, all binary). "server"
false: a Kubernetes quantity (Ki/Mi/Gi/Ti binary, k/M/G/T decimal, plain bytes).
Renders "" when the text is not such a size.
*/}}
{{- define "ec-cache.bytes" -}}
{{- $s := include "ec-cache.sizeString" .value -}}
{{- $re := "^([0-9]+)\\s*([A-Za-z]*)$" -}}
{{- if regexMatch $re $s -}}
{{- $num := regexReplaceAll $re $s "${1}" | int64 -}}
{{- $unit := regexReplaceAll $re $s "${2}" -}}
{{- if .server -}}
{{- $server := dict "" 1 "B" 1 "K" 1024 "M" 1048576 "G" 1073741824 "T" 1099511627776 -}}
{{- if regexMatch "^(?i)([KMGT]I?B?|B)?$" $unit -}}
{{- mul $num (get $server (upper (substr 0 1 $unit))) -}}
{{- end -}}
{{- else -}}
{{- $k8s := dict "" 1 "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 -}}
{{- if hasKey $k8s $unit -}}
{{- mul $num (get $k8s $unit) -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Checks that values.schema.json cannot express. Renders nothing. */}}
{{- define "ec-cache.validate" -}}
{{- $v := .Values -}}
{{- if and $v.persistence.enabled (ne $v.workload.kind "StatefulSet") -}}
{{- fail "persistence.enabled needs workload.kind=StatefulSet (one PersistentVolumeClaim per pod); use emptyDir with a Deployment" -}}
{{- end -}}
{{- if and $v.config.s3.endpointUrl (not $v.config.s3.bucket) -}}
{{- fail "config.s3.endpointUrl is set but config.s3.bucket is empty (EC_S3_BUCKET)" -}}
{{- end -}}
{{- $c := $v.s3Credentials -}}
{{- if and (not $c.existingSecret) (or $c.accessKeyId $c.secretAccessKey) (not (and $c.accessKeyId $c.secretAccessKey)) -}}
{{- fail "s3Credentials: set both accessKeyId and secretAccessKey, or use existingSecret" -}}
{{- end -}}
{{- if and $v.autoscaling.enabled (lt (int $v.autoscaling.maxReplicas) (int $v.autoscaling.minReplicas)) -}}
{{- fail "autoscaling.maxReplicas must be >= autoscaling.minReplicas" -}}
{{- end -}}
{{- if and $v.autoscaling.enabled (not $v.autoscaling.targetCPUUtilizationPercentage) (not $v.autoscaling.targetMemoryUtilizationPercentage) -}}
{{- fail "autoscaling: set targetCPUUtilizationPercentage and/or targetMemoryUtilizationPercentage" -}}
{{- end -}}
{{- $hasTokens := or $v.auth.tokens.existingSecret $v.auth.tokens.value $v.auth.tokensFile.existingSecret -}}
{{- if and (not $hasTokens) (or (kindIs "invalid" $v.config.anonymous) (eq (toString $v.config.anonymous) "none")) -}}
{{- fail "no auth tokens (auth.tokens / auth.tokensFile) and no anonymous access (config.anonymous): the server refuses to start like that on a pod's listener. Configure tokens, or set config.anonymous to read, read-write or admin" -}}
{{- end -}}
{{- $shutdown := $v.config.shutdownTimeout | default 30 | float64 -}}
{{- $drain := $v.config.writeback.drainTimeout | default 10 | float64 -}}
{{- $grace := addf (float64 $v.preStopSleepSeconds) $shutdown $drain -}}
{{- if lt (float64 $v.terminationGracePeriodSeconds) $grace -}}
{{- fail (printf "terminationGracePeriodSeconds (%v) must be >= preStopSleepSeconds + config.shutdownTimeout + config.writeback.drainTimeout = %v + %v + %v = %v: the kubelet would kill in-flight requests" $v.terminationGracePeriodSeconds $v.preStopSleepSeconds $shutdown $drain $grace) -}}
{{- end -}}
{{- $disk := include "ec-cache.bytes" (dict "value" $v.config.diskMaxBytes "server" true) -}}
{{- if not $disk -}}
{{- fail (printf "config.diskMaxBytes %q is not a size (bytes or KiB/MiB/GiB/TiB)" (include "ec-cache.sizeString" $v.config.diskMaxBytes)) -}}
{{- end -}}
{{- if not (include "ec-cache.bytes" (dict "value" $v.config.maxBodyBytes "server" true)) -}}
{{- fail (printf "config.maxBodyBytes %q is not a size (bytes or KiB/MiB/GiB/TiB)" (include "ec-cache.sizeString" $v.config.maxBodyBytes)) -}}
{{- end -}}
{{- $volume := "" -}}
{{- $volumeKey := "" -}}
{{- if $v.persistence.enabled -}}
{{- $volume = include "ec-cache.bytes" (dict "value" $v.persistence.size "server" false) -}}
{{- $volumeKey = "persistence.size" -}}
{{- else if and $v.emptyDir.sizeLimit (ne $v.emptyDir.medium "Memory") -}}
{{- $volume = include "ec-cache.bytes" (dict "value" $v.emptyDir.sizeLimit "server" false) -}}
{{- $volumeKey = "emptyDir.sizeLimit" -}}
{{- end -}}
{{- if and $volume (gt (int64 $disk) (int64 $volume)) -}}
{{- fail (printf "config.diskMaxBytes (%s) is larger than %s (%s): the disk tier would overflow its volume" (include "ec-cache.sizeString" $v.config.diskMaxBytes) $volumeKey (include "ec-cache.sizeString" (ternary $v.persistence.size $v.emptyDir.sizeLimit $v.persistence.enabled))) -}}
{{- end -}}
{{- end -}}

{{/* Container port and probe port. */}}
{{- define "ec-cache.probe" -}}
{{- $defaults := dict "httpGet" (dict "path" .path "port" "http" "scheme" "HTTP") -}}
{{- $p := omit .probe "enabled" -}}
{{- toYaml (merge $p $defaults) -}}
{{- end -}}

{{/* The pod template shared by the StatefulSet and the Deployment. */}}
{{- define "ec-cache.podTemplate" -}}
{{- $v := .Values -}}
{{- $secretName := include "ec-cache.secretName" . -}}
metadata:
  labels:
    {{- include "ec-cache.labels" . | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    checksum/config: {{ include (print $.Template.BasePath "/configmap.yaml") . | sha256sum }}
    {{- if or (include "ec-cache.createSecret" .) (include "ec-cache.createAuthSecret" .) }}
    checksum/secret: {{ include (print $.Template.BasePath "/secret.yaml") . | sha256sum }}
    {{- end }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "ec-cache.serviceAccountName" . }}
  automountServiceAccountToken: {{ $v.serviceAccount.automountServiceAccountToken }}
  enableServiceLinks: false
  {{- with $v.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  securityContext:
    {{- toYaml $v.podSecurityContext | nindent 4 }}
  terminationGracePeriodSeconds: {{ $v.terminationGracePeriodSeconds }}
  containers:
    - name: ec-cache
      image: {{ include "ec-cache.image" . | quote }}
      imagePullPolicy: {{ $v.image.pullPolicy }}
      securityContext:
        {{- toYaml $v.securityContext | nindent 8 }}
      ports:
        - name: http
          containerPort: {{ $v.config.port }}
          protocol: TCP
      envFrom:
        - configMapRef:
            name: {{ include "ec-cache.fullname" . }}
        {{- with $v.extraEnvFrom }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- $authSecret := include "ec-cache.authSecretName" . }}
      {{- if or $secretName $authSecret $v.extraEnv }}
      env:
        {{- if $secretName }}
        - name: AWS_ACCESS_KEY_ID
          valueFrom:
            secretKeyRef:
              name: {{ $secretName }}
              key: {{ $v.s3Credentials.accessKeyIdKey }}
        - name: AWS_SECRET_ACCESS_KEY
          valueFrom:
            secretKeyRef:
              name: {{ $secretName }}
              key: {{ $v.s3Credentials.secretAccessKeyKey }}
        {{- end }}
        {{- if $authSecret }}
        - name: EC_AUTH_TOKENS
          valueFrom:
            secretKeyRef:
              name: {{ $authSecret }}
              key: {{ $v.auth.tokens.key }}
        {{- end }}
        {{- with $v.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- end }}
      {{- if $v.probes.startup.enabled }}
      startupProbe:
        {{- include "ec-cache.probe" (dict "probe" $v.probes.startup "path" "/healthz") | nindent 8 }}
      {{- end }}
      {{- if $v.probes.liveness.enabled }}
      livenessProbe:
        {{- include "ec-cache.probe" (dict "probe" $v.probes.liveness "path" "/healthz") | nindent 8 }}
      {{- end }}
      {{- if $v.probes.readiness.enabled }}
      readinessProbe:
        {{- include "ec-cache.probe" (dict "probe" $v.probes.readiness "path" "/readyz") | nindent 8 }}
      {{- end }}
      {{- if gt (int $v.preStopSleepSeconds) 0 }}
      lifecycle:
        preStop:
          exec:
            command: ["sleep", {{ $v.preStopSleepSeconds | int | toString | quote }}]
      {{- end }}
      resources:
        {{- toYaml $v.resources | nindent 8 }}
      volumeMounts:
        - name: data
          mountPath: {{ $v.config.dataDir }}
        - name: tmp
          mountPath: /tmp
        {{- if $v.auth.tokensFile.existingSecret }}
        - name: auth-tokens
          mountPath: {{ $v.auth.tokensFile.mountPath }}
          readOnly: true
        {{- end }}
        {{- with $v.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    {{- if not $v.persistence.enabled }}
    - name: data
      emptyDir:
        {{- with $v.emptyDir.medium }}
        medium: {{ . }}
        {{- end }}
        {{- with $v.emptyDir.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- end }}
    - name: tmp
      emptyDir:
        {{- with $v.tmp.sizeLimit }}
        sizeLimit: {{ . }}
        {{- end }}
    {{- with $v.auth.tokensFile.existingSecret }}
    - name: auth-tokens
      secret:
        secretName: {{ . }}
        defaultMode: 0440
        items:
          - key: {{ $v.auth.tokensFile.key }}
            path: {{ $v.auth.tokensFile.key }}
    {{- end }}
    {{- with $v.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- if or $v.topologySpread.enabled $v.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- if $v.topologySpread.enabled }}
    - maxSkew: {{ $v.topologySpread.maxSkew }}
      topologyKey: {{ $v.topologySpread.topologyKey }}
      whenUnsatisfiable: {{ $v.topologySpread.whenUnsatisfiable }}
      labelSelector:
        matchLabels:
          {{- include "ec-cache.selectorLabels" . | nindent 10 }}
    {{- end }}
    {{- with $v.topologySpreadConstraints }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- end }}
  {{- with $v.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
{{- end -}}
