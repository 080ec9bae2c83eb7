#!/usr/bin/env python3
"""Generate helm/ec-cache/values.schema.json (run after changing values.yaml keys).

    python3 deploy/gen_values_schema.py > helm/ec-cache/values.schema.json

Every object of ours is closed (additionalProperties: false), so a typo in a values
file fails `helm install/template/lint` instead of being silently ignored.
tests/deploy checks that the committed schema equals this script's output.
"""

import json


def obj(props, required=None, desc=None, additional=False):
    d = {"type": "object", "additionalProperties": additional, "properties": props}
    if required:
        d["required"] = required
    if desc:
        d["description"] = desc
    return d


def s(desc=None, **kw):
    d = {"type": "string", **kw}
    if desc:
        d["description"] = desc
    return d


def b(desc=None):
    d = {"type": "boolean"}
    if desc:
        d["description"] = desc
    return d


def i(desc=None, **kw):
    d = {"type": "integer", **kw}
    if desc:
        d["description"] = desc
    return d


def free(desc=None):
    d = {"type": "object"}
    if desc:
        d["description"] = desc
    return d


def strmap(desc=None):
    d = {"type": "object", "additionalProperties": {"type": "string"}}
    if desc:
        d["description"] = desc
    return d


def arr(items=None, desc=None):
    d = {"type": "array", "items": items or {"type": "object"}}
    if desc:
        d["description"] = desc
    return d


SIZE_SERVER = {
    "description": "Bytes, or a size with a K/M/G/T suffix (binary; KiB/MiB/GiB/TiB as the server reads them).",
    "oneOf": [
        {"type": "integer", "minimum": 1},
        {"type": "string", "pattern": "^\\s*[0-9]+\\s*([KkMmGgTt][Ii]?[Bb]?|[Bb])?\\s*$"},
    ],
}
QUANTITY = {
    "description": "A Kubernetes quantity, e.g. 12Gi.",
    "oneOf": [
        {"type": "integer", "minimum": 1},
        {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?([KMGTPE]i|[kMGTPE])?$"},
    ],
}
INT_OR_PERCENT = {
    "oneOf": [{"type": "integer", "minimum": 0}, {"type": "string", "pattern": "^[0-9]+%$"}]
}


def pos_num(desc, maximum=None, zero=False):
    num = {"type": "number"}
    if zero:
        num["minimum"] = 0
    else:
        num["exclusiveMinimum"] = 0
    if maximum is not None:
        num["maximum"] = maximum
    # `helm --set x=2.5` passes floats as strings.
    text = {"type": "string", "pattern": "^[0-9]+(\\.[0-9]+)?$"}
    return {"description": desc, "oneOf": [{"type": "null"}, num, text]}


def opt_int(desc, minimum=None, maximum=None):
    d = {"description": desc, "type": ["integer", "null"]}
    if minimum is not None:
        d["minimum"] = minimum
    if maximum is not None:
        d["maximum"] = maximum
    return d


def opt_bool(desc):
    return {"description": desc, "type": ["boolean", "null"]}


def opt_size(desc, zero=False):
    return {
        "description": desc + ". Bytes or K/M/G/T(i)(B).",
        "oneOf": [
            {"type": "null"},
            {"type": "integer", "minimum": 0 if zero else 1},
            {"type": "string", "pattern": "^\\s*[0-9]+\\s*([KkMmGgTt][Ii]?[Bb]?|[Bb])?\\s*$"},
        ],
    }


def probe(path):
    return obj(
        {
            "enabled": b(f"Render the probe (GET {path})."),
            "initialDelaySeconds": i(minimum=0),
            "periodSeconds": i(minimum=1),
            "timeoutSeconds": i(minimum=1),
            "failureThreshold": i(minimum=1),
            "successThreshold": i(minimum=1),
            "terminationGracePeriodSeconds": i(minimum=1),
            "httpGet": free("Override the probe target (defaults: path " + path + ", port http)."),
        },
        required=["enabled"],
    )


K8S_NAME = "^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
schema = {
    "$schema": "http://json-schema.org/draft-07/schema#",
    "title": "ec-cache Helm values",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "global": free("Helm global values (unused by this chart)."),
        "nameOverride": s(),
        "fullnameOverride": s(),
        "image": obj(
            {
                "repository": s(minLength=1),
                "tag": {"type": ["string", "number"]},
                "digest": s(pattern="^(|sha256:[a-f0-9]{64})$"),
                "pullPolicy": {"enum": ["Always", "IfNotPresent", "Never"]},
            },
            required=["repository"],
        ),
        "imagePullSecrets": arr(obj({"name": s(minLength=1)}, required=["name"])),
        "workload": obj(
            {
                "kind": {"enum": ["StatefulSet", "Deployment"]},
                "podManagementPolicy": {"enum": ["Parallel", "OrderedReady"]},
                "updateStrategy": free(),
                "revisionHistoryLimit": i(minimum=0),
            },
            required=["kind"],
        ),
        "replicaCount": i(minimum=0),
        "config": obj(
            {
                "host": s("EC_HOST", minLength=1),
                "port": i("EC_PORT", minimum=1, maximum=65535),
                "dataDir": s(
                    "EC_DATA_DIR (absolute path; the data volume is mounted here)", pattern="^/"
                ),
                "diskMaxBytes": {
                    **SIZE_SERVER,
                    "description": "EC_DISK_MAX_BYTES. " + SIZE_SERVER["description"],
                },
                "maxBodyBytes": {
                    **SIZE_SERVER,
                    "description": "EC_MAX_BODY_BYTES. " + SIZE_SERVER["description"],
                },
                "writeMode": {
                    "description": "EC_WRITE_MODE",
                    "enum": ["write-through", "write-back"],
                },
                "logLevel": {
                    "description": "EC_LOG_LEVEL",
                    "enum": ["critical", "error", "warning", "info", "debug"],
                },
                "s3": obj(
                    {
                        "endpointUrl": s(
                            "EC_S3_ENDPOINT_URL; empty = disk tier only", pattern="^(|https?://.+)$"
                        ),
                        "bucket": s(
                            "EC_S3_BUCKET", pattern="^(|[a-z0-9][a-z0-9.-]{1,61}[a-z0-9])$"
                        ),
                        "prefix": s("EC_S3_PREFIX"),
                        "region": s("EC_S3_REGION", minLength=1),
                        "createBucket": b("EC_S3_CREATE_BUCKET"),
                        "connectTimeout": pos_num("EC_S3_CONNECT_TIMEOUT (seconds)"),
                        "readTimeout": pos_num("EC_S3_READ_TIMEOUT (seconds)"),
                        "maxAttempts": opt_int("EC_S3_MAX_ATTEMPTS", 1, 10),
                        "maxPoolConnections": opt_int("EC_S3_MAX_POOL_CONNECTIONS", 1, 1024),
                        "multipartThreshold": opt_size("EC_S3_MULTIPART_THRESHOLD"),
                        "multipartPartSize": opt_size("EC_S3_MULTIPART_PART_SIZE"),
                        "multipartConcurrency": opt_int("EC_S3_MULTIPART_CONCURRENCY", 1, 64),
                        "getChunkSize": opt_size("EC_S3_GET_CHUNK_SIZE"),
                        "getPartSize": opt_size("EC_S3_GET_PART_SIZE"),
                        "getConcurrency": opt_int("EC_S3_GET_CONCURRENCY", 1, 64),
                        "getBufferBytes": opt_size("EC_S3_GET_BUFFER_BYTES"),
                        "unavailableCooldown": pos_num(
                            "EC_S3_UNAVAILABLE_COOLDOWN (seconds, <= 300)", maximum=300
                        ),
                        "verifyTls": opt_bool("EC_S3_VERIFY_TLS"),
                    },
                    required=["endpointUrl", "bucket", "prefix", "region", "createBucket"],
                ),
                "logFormat": {"description": "EC_LOG_FORMAT", "enum": [None, "text", "json"]},
                "writeback": obj(
                    {
                        "queueMaxEntries": opt_int("EC_WRITEBACK_QUEUE_MAX_ENTRIES", 1),
                        "queueMaxBytes": opt_size(
                            "EC_WRITEBACK_QUEUE_MAX_BYTES (0 = half of EC_DISK_MAX_BYTES)",
                            zero=True,
                        ),
                        "workers": opt_int("EC_WRITEBACK_WORKERS", 1, 64),
                        "retryMin": pos_num("EC_WRITEBACK_RETRY_MIN (seconds)"),
                        "retryMax": pos_num("EC_WRITEBACK_RETRY_MAX (seconds)"),
                        "drainTimeout": pos_num("EC_WRITEBACK_DRAIN_TIMEOUT (seconds)"),
                    }
                ),
                "anonymous": {
                    "description": "EC_ANONYMOUS",
                    "enum": [None, "none", "read", "read-write", "admin"],
                },
                "metricsPublic": opt_bool("EC_METRICS_PUBLIC"),
                "metricsNamespaces": opt_int("EC_METRICS_NAMESPACES", 0, 10000),
                "maxConcurrentUploads": opt_int("EC_MAX_CONCURRENT_UPLOADS", 1),
                "maxConcurrentDownloads": opt_int("EC_MAX_CONCURRENT_DOWNLOADS", 1),
                "bodyReadTimeout": pos_num("EC_BODY_READ_TIMEOUT (seconds)"),
                "uploadMinRate": opt_size("EC_UPLOAD_MIN_RATE (per second, 0: off)", zero=True),
                "uploadRateGrace": pos_num("EC_UPLOAD_RATE_GRACE (seconds)", zero=True),
                "uploadTimeout": pos_num("EC_UPLOAD_TIMEOUT (seconds)"),
                "diskCommitDelay": pos_num(
                    "EC_DISK_COMMIT_DELAY (seconds, <= 10)", maximum=10, zero=True
                ),
                "maxHeaderBytes": opt_size("EC_MAX_HEADER_BYTES"),
                "maxConnections": opt_int("EC_MAX_CONNECTIONS", 1),
                "keepaliveTimeout": pos_num("EC_KEEPALIVE_TIMEOUT (seconds)"),
                "headerTimeout": pos_num("EC_HEADER_TIMEOUT (seconds)"),
                "sendTimeout": pos_num("EC_SEND_TIMEOUT (seconds)"),
                "claimMaxLease": pos_num("EC_CLAIM_MAX_LEASE (seconds, <= 3600)", maximum=3600),
                "claimMaxKeys": opt_int("EC_CLAIM_MAX_KEYS", 1),
                "claimMaxWaiters": opt_int("EC_CLAIM_MAX_WAITERS", 1),
                "claimMaxWait": pos_num("EC_CLAIM_MAX_WAIT (seconds, <= 3600)", maximum=3600),
                "shutdownTimeout": pos_num("EC_SHUTDOWN_TIMEOUT (seconds)", zero=True),
            },
            required=[
                "host",
                "port",
                "dataDir",
                "diskMaxBytes",
                "maxBodyBytes",
                "writeMode",
                "logLevel",
                "s3",
            ],
        ),
        "auth": obj(
            {
                "tokens": obj(
                    {
                        "existingSecret": s("Secret holding EC_AUTH_TOKENS"),
                        "key": s(minLength=1),
                        "value": s("Inline token entries; the chart creates a Secret"),
                    }
                ),
                "tokensFile": obj(
                    {
                        "existingSecret": s("Secret mounted as the EC_AUTH_TOKENS_FILE file"),
                        "key": s(pattern="^[-._a-zA-Z0-9]+$"),
                        "mountPath": s(pattern="^/"),
                    }
                ),
            }
        ),
        "s3Credentials": obj(
            {
                "existingSecret": s("Secret holding the S3 credentials (wins over inline values)"),
                "accessKeyIdKey": s(minLength=1),
                "secretAccessKeyKey": s(minLength=1),
                "accessKeyId": s("Inline; the chart creates a Secret"),
                "secretAccessKey": s("Inline; the chart creates a Secret"),
            }
        ),
        "extraEnv": arr(
            obj({"name": s(minLength=1), "value": s(), "valueFrom": free()}, required=["name"])
        ),
        "extraEnvFrom": arr(),
        "persistence": obj(
            {
                "enabled": b("PersistentVolumeClaim per pod (StatefulSet) instead of an emptyDir"),
                "storageClass": s(),
                "accessModes": arr(
                    {"enum": ["ReadWriteOnce", "ReadWriteOncePod", "ReadWriteMany", "ReadOnlyMany"]}
                ),
                "size": QUANTITY,
                "annotations": strmap(),
                "labels": strmap(),
                "retentionPolicy": obj(
                    {
                        "whenDeleted": {"enum": ["Retain", "Delete"]},
                        "whenScaled": {"enum": ["Retain", "Delete"]},
                    }
                ),
            },
            required=["enabled", "size"],
        ),
        "emptyDir": obj(
            {
                "sizeLimit": {"oneOf": [{"type": "string", "maxLength": 0}, QUANTITY]},
                "medium": {"enum": ["", "Memory"]},
            }
        ),
        "tmp": obj({"sizeLimit": {"oneOf": [{"type": "string", "maxLength": 0}, QUANTITY]}}),
        "service": obj(
            {
                "type": {"enum": ["ClusterIP", "NodePort", "LoadBalancer"]},
                "port": i(minimum=1, maximum=65535),
                "annotations": strmap(),
                "labels": strmap(),
                "nodePort": {"type": ["integer", "null"], "minimum": 30000, "maximum": 32767},
                "loadBalancerSourceRanges": arr({"type": "string"}),
            },
            required=["type", "port"],
        ),
        "headlessService": obj({"enabled": b(), "annotations": strmap(), "labels": strmap()}),
        "serviceAccount": obj(
            {
                "create": b(),
                "name": s(),
                "annotations": strmap(),
                "automountServiceAccountToken": b(),
            }
        ),
        "podAnnotations": strmap(),
        "podLabels": strmap(),
        "podSecurityContext": free("PodSecurityContext"),
        "securityContext": free("Container SecurityContext"),
        "resources": obj({"requests": free(), "limits": free(), "claims": arr()}),
        "probes": obj(
            {
                "startup": probe("/healthz"),
                "liveness": probe("/healthz"),
                "readiness": probe("/readyz"),
            },
            required=["startup", "liveness", "readiness"],
        ),
        "preStopSleepSeconds": i(minimum=0),
        "terminationGracePeriodSeconds": i(minimum=0),
        "podDisruptionBudget": obj(
            {
                "enabled": b(),
                "maxUnavailable": {"oneOf": [{"type": "null"}, INT_OR_PERCENT]},
                "minAvailable": {"oneOf": [{"type": "null"}, INT_OR_PERCENT]},
            }
        ),
        "autoscaling": obj(
            {
                "enabled": b(),
                "minReplicas": i(minimum=1),
                "maxReplicas": i(minimum=1),
                "targetCPUUtilizationPercentage": {"type": ["integer", "null"], "minimum": 1},
                "targetMemoryUtilizationPercentage": {"type": ["integer", "null"], "minimum": 1},
                "behavior": free("autoscaling/v2 HorizontalPodAutoscalerBehavior"),
            }
        ),
        "serviceMonitor": obj(
            {
                "enabled": b(),
                "namespace": s(),
                "labels": strmap(),
                "annotations": strmap(),
                "interval": s(pattern="^[0-9]+(ms|s|m|h)$"),
                "scrapeTimeout": s(pattern="^[0-9]+(ms|s|m|h)$"),
                "honorLabels": b(),
                "relabelings": arr(),
                "metricRelabelings": arr(),
            }
        ),
        "grafanaDashboard": obj(
            {
                "enabled": b(),
                "namespace": s(),
                "labels": strmap(),
                "annotations": strmap(),
            }
        ),
        "prometheusRule": obj(
            {
                "enabled": b(),
                "namespace": s(),
                "labels": strmap(),
                "annotations": strmap(),
                "alertLabels": strmap(),
                "thresholds": obj(
                    {
                        "errorRatio": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
                        "p99Seconds": {"type": "number", "exclusiveMinimum": 0},
                        "writeBackQueueDepth": {"type": "integer", "minimum": 0},
                        "writeBackOldestSeconds": {"type": "number", "exclusiveMinimum": 0},
                        "diskChurnRatio": {"type": "number", "exclusiveMinimum": 0},
                        "readinessChanges": {"type": "integer", "minimum": 0},
                    }
                ),
            }
        ),
        "networkPolicy": obj(
            {
                "enabled": b(),
                "allowedClients": arr(),
                "metricsScrapers": arr(),
                "egress": obj(
                    {
                        "enabled": b(),
                        "s3Peers": arr(),
                        "s3Ports": arr({"type": "integer", "minimum": 1, "maximum": 65535}),
                        "dnsPeers": arr(),
                    }
                ),
            }
        ),
        "topologySpread": obj(
            {
                "enabled": b(),
                "maxSkew": i(minimum=1),
                "topologyKey": s(minLength=1),
                "whenUnsatisfiable": {"enum": ["DoNotSchedule", "ScheduleAnyway"]},
            }
        ),
        "topologySpreadConstraints": arr(),
        "nodeSelector": strmap(),
        "tolerations": arr(),
        "affinity": free(),
        "priorityClassName": s(),
        "extraVolumes": arr(),
        "extraVolumeMounts": arr(),
        "tests": obj({"enabled": b("Render the `helm test` pod")}),
    },
    "required": ["image", "workload", "replicaCount", "config", "persistence", "service", "probes"],
}
print(json.dumps(schema, indent=2))
