"""The Helm chart, rendered by the pinned helm binary and checked object by object."""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import string
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from testkit.server import server_python
from tests.deploy.tooling import (
    CHART,
    CI_VALUES,
    FULLNAME,
    ROOT,
    VENV,
    Doc,
    b64,
    container,
    dockerfile_stages,
    find,
    one,
    pod_spec,
    render,
    render_error,
    render_text,
    require_server_venv,
    run,
    server_env_vars,
    tool,
    workload,
)

VALUE_SETS = [None, *CI_VALUES]
VALUE_IDS = ["default", *[p.stem for p in CI_VALUES]]
SENTINEL_KEY = "AKIA-SENTINEL-ACCESS-KEY-7f3a"
SENTINEL_SECRET = "sentinel-secret-value-9c1e-do-not-leak"
S3 = {"config": {"s3": {"endpointUrl": "http://minio:9000", "bucket": "ec-cache"}}}


def files(value_file: Path | None) -> list[Path]:
    return [value_file] if value_file else []


def merge(*parts: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for part in parts:
        for key, value in part.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = merge(out[key], value)
            else:
                out[key] = value
    return out


def test_ci_value_sets_exist() -> None:
    names = {p.name for p in CI_VALUES}
    assert {
        "pvc-statefulset-values.yaml",
        "existing-secret-values.yaml",
        "hpa-monitoring-netpol-values.yaml",
    } <= names


# --------------------------------------------------------------------- lint, schemas


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_helm_lint_strict(value_file: Path | None) -> None:
    args: list[str | Path] = [tool("helm"), "lint", "--strict", CHART]
    for f in files(value_file):
        args += ["--values", f]
    proc = run(args)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "[WARNING]" not in proc.stdout and "[ERROR]" not in proc.stdout, proc.stdout


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_rendered_manifests_match_kubernetes_schemas(value_file: Path | None) -> None:
    tool("kubernetes-validate")
    text = render_text(files=files(value_file))
    proc = run(
        [
            VENV / "bin" / "python",
            ROOT / "deploy" / "validate_manifests.py",
            "--quiet",
            "-k",
            "1.25.0",
            "-k",
            "1.37.0",
            "-",
        ],
        input=text,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert " 0 invalid" in proc.stdout


def test_validator_rejects_a_broken_manifest() -> None:
    """The schema check is real: a misspelt field in the pod spec fails it."""
    tool("kubernetes-validate")
    text = render_text().replace("readOnlyRootFilesystem:", "readOnlyRootFilesytem:")
    proc = run(
        [VENV / "bin" / "python", ROOT / "deploy" / "validate_manifests.py", "--quiet", "-"],
        input=text,
    )
    assert proc.returncode == 1
    assert "readOnlyRootFilesytem" in proc.stdout


@pytest.mark.parametrize(
    "values",
    [
        {"config": {"diskMaxBytz": "1GiB"}},
        {"replicas": 3},
        {"config": {"writeMode": "writeback"}},
        {"config": {"logLevel": "verbose"}},
        {"config": {"diskMaxBytes": "10 gigabytes"}},
        {"config": {"s3": {"endpointURL": "http://x"}}},
        {"persistence": {"enabled": True, "sise": "1Gi"}},
        {"workload": {"kind": "DaemonSet"}},
        {"image": {"digest": "latest"}},
        {"s3Credentials": {"secretName": "x"}},
    ],
    ids=lambda v: json.dumps(v, sort_keys=True),
)
def test_values_schema_rejects_typos_and_bad_values(values: dict[str, Any]) -> None:
    assert "schema" in render_error(values)


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"config": {"diskMaxBytes": "20GiB"}}, "emptyDir.sizeLimit"),
        (
            {"persistence": {"enabled": True, "size": "10Gi"}, "config": {"diskMaxBytes": "11GiB"}},
            "persistence.size",
        ),
        ({"persistence": {"enabled": True}, "workload": {"kind": "Deployment"}}, "StatefulSet"),
        ({"config": {"s3": {"endpointUrl": "http://minio:9000"}}}, "EC_S3_BUCKET"),
        ({"s3Credentials": {"accessKeyId": "only-half"}}, "secretAccessKey"),
        ({"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}, "maxReplicas"),
        ({"config": {"shutdownTimeout": 60}}, "terminationGracePeriodSeconds"),
        ({"config": {"anonymous": "none"}}, "auth.tokens"),
        ({"config": {"anonymous": None}}, "config.anonymous"),
    ],
)
def test_inconsistent_values_fail_with_a_message(values: dict[str, Any], message: str) -> None:
    assert message in render_error(values)


def test_grace_period_refusal_names_the_total_it_requires() -> None:
    """preStopSleepSeconds 5 + shutdownTimeout 30 + drainTimeout 20 = 55 > 45."""
    message = render_error({"config": {"shutdownTimeout": 30, "writeback": {"drainTimeout": 20}}})
    assert "terminationGracePeriodSeconds (45) must be >= " in message
    assert "config.writeback.drainTimeout = 5 + 30 + 20 = 55" in message
    assert render(
        {"config": {"writeback": {"drainTimeout": 20}}, "terminationGracePeriodSeconds": 55}
    )


def test_fractional_shutdown_timeout_renders_what_the_server_takes(tmp_path: Path) -> None:
    """The schema takes any number of seconds: the server must take what renders (a
    pod that crash-loops on ``EC_SHUTDOWN_TIMEOUT="20.5"`` passed every check before)."""
    require_server_venv()
    docs = render({"config": {"shutdownTimeout": 20.5}, "terminationGracePeriodSeconds": 60})
    env = dict(one(docs, "ConfigMap", FULLNAME)["data"])
    assert env["EC_SHUTDOWN_TIMEOUT"] == "20.5"
    env["EC_DATA_DIR"] = str(tmp_path / "data")  # the pod's /data
    base = {k: v for k, v in os.environ.items() if not k.startswith("EC_")}
    checked = run([server_python(), "-m", "app", "--check"], env={**base, **env})
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert checked.stdout.splitlines()[-1] == "configuration ok"


def server_anonymous_values() -> set[str]:
    """The EC_ANONYMOUS values the server takes (app/auth.py's AnonymousAccess, parsed)."""
    tree = ast.parse((ROOT / "app" / "auth.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == "AnonymousAccess":
            return {
                str(stmt.value.value)
                for stmt in node.body
                if isinstance(stmt, ast.Assign) and isinstance(stmt.value, ast.Constant)
            }
    raise AssertionError("no AnonymousAccess in app/auth.py")


def test_chart_takes_every_anonymous_access_the_server_takes() -> None:
    values = server_anonymous_values()
    assert values == {"none", "read", "read-write", "admin"}
    schema = json.loads((CHART / "values.schema.json").read_text())
    enum = schema["properties"]["config"]["properties"]["anonymous"]["enum"]
    assert set(enum) - {None} == values
    for value in sorted(values - {"none"}):
        data = one(render({"config": {"anonymous": value}}), "ConfigMap", FULLNAME)["data"]
        assert data["EC_ANONYMOUS"] == value
    for doc in (ROOT / "docs" / "deploy.md", CHART / "README.md"):
        row = next(
            line for line in doc.read_text().splitlines() if line.startswith("| `EC_ANONYMOUS`")
        )
        assert all(f"`{value}`" in row for value in values), (doc.name, row)


NOTES_TEMPLATE = """apiVersion: v1
kind: ConfigMap
metadata:
  name: rendered-notes
data:
  notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}
"""


def render_notes(values: dict[str, Any]) -> str:
    """NOTES.txt as ``helm install`` prints it (``helm template`` leaves it out): a copy
    of the chart renders it through ``tpl`` into a ConfigMap."""
    with tempfile.TemporaryDirectory() as tmp:
        chart = Path(tmp) / CHART.name
        shutil.copytree(CHART, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
        (chart / "templates" / "rendered-notes.yaml").write_text(NOTES_TEMPLATE)
        values_file = Path(tmp) / "values.json"
        values_file.write_text(json.dumps(values))
        proc = run([tool("helm"), "template", "ec", chart, "--values", values_file])
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    notes: str = one(docs, "ConfigMap", "rendered-notes")["data"]["notes"]
    return notes


def test_notes_say_what_anonymous_requests_may_do() -> None:
    """DELETE and purge need the admin scope: read-write may not delete."""
    said = {
        value: next(
            line
            for line in render_notes({"config": {"anonymous": value}}).splitlines()
            if line.startswith("Anything that can reach the Service")
        )
        for value in ("read", "read-write", "admin")
    }
    assert "can read entries." in said["read"]
    assert "can read and add entries." in said["read-write"]
    assert "can read, add, delete and purge entries." in said["admin"]


def test_deploy_doc_helm_quick_start_is_complete() -> None:
    """docs/deploy.md's Helm block defines every variable it uses, and what it installs
    is what it then reaches: its ``helm install`` (rendered here; the other steps need a
    cluster) runs the image it pushed, reads tokens from the Secret it made, and names
    the StatefulSet and Service it waits for and forwards to."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    section = text[text.index("## Helm\n") :]
    start = section.index("```bash\n") + len("```bash\n")
    block = section[start : section.index("\n```", start)]
    assigned = dict(re.findall(r"^([A-Z_]+)=(\S+)", block, re.MULTILINE))
    used = set(re.findall(r"\$\{?([A-Z_]+)", block))
    assert used <= set(assigned), f"undefined: {sorted(used - set(assigned))}"
    lines = block.replace("\\\n", " ").splitlines()
    (install,) = [line for line in lines if line.startswith("helm install ")]
    (push,) = [line for line in lines if line.startswith("docker push ")]
    env = {name: value for name, value in assigned.items() if not value.startswith('"$(')}
    args = [string.Template(arg).safe_substitute(env) for arg in shlex.split(install)]
    assert args[:4] == ["helm", "install", "ec-cache", "helm/ec-cache"]
    proc = run([tool("helm"), "template", *args[2:]])
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    pod = pod_spec(docs)
    pushed = string.Template(shlex.split(push)[2]).safe_substitute(env)
    assert pod["containers"][0]["image"] == pushed
    assert f"statefulset/{workload(docs)['metadata']['name']}" in block
    service = one(docs, "Service", "ec-cache")
    assert f"port-forward svc/ec-cache 8080:{service['spec']['ports'][0]['port']}" in block
    secret_refs = [
        e["valueFrom"]["secretKeyRef"]
        for e in pod["containers"][0].get("env", [])
        if e["name"] == "EC_AUTH_TOKENS"
    ]
    assert secret_refs == [{"name": "ec-cache-auth", "key": "EC_AUTH_TOKENS"}]
    assert "create secret generic ec-cache-auth" in block and "EC_AUTH_TOKENS=" in block


# --------------------------------------------------------- config <-> server settings


EVERY_SETTING: dict[str, Any] = {
    "config": {
        "logFormat": "json",
        "s3": {
            "endpointUrl": "http://minio:9000",
            "bucket": "ec-cache",
            "connectTimeout": 2,
            "readTimeout": 20.5,
            "maxAttempts": 4,
            "maxPoolConnections": 16,
            "multipartThreshold": "64MiB",
            "multipartPartSize": "16MiB",
            "multipartConcurrency": 2,
            "getChunkSize": "1MiB",
            "getPartSize": "4MiB",
            "getConcurrency": 4,
            "getBufferBytes": "256MiB",
            "unavailableCooldown": 3,
            "verifyTls": False,
        },
        "writeback": {
            "queueMaxEntries": 10000000,
            "queueMaxBytes": 0,
            "workers": 2,
            "retryMin": 1,
            "retryMax": 30,
            "drainTimeout": 5,
        },
        "anonymous": "read",
        "metricsPublic": True,
        "metricsNamespaces": 20,
        "maxConcurrentUploads": 8,
        "maxConcurrentDownloads": 64,
        "bodyReadTimeout": 10,
        "uploadMinRate": "512KiB",
        "uploadRateGrace": 5,
        "uploadTimeout": 600,
        "diskCommitDelay": 0.002,
        "maxHeaderBytes": "16KiB",
        "maxConnections": 2048,
        "keepaliveTimeout": 4,
        "headerTimeout": 5,
        "sendTimeout": 20,
        "claimMaxLease": 30,
        "claimMaxKeys": 50000,
        "claimMaxWaiters": 512,
        "claimMaxWait": 20.5,
        "shutdownTimeout": 25,
    },
    "auth": {
        "tokens": {"value": "ops:admin:0123456789abcdef0123"},
        "tokensFile": {"existingSecret": "tokens-file"},
    },
}


def test_chart_covers_exactly_the_server_settings() -> None:
    """Every EC_* setting of app/settings.py has a chart value, and none is invented."""
    expected = server_env_vars()
    docs = render(EVERY_SETTING)
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    secret_env = {e["name"] for e in container(docs).get("env", []) if "valueFrom" in e}
    provided = set(data) | (secret_env - {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"})
    assert provided == expected, (
        f"chart-only: {sorted(provided - expected)}, server-only: {sorted(expected - provided)}"
    )
    assert all(isinstance(v, str) for v in data.values())
    assert data["EC_WRITEBACK_QUEUE_MAX_ENTRIES"] == "10000000"  # not 1e+07
    assert data["EC_S3_READ_TIMEOUT"] == "20.5"
    assert data["EC_S3_VERIFY_TLS"] == "false"
    assert data["EC_AUTH_TOKENS_FILE"] == "/etc/ec-cache/auth/tokens"


def test_unset_tuning_values_leave_server_defaults_alone() -> None:
    data = one(render(), "ConfigMap", FULLNAME)["data"]
    assert "EC_S3_MAX_ATTEMPTS" not in data and "EC_LOG_FORMAT" not in data


def test_configmap_defaults_and_value_mapping() -> None:
    data = one(render(), "ConfigMap", FULLNAME)["data"]
    assert data == {
        "EC_HOST": "0.0.0.0",
        "EC_PORT": "8080",
        "EC_DATA_DIR": "/data",
        "EC_DISK_MAX_BYTES": "10GiB",
        "EC_MAX_BODY_BYTES": "1GiB",
        "EC_WRITE_MODE": "write-through",
        "EC_LOG_LEVEL": "info",
        "EC_S3_ENDPOINT_URL": "",
        "EC_S3_BUCKET": "",
        "EC_S3_PREFIX": "ec",
        "EC_S3_REGION": "us-east-1",
        "EC_S3_CREATE_BUCKET": "false",
        "EC_ANONYMOUS": "read-write",
    }
    docs = render(
        {
            "config": {
                "port": 9090,
                "dataDir": "/cache",
                "diskMaxBytes": 5368709120,
                "maxBodyBytes": "256MiB",
                "writeMode": "write-back",
                "logLevel": "debug",
                "s3": {
                    "endpointUrl": "https://s3.example.com",
                    "bucket": "b-1",
                    "prefix": "p/q",
                    "region": "eu-west-1",
                    "createBucket": True,
                },
            },
            "persistence": {"enabled": True, "size": "6Gi"},
        }
    )
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    assert data["EC_PORT"] == "9090"
    assert data["EC_DATA_DIR"] == "/cache"
    assert data["EC_DISK_MAX_BYTES"] == "5368709120"  # not 5.36870912e+09
    assert data["EC_MAX_BODY_BYTES"] == "256MiB"
    assert data["EC_WRITE_MODE"] == "write-back"
    assert data["EC_LOG_LEVEL"] == "debug"
    assert data["EC_S3_ENDPOINT_URL"] == "https://s3.example.com"
    assert data["EC_S3_BUCKET"] == "b-1"
    assert data["EC_S3_PREFIX"] == "p/q"
    assert data["EC_S3_REGION"] == "eu-west-1"
    assert data["EC_S3_CREATE_BUCKET"] == "true"
    c = container(docs)
    assert c["ports"] == [{"name": "http", "containerPort": 9090, "protocol": "TCP"}]
    assert {"name": "data", "mountPath": "/cache"} in c["volumeMounts"]
    assert {"configMapRef": {"name": FULLNAME}} in c["envFrom"]


def test_image_env_matches_chart_defaults() -> None:
    """The image's EC_* defaults and the chart's agree (port, data dir, host)."""
    runtime = dockerfile_stages()[-1]
    env_text = " ".join(arg for instr, arg in runtime if instr == "ENV")
    data = one(render(), "ConfigMap", FULLNAME)["data"]
    for key in ("EC_HOST", "EC_PORT", "EC_DATA_DIR"):
        assert f"{key}={data[key]}" in env_text


# ----------------------------------------------------------------------------- probes


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_probes_hit_healthz_and_readyz(value_file: Path | None) -> None:
    c = container(render(files=files(value_file)))
    for probe, path in (
        ("startupProbe", "/healthz"),
        ("livenessProbe", "/healthz"),
        ("readinessProbe", "/readyz"),
    ):
        assert probe in c, f"{probe} missing"
        assert c[probe]["httpGet"]["path"] == path
        assert c[probe]["httpGet"]["port"] == "http"
        assert c[probe]["timeoutSeconds"] >= 1
    # The start-up budget covers a slow index rebuild before liveness can kill the pod.
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 120


def test_probe_overrides_merge_and_disable() -> None:
    c = container(
        render(
            {
                "probes": {
                    "readiness": {"enabled": True, "periodSeconds": 2},
                    "liveness": {"enabled": False},
                }
            }
        )
    )
    assert c["readinessProbe"]["periodSeconds"] == 2
    assert c["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert "livenessProbe" not in c


# ---------------------------------------------------------------- secrets never plain


def _env(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


def test_inline_credentials_go_to_a_secret_and_never_into_plain_env() -> None:
    text = render_text(
        merge(
            S3,
            {
                "s3Credentials": {
                    "accessKeyId": SENTINEL_KEY,
                    "secretAccessKey": SENTINEL_SECRET,
                }
            },
        )
    )
    # Never in clear text anywhere (the Secret holds base64).
    assert SENTINEL_KEY not in text and SENTINEL_SECRET not in text
    docs = [d for d in yaml.safe_load_all(text) if d]
    secret = one(docs, "Secret", f"{FULLNAME}-s3")
    assert secret["data"] == {
        "AWS_ACCESS_KEY_ID": b64(SENTINEL_KEY),
        "AWS_SECRET_ACCESS_KEY": b64(SENTINEL_SECRET),
    }
    for doc in docs:
        if doc["kind"] != "Secret":
            dumped = json.dumps(doc)
            assert b64(SENTINEL_KEY) not in dumped and b64(SENTINEL_SECRET) not in dumped
    env = _env(container(docs))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        assert "value" not in env[name]
        assert env[name]["valueFrom"]["secretKeyRef"]["name"] == f"{FULLNAME}-s3"
        assert env[name]["valueFrom"]["secretKeyRef"]["key"] == name
    assert all("value" not in e or not e["name"].startswith("AWS_") for e in env.values())
    configmap = one(docs, "ConfigMap", FULLNAME)
    assert not any(k.startswith("AWS_") for k in configmap["data"])


def test_existing_secret_is_referenced_and_no_secret_is_rendered() -> None:
    docs = render(
        merge(
            S3,
            {
                "s3Credentials": {
                    "existingSecret": "team-s3",
                    "accessKeyIdKey": "ak",
                    "secretAccessKeyKey": "sk",
                    "accessKeyId": SENTINEL_KEY,
                    "secretAccessKey": SENTINEL_SECRET,
                }
            },
        )
    )
    assert find(docs, "Secret") == []
    assert SENTINEL_KEY not in json.dumps(docs) and SENTINEL_SECRET not in json.dumps(docs)
    env = _env(container(docs))
    assert env["AWS_ACCESS_KEY_ID"]["valueFrom"]["secretKeyRef"] == {"name": "team-s3", "key": "ak"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "team-s3",
        "key": "sk",
    }
    annotations = workload(docs)["spec"]["template"]["metadata"]["annotations"]
    assert "checksum/secret" not in annotations


def test_auth_tokens_reach_the_pod_through_secrets_only() -> None:
    token = "ops:admin:" + SENTINEL_SECRET
    text = render_text(
        {
            "auth": {
                "tokens": {"value": token},
                "tokensFile": {"existingSecret": "tok", "key": "t.txt"},
            }
        }
    )
    assert token not in text and SENTINEL_SECRET not in text
    docs = [d for d in yaml.safe_load_all(text) if d]
    secret = one(docs, "Secret", f"{FULLNAME}-auth")
    assert secret["data"] == {"EC_AUTH_TOKENS": b64(token)}
    env = _env(container(docs))
    assert env["EC_AUTH_TOKENS"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{FULLNAME}-auth",
        "key": "EC_AUTH_TOKENS",
    }
    assert "EC_AUTH_TOKENS" not in one(docs, "ConfigMap", FULLNAME)["data"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["auth-tokens"]["secret"]["secretName"] == "tok"
    mount = {m["name"]: m for m in container(docs)["volumeMounts"]}["auth-tokens"]
    assert mount["readOnly"] is True
    data = one(docs, "ConfigMap", FULLNAME)["data"]
    assert data["EC_AUTH_TOKENS_FILE"] == mount["mountPath"] + "/t.txt"


def test_no_credentials_means_the_aws_default_chain() -> None:
    docs = render(
        merge(
            S3,
            {
                "serviceAccount": {
                    "annotations": {
                        "eks.amazonaws.com/role-arn": "arn:aws:iam::123456789012:role/ec",
                    }
                }
            },
        )
    )
    assert find(docs, "Secret") == []
    assert not any(n.startswith("AWS_") for n in _env(container(docs)))
    sa = one(docs, "ServiceAccount")
    assert sa["metadata"]["annotations"]["eks.amazonaws.com/role-arn"].endswith(":role/ec")
    assert pod_spec(docs)["serviceAccountName"] == sa["metadata"]["name"]


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_no_plain_env_value_looks_like_a_credential(value_file: Path | None) -> None:
    for doc in render(files=files(value_file)):
        if doc["kind"] in {"StatefulSet", "Deployment"}:
            for c in doc["spec"]["template"]["spec"]["containers"]:
                for e in c.get("env", []):
                    if any(w in e["name"].upper() for w in ("SECRET", "KEY", "TOKEN", "PASSWORD")):
                        assert "value" not in e, f"{e['name']} is a plain env value"


# ------------------------------------------------------------------- security context


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_hardened_security_context(value_file: Path | None) -> None:
    docs = render(files=files(value_file))
    spec = pod_spec(docs)
    psc = spec["securityContext"]
    assert psc["runAsNonRoot"] is True
    assert psc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert psc["runAsUser"] != 0 and psc["fsGroup"] != 0
    csc = container(docs)["securityContext"]
    assert csc["runAsNonRoot"] is True
    assert csc["allowPrivilegeEscalation"] is False
    assert csc["readOnlyRootFilesystem"] is True
    assert csc["capabilities"]["drop"] == ["ALL"]
    assert not csc["capabilities"].get("add")
    assert csc.get("privileged") is not True
    assert csc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    # Read-only root: the cache folder and /tmp are the writable mounts.
    mounts = {m["mountPath"]: m["name"] for m in container(docs)["volumeMounts"]}
    assert mounts["/data"] == "data" and mounts["/tmp"] == "tmp"


def test_pod_uid_matches_the_image_user() -> None:
    runtime = dockerfile_stages()[-1]
    args = dict(arg.split("=", 1) for instr, arg in runtime if instr == "ARG" and "=" in arg)
    user = [arg for instr, arg in runtime if instr == "USER"]
    assert user == ["${UID}:${GID}"]
    psc = pod_spec(render())["securityContext"]
    assert psc["runAsUser"] == int(args["UID"])
    assert psc["runAsGroup"] == int(args["GID"])
    assert psc["fsGroup"] == int(args["GID"])


# ------------------------------------------------------------------ replicas, scaling


@pytest.mark.parametrize("replicas", [1, 3, 7])
@pytest.mark.parametrize("kind", ["StatefulSet", "Deployment"])
def test_replica_count_is_honoured(replicas: int, kind: str) -> None:
    w = workload(render({"replicaCount": replicas, "workload": {"kind": kind}}))
    assert w["kind"] == kind
    assert w["spec"]["replicas"] == replicas


def test_hpa_owns_replicas_when_enabled() -> None:
    docs = render(
        {
            "replicaCount": 3,
            "autoscaling": {
                "enabled": True,
                "minReplicas": 2,
                "maxReplicas": 9,
            },
        }
    )
    w = workload(docs)
    assert "replicas" not in w["spec"]
    hpa = one(docs, "HorizontalPodAutoscaler")
    assert hpa["apiVersion"] == "autoscaling/v2"
    assert hpa["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": w["kind"],
        "name": w["metadata"]["name"],
    }
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (2, 9)
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"
    assert find(render(), "HorizontalPodAutoscaler") == []


def test_pdb_selects_the_workload_pods_only() -> None:
    docs = render(files=[CHART / "ci" / "pvc-statefulset-values.yaml"])
    pdb = one(docs, "PodDisruptionBudget")
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    selector = pdb["spec"]["selector"]["matchLabels"]
    assert selector.items() <= pod_labels.items()
    assert pdb["spec"] == {"minAvailable": 2, "selector": pdb["spec"]["selector"]}
    assert one(render(), "PodDisruptionBudget")["spec"]["maxUnavailable"] == 1
    assert find(render({"podDisruptionBudget": {"enabled": False}}), "PodDisruptionBudget") == []


# ------------------------------------------------------------------- PVC vs emptyDir


def test_default_disk_tier_is_an_emptydir_per_pod() -> None:
    docs = render()
    w = workload(docs)
    assert "volumeClaimTemplates" not in w["spec"]
    volumes = {v["name"]: v for v in pod_spec(docs)["volumes"]}
    assert volumes["data"]["emptyDir"] == {"sizeLimit": "12Gi"}
    assert "emptyDir" in volumes["tmp"]


def test_persistence_gives_each_pod_its_own_claim() -> None:
    docs = render(files=[CHART / "ci" / "pvc-statefulset-values.yaml"])
    w = workload(docs)
    assert w["kind"] == "StatefulSet"
    (claim,) = w["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "data"
    assert claim["spec"]["resources"]["requests"]["storage"] == "100Gi"
    assert claim["spec"]["storageClassName"] == "local-nvme"
    assert claim["spec"]["accessModes"] == ["ReadWriteOnce"]
    assert w["spec"]["persistentVolumeClaimRetentionPolicy"] == {
        "whenDeleted": "Delete",
        "whenScaled": "Retain",
    }
    volumes = {v["name"] for v in pod_spec(docs)["volumes"]}
    assert "data" not in volumes  # the claim template provides it
    assert {"name": "data", "mountPath": "/data"} in container(docs)["volumeMounts"]
    assert find(docs, "PersistentVolumeClaim") == []  # per pod, not one shared claim


def test_deployment_uses_emptydir_and_strategy() -> None:
    docs = render(files=[CHART / "ci" / "existing-secret-values.yaml"])
    w = workload(docs)
    assert w["kind"] == "Deployment"
    assert "serviceName" not in w["spec"] and "volumeClaimTemplates" not in w["spec"]
    assert w["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert {v["name"]: v for v in pod_spec(docs)["volumes"]}["data"]["emptyDir"]["sizeLimit"] == (
        "24Gi"
    )
    assert container(docs)["image"].endswith("@sha256:" + "0123456789abcdef" * 4)


# ---------------------------------------------------------- checksum rolls the pods


def _checksums(values: dict[str, Any]) -> dict[str, str]:
    annotations = workload(render(values))["spec"]["template"]["metadata"]["annotations"]
    return {k: v for k, v in annotations.items() if k.startswith("checksum/")}


def test_config_checksum_changes_with_config_only() -> None:
    base = _checksums({})
    assert len(base["checksum/config"]) == 64
    assert (
        _checksums({"config": {"logLevel": "debug"}})["checksum/config"] != base["checksum/config"]
    )
    assert _checksums(merge(S3, {}))["checksum/config"] != base["checksum/config"]
    # Not a change of configuration: same checksum, no needless rollout.
    assert _checksums({"replicaCount": 5}) == base
    assert _checksums({"podAnnotations": {"a": "b"}}) == base


def test_secret_checksum_changes_with_credentials() -> None:
    a = _checksums(merge(S3, {"s3Credentials": {"accessKeyId": "a", "secretAccessKey": "s1"}}))
    b = _checksums(merge(S3, {"s3Credentials": {"accessKeyId": "a", "secretAccessKey": "s2"}}))
    assert a["checksum/secret"] != b["checksum/secret"]
    assert a["checksum/config"] == b["checksum/config"]


# ------------------------------------------------------- services, monitoring, policy


def test_services_and_statefulset_identity() -> None:
    docs = render()
    svc = one(docs, "Service", FULLNAME)
    headless = one(docs, "Service", f"{FULLNAME}-headless")
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    for s in (svc, headless):
        assert s["spec"]["selector"].items() <= pod_labels.items()
        assert s["spec"]["ports"][0]["targetPort"] == "http"
    assert "clusterIP" not in svc["spec"]
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"]["publishNotReadyAddresses"] is False
    assert workload(docs)["spec"]["serviceName"] == headless["metadata"]["name"]


def test_helm_test_pod_is_not_selected_by_services() -> None:
    docs = render()
    test_pod = one(docs, "Pod")
    assert test_pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    for s in find(docs, "Service"):
        assert not s["spec"]["selector"].items() <= test_pod["metadata"]["labels"].items()
    assert test_pod["spec"]["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True


def test_servicemonitor_scrapes_the_clusterip_service_only() -> None:
    docs = render(files=[CHART / "ci" / "hpa-monitoring-netpol-values.yaml"])
    sm = one(docs, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["namespace"] == "monitoring"
    assert sm["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "http"
    assert endpoint["interval"] == "15s"
    selected = []
    for s in find(docs, "Service"):
        labels = s["metadata"]["labels"]
        ok = sm["spec"]["selector"]["matchLabels"].items() <= labels.items()
        for expr in sm["spec"]["selector"].get("matchExpressions", []):
            assert expr["operator"] == "DoesNotExist"
            ok = ok and expr["key"] not in labels
        if ok:
            selected.append(s["metadata"]["name"])
            assert "http" in [p["name"] for p in s["spec"]["ports"]]
    assert selected == [FULLNAME]
    assert sm["spec"]["namespaceSelector"] == {"matchNames": ["cache"]}
    assert find(render(), "ServiceMonitor") == []


def test_networkpolicy_limits_ingress_and_egress() -> None:
    docs = render(files=[CHART / "ci" / "hpa-monitoring-netpol-values.yaml"])
    np = one(docs, "NetworkPolicy")
    pod_labels = workload(docs)["spec"]["template"]["metadata"]["labels"]
    assert np["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert np["spec"]["policyTypes"] == ["Ingress", "Egress"]
    (ingress,) = np["spec"]["ingress"]
    assert ingress["ports"] == [{"port": "http", "protocol": "TCP"}]
    sources = [
        p["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for p in ingress["from"]
    ]
    assert sources == ["vllm", "monitoring"]
    dns, s3 = np["spec"]["egress"]
    assert {p["port"] for p in dns["ports"]} == {53}
    assert s3["ports"] == [{"port": 443, "protocol": "TCP"}]
    assert find(render(), "NetworkPolicy") == []


@pytest.mark.parametrize("value_file", VALUE_SETS, ids=VALUE_IDS)
def test_every_object_is_labelled_and_namespaced(value_file: Path | None) -> None:
    docs: list[Doc] = render(files=files(value_file))
    for d in docs:
        meta = d["metadata"]
        assert meta["labels"]["app.kubernetes.io/instance"] == "ec"
        assert meta["labels"]["app.kubernetes.io/managed-by"] == "Helm"
        if d["kind"] not in ("ServiceMonitor", "PrometheusRule"):
            assert meta["namespace"] == "cache", d["kind"]


def test_extra_env_hook_for_future_settings() -> None:
    c = container(render({"extraEnv": [{"name": "EC_LOG_FORMAT", "value": "json"}]}))
    assert {"name": "EC_LOG_FORMAT", "value": "json"} in c["env"]


def test_chart_readme_and_docs_list_every_server_variable() -> None:
    expected = server_env_vars()
    for doc in (CHART / "README.md", ROOT / "docs" / "deploy.md"):
        text = doc.read_text()
        missing = sorted(v for v in expected if f"`{v}`" not in text)
        assert not missing, f"{doc.relative_to(ROOT)} does not document {missing}"


def test_values_schema_is_generated_from_the_script() -> None:
    proc = run(
        [
            VENV / "bin" / "python" if (VENV / "bin" / "python").exists() else "python3",
            ROOT / "deploy" / "gen_values_schema.py",
        ]
    )
    assert proc.returncode == 0, proc.stderr
    committed = json.loads((CHART / "values.schema.json").read_text())
    assert json.loads(proc.stdout) == committed, "run deploy/gen_values_schema.py"


def test_every_values_key_is_in_the_schema() -> None:
    schema = json.loads((CHART / "values.schema.json").read_text())
    values = yaml.safe_load((CHART / "values.yaml").read_text())

    def walk(v: Any, s: dict[str, Any], path: str) -> None:
        if isinstance(v, dict) and s.get("additionalProperties") is False:
            for key, sub in v.items():
                assert key in s["properties"], f"{path}{key} missing from values.schema.json"
                walk(sub, s["properties"][key], f"{path}{key}.")

    walk(values, schema, "")
