{{/*
Names and labels, after the prometheus node-exporter chart.
*/}}

{{/* The chart name, or nameOverride. */}}
{{- define "elasticpp.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: release-chart, or fullnameOverride. Pod names add "-N" to it and pod names
are the agents' node ids, so it is kept to 52 characters.
*/}}
{{- define "elasticpp.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* chart-version, for the helm.sh/chart label. */}}
{{- define "elasticpp.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every object carries. */}}
{{- define "elasticpp.labels" -}}
helm.sh/chart: {{ include "elasticpp.chart" . }}
{{ include "elasticpp.selectorLabels" . }}
app.kubernetes.io/component: agent
app.kubernetes.io/part-of: elasticpp
app.kubernetes.io/version: {{ .Values.image.tag | default .Chart.AppVersion | trunc 63 | trimSuffix "-" | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Labels that select the agents' pods; never change them on upgrade. */}}
{{- define "elasticpp.selectorLabels" -}}
app.kubernetes.io/name: {{ include "elasticpp.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/* The ServiceAccount the pods run as. */}}
{{- define "elasticpp.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "elasticpp.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The container image reference. */}}
{{- define "elasticpp.image" -}}
{{- printf "%s:%s" .Values.image.repository (.Values.image.tag | default .Chart.AppVersion) }}
{{- end }}

{{/* The etcd endpoints as the agent's --etcd value. */}}
{{- define "elasticpp.etcdEndpoints" -}}
{{- join "," .Values.etcd.endpoints }}
{{- end }}

{{/*
What every etcd client of the release is given (the agents, the teardown hook): the
endpoints, the key prefix, and the TLS and auth files of the etcd-tls and etcd-auth volumes.
*/}}
{{- define "elasticpp.etcdArgs" -}}
- --etcd={{ include "elasticpp.etcdEndpoints" . }}
- --etcd-prefix={{ .Values.etcd.prefix | default (printf "/elasticpp/%s" .Release.Namespace) }}
{{- if .Values.etcd.tls.existingSecret }}
- --etcd-ca=/etc/elasticpp-etcd/tls/ca.crt
{{- if .Values.etcd.tls.clientCertificate }}
- --etcd-cert=/etc/elasticpp-etcd/tls/tls.crt
- --etcd-key=/etc/elasticpp-etcd/tls/tls.key
{{- end }}
{{- end }}
{{- if .Values.etcd.auth.user }}
- --etcd-user={{ .Values.etcd.auth.user }}
- --etcd-password-file=/etc/elasticpp-etcd/auth/password
{{- end }}
{{- end }}

{{/* terminationGracePeriodSeconds: long enough for a drain to finish. */}}
{{- define "elasticpp.gracePeriodSeconds" -}}
{{- add (int .Values.drain.waitSeconds) (int .Values.drain.graceMarginSeconds) }}
{{- end }}

{{/*
Seconds from SIGTERM to the agent's exit at most: its stop's deadline (the job spec's
stop_timeout_s, 30 unless set: elasticpp.agent.jobspec), then the SIGKILL of its process
tree and the wait for it (AGENT_STOP_KILL_WAIT_S, 3: elasticpp.agent.limits).
*/}}
{{- define "elasticpp.stopSeconds" -}}
{{- add (int (ceil (get .Values.jobSpec "stop_timeout_s" | default 30))) 3 }}
{{- end }}

{{/*
The indexed Job's exit codes (podFailurePolicy), the agent's own (elasticpp.agent.quarantine,
elasticpp.agent.view): 3 the job failed and 4 it halted end the Job; 75 (the job's epoch
ended in etcd: start again) and the code an agent leaving an unfinished job exits with
(drained, or stopped: 128 + SIGTERM) get a replacement pod without counting a failure.
*/}}
{{- define "elasticpp.failJobExitCodes" -}}
[3, 4]
{{- end }}
{{- define "elasticpp.unfinishedExitCode" -}}
143
{{- end }}
{{- define "elasticpp.replaceExitCodes" -}}
[75, {{ include "elasticpp.unfinishedExitCode" . }}]
{{- end }}

{{/*
Refuse values that cannot work, with a message naming the values. Called by every template
that depends on them, so `helm template` and `helm install` fail before anything is created.
*/}}
{{- define "elasticpp.validate" -}}
{{- $spec := .Values.jobSpec }}
{{- if not .Values.etcd.endpoints }}
{{- fail "etcd.endpoints is required: list the etcd cluster's HOST:PORT entries (e.g. --set 'etcd.endpoints={etcd-0.etcd:2379,etcd-1.etcd:2379}')" }}
{{- end }}
{{- $tls := .Values.etcd.tls.existingSecret }}
{{- range .Values.etcd.endpoints }}
{{- if not (regexMatch "^(https://)?[^:/,\\s]+:[0-9]{1,5}$" .) }}
{{- fail (printf "etcd.endpoints: %q is not HOST:PORT or https://HOST:PORT" .) }}
{{- end }}
{{- if and (hasPrefix "https://" .) (not $tls) }}
{{- fail (printf "etcd.endpoints: %q is https but etcd.tls.existingSecret (the CA) is not set" .) }}
{{- end }}
{{- if and $tls (not (hasPrefix "https://" .)) }}
{{- fail (printf "etcd.endpoints: %q must be https://HOST:PORT when etcd.tls is set" .) }}
{{- end }}
{{- end }}
{{- if ne (empty .Values.etcd.auth.user) (empty .Values.etcd.auth.existingSecret) }}
{{- fail "etcd.auth: give both user and existingSecret (the Secret with its password)" }}
{{- end }}
{{- if and .Values.etcd.auth.user (not $tls) }}
{{- fail "etcd.auth needs etcd.tls: a password is sent to etcd only over TLS" }}
{{- end }}
{{- $loggedIn := or .Values.etcd.auth.user (and $tls .Values.etcd.tls.clientCertificate) }}
{{- if and (not $loggedIn) (not .Values.agent.insecure) }}
{{- fail "etcd: the agents would reach etcd anonymously, and whoever can write to it can stop or misdirect the job: give etcd.tls with a client certificate or etcd.auth (docs/deploy.md, Securing a job), or set agent.insecure for an etcd on a network you trust" }}
{{- end }}
{{- $mode := .Values.tls.mode }}
{{- if and (eq $mode "certManager") (not .Values.tls.certManager.issuerName) }}
{{- fail "tls.certManager.issuerName is required with tls.mode certManager (the issuer of the agents' certificates); or tls.mode secret with tls.existingSecret, or tls.mode none with agent.insecure" }}
{{- end }}
{{- if and (eq $mode "secret") (or (not .Values.tls.existingSecret) (not .Values.tls.sharedIdentity)) }}
{{- fail "tls.mode secret needs tls.existingSecret (tls.crt, tls.key, ca.crt) and tls.sharedIdentity (its common name)" }}
{{- end }}
{{- if and (eq $mode "none") (not .Values.agent.insecure) }}
{{- fail "tls.mode none serves plaintext, unauthenticated gRPC: set agent.insecure to say so" }}
{{- end }}
{{- if and (ne $mode "none") (ne .Values.agent.advertise "dns") }}
{{- fail "agent.advertise must be dns with mutual TLS: peers check the pod's DNS name in its certificate" }}
{{- end }}
{{- if eq (int .Values.agent.healthPort) (int .Values.agent.grpcPort) }}
{{- fail (printf "agent.grpcPort and agent.healthPort are both %d" (int .Values.agent.grpcPort)) }}
{{- end }}
{{- range $key := list "name" "model" "global_batch" "micro_batch" "steps" "seed" "min_nodes" "max_nodes" }}
{{- if not (hasKey $spec $key) }}
{{- fail (printf "jobSpec.%s is required (the job spec needs name, model, global_batch, micro_batch, steps, seed, min_nodes, max_nodes)" $key) }}
{{- end }}
{{- end }}
{{- $min := int $spec.min_nodes }}
{{- $max := int $spec.max_nodes }}
{{- $replicas := int .Values.replicas }}
{{- if gt $min $max }}
{{- fail (printf "jobSpec.min_nodes (%d) exceeds jobSpec.max_nodes (%d)" $min $max) }}
{{- end }}
{{- if or (lt $replicas $min) (gt $replicas $max) }}
{{- fail (printf "replicas (%d) must lie within [jobSpec.min_nodes, jobSpec.max_nodes] = [%d, %d]" $replicas $min $max) }}
{{- end }}
{{- if mod (int $spec.global_batch) (int $spec.micro_batch) }}
{{- fail (printf "jobSpec.global_batch (%d) is not a multiple of jobSpec.micro_batch (%d)" (int $spec.global_batch) (int $spec.micro_batch)) }}
{{- end }}
{{- if eq .Values.agent.device "cuda" }}
{{- $device := get $spec "device" | default "cpu" }}
{{- if and (kindIs "string" $device) (eq (lower $device) "cpu") }}
{{- fail "jobSpec.device is cpu (the default: the planner's model of a CPU slot) but agent.device is cuda: set jobSpec.device to the GPUs' preset (a100-40g, a100-80g, h100-80g, h200) or to their figures (memory_gib, peak_tflops, intra_node_gbps, inter_node_gbps)" }}
{{- end }}
{{- end }}
{{- $stopS := int (include "elasticpp.stopSeconds" .) }}
{{- if lt (int .Values.drain.graceMarginSeconds) (add 10 $stopS) }}
{{- fail (printf "drain.graceMarginSeconds (%d) must be at least %d: the preStop hook's drain request (10 s) and the agent's stop after SIGTERM (%d s: jobSpec.stop_timeout_s, then 3 s for the SIGKILL of its processes) come on top of drain.waitSeconds, or Kubernetes kills the pod while it stops" (int .Values.drain.graceMarginSeconds) (add 10 $stopS) $stopS) }}
{{- end }}
{{- if eq .Values.workload "indexedJob" }}
{{- range .Values.agent.extraArgs }}
{{- if or (hasPrefix "--on-job-end" .) (hasPrefix "--unfinished-exit-code" .) }}
{{- fail (printf "agent.extraArgs: %q: with workload indexedJob the chart sets --on-job-end exit and --unfinished-exit-code itself (the Job's podFailurePolicy reads the agent's exit codes)" .) }}
{{- end }}
{{- end }}
{{- $pdb := .Values.podDisruptionBudget }}
{{- if and $pdb.enabled (or (not (kindIs "invalid" $pdb.maxUnavailable)) (kindIs "string" $pdb.minAvailable)) }}
{{- fail "podDisruptionBudget: with workload indexedJob give minAvailable as a number (or leave it null), not maxUnavailable or a percentage: a Job has no scale subresource, so Kubernetes cannot count the pods those are of and refuses every eviction" }}
{{- end }}
{{- end }}
{{- if eq (int .Values.agent.grpcPort) (int .Values.agent.metricsPort) }}
{{- fail (printf "agent.grpcPort and agent.metricsPort are both %d: they must differ" (int .Values.agent.grpcPort)) }}
{{- end }}
{{- end }}
