{{/*
The agents' pod template, shared by the StatefulSet and the indexed Job (workload):
what differs between them is said where it differs.
*/}}
{{- define "elasticpp.podTemplate" -}}
{{- $fullname := include "elasticpp.fullname" . }}
{{- $job := eq .Values.workload "indexedJob" }}
{{- $grpcPort := int .Values.agent.grpcPort }}
{{- $resources := deepCopy .Values.resources }}
{{- if eq .Values.agent.device "cuda" }}
{{- $limits := dict }}
{{- if hasKey $resources "limits" }}{{ $limits = index $resources "limits" }}{{ end }}
{{- $_ := set $limits .Values.gpu.resourceName (int .Values.agent.slots) }}
{{- $_ := set $resources "limits" $limits }}
{{- end }}
{{- $affinity := deepCopy .Values.affinity }}
{{- if .Values.oneAgentPerNode }}
{{- $term := dict "topologyKey" "kubernetes.io/hostname" "labelSelector" (dict "matchLabels" (include "elasticpp.selectorLabels" . | fromYaml)) }}
{{- $anti := dict }}
{{- if hasKey $affinity "podAntiAffinity" }}{{ $anti = index $affinity "podAntiAffinity" }}{{ end }}
{{- $required := list }}
{{- if hasKey $anti "requiredDuringSchedulingIgnoredDuringExecution" }}{{ $required = index $anti "requiredDuringSchedulingIgnoredDuringExecution" }}{{ end }}
{{- $_ := set $anti "requiredDuringSchedulingIgnoredDuringExecution" (append $required $term) }}
{{- $_ := set $affinity "podAntiAffinity" $anti }}
{{- end -}}
metadata:
  labels:
    {{- include "elasticpp.labels" . | nindent 4 }}
    {{- with .Values.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.podAnnotations }}
  annotations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
spec:
  {{- if $job }}
  # Every exit is the Job's to judge (its podFailurePolicy): no restart in place. The pod's
  # hostname is <job>-<index>; the subdomain gives it <job>-<index>.<service>.<namespace>.svc.
  restartPolicy: Never
  subdomain: {{ $fullname }}
  {{- end }}
  serviceAccountName: {{ include "elasticpp.serviceAccountName" . }}
  automountServiceAccountToken: false
  # preStop drains (the job moves off this pod at a step boundary); the agent then exits.
  terminationGracePeriodSeconds: {{ include "elasticpp.gracePeriodSeconds" . }}
  {{- with .Values.priorityClassName }}
  priorityClassName: {{ . }}
  {{- end }}
  {{- with .Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.podSecurityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- if .Values.hostNetwork }}
  # The host's network (RDMA, NCCL over the host's NICs): the NetworkPolicy does not
  # apply; mutual TLS guards the gRPC port, the host's firewall the rest.
  hostNetwork: true
  {{- end }}
  {{- with .Values.dnsPolicy | default (ternary "ClusterFirstWithHostNet" "" .Values.hostNetwork) }}
  dnsPolicy: {{ . }}
  {{- end }}
  {{- with .Values.runtimeClassName }}
  runtimeClassName: {{ . }}
  {{- end }}
  {{- with .Values.schedulerName }}
  schedulerName: {{ . }}
  {{- end }}
  {{- with .Values.initContainers }}
  initContainers:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  containers:
    - name: agent
      image: {{ include "elasticpp.image" . | quote }}
      imagePullPolicy: {{ .Values.image.pullPolicy }}
      command:
        - elasticpp
      args:
        - agent
        {{- include "elasticpp.etcdArgs" . | nindent 8 }}
        - --job-spec=/etc/elasticpp/job.yaml
        {{- if $job }}
        # The pod name is the node id (<job>-<index>-<suffix>): a replaced pod is a new node
        # joining, and no replacement waits for its predecessor's lease to lapse.
        {{- else }}
        # The pod name is the node id: stable across restarts, unique in the job.
        {{- end }}
        - --node-id=$(POD_NAME)
        - --slots={{ .Values.agent.slots }}
        - --device={{ .Values.agent.device }}
        - --listen=0.0.0.0:{{ $grpcPort }}
        - --health-listen=0.0.0.0:{{ .Values.agent.healthPort }}
        - --control-socket={{ .Values.agent.controlSocket }}
        {{- if .Values.agent.insecure }}
        - --insecure
        {{- end }}
        {{- if ne .Values.tls.mode "none" }}
        - --tls-cert=/etc/elasticpp-tls/tls.crt
        - --tls-key=/etc/elasticpp-tls/tls.key
        - --tls-ca=/etc/elasticpp-tls/ca.crt
        {{- end }}
        {{- if eq .Values.tls.mode "secret" }}
        - --tls-shared-identity={{ .Values.tls.sharedIdentity }}
        {{- end }}
        {{- if .Values.token.existingSecret }}
        - --token-file=/etc/elasticpp-token/token
        {{- end }}
        {{- if and (eq .Values.agent.advertise "dns") $job }}
        - --advertise-host={{ $fullname }}-$(POD_INDEX).{{ $fullname }}.$(POD_NAMESPACE).svc.{{ .Values.clusterDomain }}
        {{- else if eq .Values.agent.advertise "dns" }}
        - --advertise-host=$(POD_NAME).{{ $fullname }}.$(POD_NAMESPACE).svc.{{ .Values.clusterDomain }}
        {{- else }}
        - --advertise-host=$(POD_IP)
        {{- end }}
        - --state-dir=/var/lib/elasticpp
        - --metrics-port={{ .Values.agent.metricsPort }}
        - --log-level={{ .Values.agent.logLevel }}
        {{- if $job }}
        # A finished job's agents exit 0 and complete the Job, a failed or halted one's 3 or
        # 4 (FailJob); one that leaves a job that goes on (drained, stopped) exits as a
        # process SIGTERM ended would, so that the Job replaces its pod (Ignore) instead of
        # counting its index complete.
        - --on-job-end=exit
        - --unfinished-exit-code={{ include "elasticpp.unfinishedExitCode" . }}
        {{- else }}
        - --on-job-end={{ .Values.agent.onJobEnd }}
        {{- end }}
        {{- range .Values.agent.extraArgs }}
        - {{ . | quote }}
        {{- end }}
      env:
        - name: POD_NAME
          valueFrom:
            fieldRef:
              fieldPath: metadata.name
        - name: POD_NAMESPACE
          valueFrom:
            fieldRef:
              fieldPath: metadata.namespace
        {{- if $job }}
        - name: POD_INDEX
          valueFrom:
            fieldRef:
              fieldPath: metadata.annotations['batch.kubernetes.io/job-completion-index']
        {{- end }}
        - name: POD_IP
          valueFrom:
            fieldRef:
              fieldPath: status.podIP
        # The root filesystem is read-only: library caches go to the /tmp emptyDir.
        - name: HOME
          value: /tmp
        - name: PYTHONUNBUFFERED
          value: "1"
        {{- with .Values.agent.extraEnv }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: grpc
          containerPort: {{ $grpcPort }}
          protocol: TCP
        - name: health
          containerPort: {{ .Values.agent.healthPort }}
          protocol: TCP
        - name: metrics
          containerPort: {{ .Values.agent.metricsPort }}
          protocol: TCP
      # grpc.health.v1 on the plaintext health port: SERVING once the agent serves.
      startupProbe:
        grpc:
          port: {{ .Values.agent.healthPort }}
        periodSeconds: {{ .Values.probes.startup.periodSeconds }}
        failureThreshold: {{ .Values.probes.startup.failureThreshold }}
      readinessProbe:
        grpc:
          port: {{ .Values.agent.healthPort }}
        periodSeconds: {{ .Values.probes.readiness.periodSeconds }}
        failureThreshold: {{ .Values.probes.readiness.failureThreshold }}
      livenessProbe:
        grpc:
          port: {{ .Values.agent.healthPort }}
        periodSeconds: {{ .Values.probes.liveness.periodSeconds }}
        timeoutSeconds: {{ .Values.probes.liveness.timeoutSeconds }}
        failureThreshold: {{ .Values.probes.liveness.failureThreshold }}
      lifecycle:
        preStop:
          exec:
            command:
              - /bin/sh
              - -c
              - >-
                elasticpp ctl --agent unix:{{ .Values.agent.controlSocket }} --timeout 10
                drain --wait {{ .Values.drain.waitSeconds }} || exit 0;
                while elasticpp ctl --agent unix:{{ .Values.agent.controlSocket }} --timeout 5
                status >/dev/null 2>&1; do sleep 2; done
      {{- with $resources }}
      resources:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with .Values.securityContext }}
      securityContext:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      volumeMounts:
        - name: state
          mountPath: /var/lib/elasticpp
        - name: jobspec
          mountPath: /etc/elasticpp
          readOnly: true
        {{- if .Values.etcd.tls.existingSecret }}
        - name: etcd-tls
          mountPath: /etc/elasticpp-etcd/tls
          readOnly: true
        {{- end }}
        {{- if .Values.etcd.auth.existingSecret }}
        - name: etcd-auth
          mountPath: /etc/elasticpp-etcd/auth
          readOnly: true
        {{- end }}
        - name: run
          mountPath: {{ dir .Values.agent.controlSocket }}
        {{- if ne .Values.tls.mode "none" }}
        - name: tls
          mountPath: /etc/elasticpp-tls
          readOnly: true
        {{- end }}
        {{- if .Values.token.existingSecret }}
        - name: token
          mountPath: /etc/elasticpp-token
          readOnly: true
        {{- end }}
        - name: tmp
          mountPath: /tmp
        - name: shm
          mountPath: /dev/shm
        {{- with .Values.extraVolumeMounts }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
  volumes:
    - name: jobspec
      configMap:
        name: {{ $fullname }}-jobspec
    {{- if .Values.etcd.tls.existingSecret }}
    # Files, never environment variables: the workers (user model code) inherit the
    # environment. Group-readable by fsGroup, for the non-root agent.
    - name: etcd-tls
      secret:
        secretName: {{ .Values.etcd.tls.existingSecret }}
        defaultMode: 0440
    {{- end }}
    {{- if .Values.etcd.auth.existingSecret }}
    - name: etcd-auth
      secret:
        secretName: {{ .Values.etcd.auth.existingSecret }}
        defaultMode: 0440
        items:
          - key: password
            path: password
    {{- end }}
    - name: run
      emptyDir:
        medium: Memory
        sizeLimit: 1Mi
    {{- if eq .Values.tls.mode "certManager" }}
    # A certificate per pod, renewed in place (the agent reads the files again).
    - name: tls
      csi:
        driver: csi.cert-manager.io
        readOnly: true
        volumeAttributes:
          csi.cert-manager.io/issuer-name: {{ .Values.tls.certManager.issuerName }}
          csi.cert-manager.io/issuer-kind: {{ .Values.tls.certManager.issuerKind }}
          csi.cert-manager.io/issuer-group: {{ .Values.tls.certManager.issuerGroup }}
          csi.cert-manager.io/common-name: ${POD_NAME}
          {{- if $job }}
          # The name peers dial is the pod's hostname, <job>-<index>, which no variable of
          # the CSI driver gives (POD_NAME, POD_NAMESPACE, POD_UID, SERVICE_ACCOUNT_NAME):
          # the certificate covers the job's own subdomain. The node is its common name.
          csi.cert-manager.io/dns-names: "*.{{ $fullname }}.${POD_NAMESPACE}.svc.{{ .Values.clusterDomain }}"
          {{- else }}
          csi.cert-manager.io/dns-names: ${POD_NAME}.{{ $fullname }}.${POD_NAMESPACE}.svc.{{ .Values.clusterDomain }}
          {{- end }}
          csi.cert-manager.io/key-usages: server auth,client auth
          csi.cert-manager.io/fs-group: {{ .Values.podSecurityContext.fsGroup | default 1000 | quote }}
    {{- else if eq .Values.tls.mode "secret" }}
    - name: tls
      secret:
        secretName: {{ .Values.tls.existingSecret }}
        defaultMode: 0440
    {{- end }}
    {{- if .Values.token.existingSecret }}
    - name: token
      secret:
        secretName: {{ .Values.token.existingSecret }}
        defaultMode: 0440
        items:
          - key: token
            path: token
    {{- end }}
    - name: tmp
      emptyDir: {}
    - name: shm
      emptyDir:
        medium: Memory
        sizeLimit: {{ .Values.shmSize }}
    {{- if and $job .Values.persistence.enabled }}
    # A Job has no volumeClaimTemplates: a claim per pod that lives and goes with the pod
    # (a replaced pod is a new node, which fetches its state from its peers).
    - name: state
      ephemeral:
        volumeClaimTemplate:
          metadata:
            labels:
              {{- include "elasticpp.selectorLabels" . | nindent 14 }}
          spec:
            accessModes:
              {{- toYaml .Values.persistence.accessModes | nindent 14 }}
            {{- with .Values.persistence.storageClassName }}
            storageClassName: {{ . }}
            {{- end }}
            resources:
              requests:
                storage: {{ .Values.persistence.size }}
    {{- else if not .Values.persistence.enabled }}
    - name: state
      emptyDir: {}
    {{- end }}
    {{- with .Values.extraVolumes }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with .Values.nodeSelector }}
  nodeSelector:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $affinity }}
  affinity:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.tolerations }}
  tolerations:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with .Values.topologySpreadConstraints }}
  topologySpreadConstraints:
    {{- tpl (toYaml .) $ | nindent 4 }}
  {{- end }}
{{- end }}
