"""The Helm chart in deploy/helm/servelm renders (with Helm's own Go engine, through the pip-installable Helm SDK
`helm-python-sdk`, so CI needs no helm binary), every built-in object it renders is valid against the Kubernetes
schemas (strict: unknown fields are errors), the security settings hold for every container, and the values that
matter do what they say: GPUs, keys as files, KEDA on a metric the server exports, the config file servelm reads."""

from __future__ import annotations

import copy
import functools
import importlib
import re
from pathlib import Path

import pytest
import yaml

helm = pytest.importorskip("helm_python", reason="helm-python-sdk (the test extra) renders the chart")
kv = pytest.importorskip("kubernetes_validate.utils", reason="kubernetes-validate (the test extra)")

from servelm.config.settings import load as load_settings  # noqa: E402
from servelm.ray.app import RayOptions, check_look_back  # noqa: E402
from tests.project.test_observability_files import METRIC, exported_names  # noqa: E402

CHART = Path(__file__).resolve().parents[2] / "deploy" / "helm" / "servelm"
K8S_VERSIONS = ("1.25.0", "1.37.0")  # the chart's kubeVersion floor, and the newest schema bundled
CRDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor"),
        ("ray.io/v1", "RayService")}

EVERYTHING = {  # every option on at once but Ray
    "kind": "StatefulSet",
    "args": ["/models/smol"],
    "config": {"engine": {"max_num_seqs": 32}, "server": {"drain_timeout": 20},
               "admission": {"queue_timeout_s": 10}},
    "apiKeys": {"enabled": True, "keys": [{"name": "team-a", "key_hash": "sha256:" + "0" * 64}],
                "adminKey": "admin-secret-key", "metricsRequireKey": True},
    "persistence": {"enabled": True, "size": "5Gi"},
    "models": {"fetch": {"enabled": True, "uri": "s3://bucket/models"}},
    "gpu": {"count": 1},
    "autoscaling": {"keda": {"enabled": True, "kvCacheUsageThreshold": "0.9"}},
    "serviceMonitor": {"enabled": True},
    "deploymentSpecs": [{"name": "smol", "versions": [{"version": 1, "weight": 90}, {"version": 2, "weight": 10}],
                         "workers": 1, "max_workers": 4, "autoscaling": {"target_ongoing_requests": 8}}],
}
PROFILES = {
    "default": {},
    "everything": EVERYTHING,
    "ray": {"ray": {"enabled": True, "model": "/models/smol"}, "models": {"existingClaim": "models"}},
    "hpa": {"autoscaling": {"hpa": {"enabled": True, "waitingRequestsPerPod": "8"}},
            "persistence": {"enabled": True}, "apiKeys": {"enabled": True, "existingSecret": "mine"}},
    # shared state bundled in the release: PostgreSQL and Redis beside the replicas
    "shared": {"database": {"bundled": {"enabled": True, "password": "p@ss/word"}}, "redis": {"bundled": {"enabled": True}}},
}


@functools.cache
def _validator(version: str, api_version: str, kind: str):
    """kubernetes_validate.utils.validate's strict validator, built once per schema (it re-reads the 6 MB
    definitions file on every call, about 0.1 s each)."""
    group = re.sub(r"^([^./]*)(?:\.[^/]*)?/", r"\1-", api_version)
    folder = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kv.schema_contents(f"{folder}/{kind.lower()}-{group}.json", version)
    defs = kv.schema_contents(f"{folder}/_definitions.json", version)
    registry = kv.Resource.from_contents(defs) @ (kv.Resource.from_contents(schema) @ kv.Registry())
    return kv.jsonschema.validators.Draft202012Validator(schema, registry=registry)


def validate(doc: dict, version: str) -> None:
    """Raise jsonschema.ValidationError naming the first field that is not valid Kubernetes."""
    _validator(version, doc["apiVersion"], doc["kind"]).validate(doc)


def render(values: dict) -> list[dict]:
    with helm.Chart.load(str(CHART)) as chart:
        out = chart.render(copy.deepcopy(values), name="llm", namespace="serving")
    return [d for text in out.values() for d in yaml.safe_load_all(text) if d]


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: render(values) for name, values in PROFILES.items()}


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_specs(docs: list[dict]) -> list[dict]:
    specs = [d["spec"]["template"]["spec"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
    for rs in by_kind(docs, "RayService"):
        cluster = rs["spec"]["rayClusterConfig"]
        specs.append(cluster["headGroupSpec"]["template"]["spec"])
        specs += [g["template"]["spec"] for g in cluster["workerGroupSpecs"]]
    return specs


def test_default_render_is_a_deployment_with_service_config_pdb(rendered):
    kinds = sorted(d["kind"] for d in rendered["default"])
    assert kinds == ["ConfigMap", "Deployment", "NetworkPolicy", "PodDisruptionBudget", "Service", "ServiceAccount"]
    everything = {d["kind"] for d in rendered["everything"]}
    assert {"StatefulSet", "Secret", "ScaledObject", "ServiceMonitor"} <= everything
    assert "RayService" in {d["kind"] for d in rendered["ray"]}
    assert "HorizontalPodAutoscaler" in {d["kind"] for d in rendered["hpa"]}


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_object_is_valid_against_the_kubernetes_schemas(rendered, profile):
    for doc in rendered[profile]:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            continue  # no schema bundled; their fields are checked below
        for version in K8S_VERSIONS:
            validate(doc, version)
        assert doc["metadata"]["namespace"] == "serving"


def test_schema_validation_catches_a_wrong_field(rendered):
    # the check above is not vacuous: a misspelt or mistyped field fails it, and the cached validator
    # agrees with the library's own entry point
    kv.validate(by_kind(rendered["default"], "Deployment")[0], K8S_VERSIONS[-1], strict=True)
    dep = copy.deepcopy(by_kind(rendered["default"], "Deployment")[0])
    dep["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["periodSecond"] = 5
    with pytest.raises(kv.jsonschema.ValidationError):
        validate(dep, K8S_VERSIONS[-1])
    dep = copy.deepcopy(by_kind(rendered["default"], "Deployment")[0])
    dep["spec"]["replicas"] = "two"
    with pytest.raises(kv.jsonschema.ValidationError):
        validate(dep, K8S_VERSIONS[-1])


@pytest.mark.parametrize("profile", sorted(PROFILES))
def test_every_container_is_locked_down_and_limited(rendered, profile):
    for spec in pod_specs(rendered[profile]):
        assert spec["automountServiceAccountToken"] is False
        assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] >= 10000
        assert spec["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert not spec.get("hostNetwork") and not spec.get("hostPID")
        assert not any("hostPath" in v for v in spec.get("volumes", []))
        for c in spec["containers"] + spec.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True, c["name"]
            assert sc["capabilities"]["drop"] == ["ALL"] and not sc.get("privileged"), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["limits"]), c["name"]
            assert {"cpu", "memory"} <= set(c["resources"]["requests"]), c["name"]
            # a read-only root filesystem needs every place the server writes to be a volume
            if c["name"] == "servelm":
                assert {"/tmp", "/cache", "/data", "/dev/shm"} <= {m["mountPath"] for m in c["volumeMounts"]}


def test_probes_ports_and_drain(rendered):
    dep = by_kind(rendered["default"], "Deployment")[0]
    spec = dep["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["readinessProbe"]["httpGet"] == {"path": "/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
    assert c["startupProbe"]["httpGet"]["path"] == "/health"
    # model loading gets minutes before liveness may kill the pod
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] >= 300
    assert c["ports"] == [{"name": "http", "containerPort": 8000, "protocol": "TCP"}]
    env = {e["name"]: e["value"] for e in c["env"]}
    assert env["SERVELM_HOST"] == "0.0.0.0" and env["SERVELM_PORT"] == "8000"
    # the pod outlives the server's own drain (from the config file) plus the preStop pause
    drain = yaml.safe_load(by_kind(rendered["default"], "ConfigMap")[0]["data"]["servelm.yaml"])["server"]
    assert spec["terminationGracePeriodSeconds"] > drain["drain_timeout"] + 5
    assert dep["spec"]["strategy"]["rollingUpdate"]["maxUnavailable"] == 0
    svc = by_kind(rendered["default"], "Service")[0]
    assert svc["spec"]["selector"] == dep["spec"]["selector"]["matchLabels"]
    netpol = by_kind(rendered["default"], "NetworkPolicy")[0]["spec"]
    assert netpol["podSelector"]["matchLabels"] == svc["spec"]["selector"]
    assert netpol["ingress"] == [{"ports": [{"port": "http", "protocol": "TCP"}]}]
    assert by_kind(rendered["default"], "PodDisruptionBudget")[0]["spec"]["selector"]["matchLabels"] == \
        svc["spec"]["selector"]


def test_gpu_keys_and_persistence_in_the_statefulset(rendered):
    docs = rendered["everything"]
    sts = by_kind(docs, "StatefulSet")[0]
    spec = sts["spec"]["template"]["spec"]
    c = spec["containers"][0]
    assert c["resources"]["limits"]["nvidia.com/gpu"] == 1 and c["resources"]["requests"]["nvidia.com/gpu"] == 1
    assert c["args"] == ["serve", "/models/smol", "--device", "cuda"]
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in spec["tolerations"]
    assert spec["nodeSelector"]["nvidia.com/gpu.present"] == "true"
    assert "replicas" not in sts["spec"]  # KEDA owns the replica count
    assert sts["spec"]["volumeClaimTemplates"][0]["spec"]["resources"]["requests"]["storage"] == "5Gi"
    assert sts["spec"]["serviceName"] in {s["metadata"]["name"] for s in by_kind(docs, "Service")}
    # keys reach the server as files from the Secret, never as env values
    secret = by_kind(docs, "Secret")[0]
    assert yaml.safe_load(secret["stringData"]["keys.yaml"])["keys"][0]["name"] == "team-a"
    assert secret["stringData"]["admin.key"] == "admin-secret-key"
    env = {e["name"]: e.get("value") for e in c["env"]}
    assert env["SERVELM_API_KEYS_FILE"] == "/etc/servelm/secrets/keys.yaml"
    assert env["SERVELM_ADMIN_KEY_FILE"] == "/etc/servelm/secrets/admin.key"
    assert not any("secret" in (v or "") for v in env.values() if v != env["SERVELM_API_KEYS_FILE"]
                   and v != env["SERVELM_ADMIN_KEY_FILE"])
    keys_vol = next(v for v in spec["volumes"] if v["name"] == "keys")
    assert keys_vol["secret"]["secretName"] == secret["metadata"]["name"]
    # the object-store fetch fills the models volume the server mounts read-only
    assert spec["initContainers"][0]["env"][0] == {"name": "MODELS_URI", "value": "s3://bucket/models"}
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]


def test_the_rendered_config_file_is_one_servelm_accepts(rendered, tmp_path):
    docs = rendered["everything"]
    text = by_kind(docs, "ConfigMap")[0]["data"]["servelm.yaml"]
    (tmp_path / "servelm.yaml").write_text(text)
    c = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"] if e["name"] not in ("SERVELM_API_KEYS_FILE", "SERVELM_ADMIN_KEY_FILE")}
    env["SERVELM_CONFIG"] = str(tmp_path / "servelm.yaml")
    env["SERVELM_DATA_DIR"] = str(tmp_path)
    cfg = load_settings(env=env)  # raises ConfigError naming the key if the chart wrote something servelm refuses
    assert cfg.engine.scheduler_config.max_num_seqs == 32 and cfg.server.lifecycle_config.drain_timeout == 20 and cfg.server.api_config.host == "0.0.0.0"
    assert cfg.server.auth_config.metrics_require_key is True


def test_deployment_specs_in_the_values_are_a_file_the_server_applies_at_start(rendered, tmp_path):
    from servelm.control.spec import parse_text

    docs = rendered["everything"]
    text = by_kind(docs, "ConfigMap")[0]["data"]["deployment-specs.yaml"]
    specs = parse_text(text)  # what the server parses at start: the values' schema is the spec's
    assert [(s.name, [(v.version, v.weight) for v in s.versions], s.max_workers) for s in specs] == \
        [("smol", [(1, 90.0), (2, 10.0)], 4)]
    c = by_kind(docs, "StatefulSet")[0]["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SERVELM_DEPLOYMENT_SPEC", "value": "/etc/servelm/deployment-specs.yaml"} in c["env"]
    assert {"name": "config", "mountPath": "/etc/servelm/deployment-specs.yaml", "subPath": "deployment-specs.yaml",
            "readOnly": True} in c["volumeMounts"]
    assert load_settings(env={"SERVELM_DEPLOYMENT_SPEC": "/etc/servelm/deployment-specs.yaml",
                              "SERVELM_DATA_DIR": str(tmp_path)}).server.rollout_config.deployment_spec == \
        "/etc/servelm/deployment-specs.yaml"
    default = by_kind(rendered["default"], "ConfigMap")[0]["data"]  # no specs: no file, no option
    assert "deployment-specs.yaml" not in default


def test_keda_scales_on_metrics_the_server_exports(rendered):
    so = by_kind(rendered["everything"], "ScaledObject")[0]
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": "llm-servelm"}
    assert so["spec"]["minReplicaCount"] == 2 and so["spec"]["maxReplicaCount"] == 10
    queries = {t["name"]: t["metadata"]["query"] for t in so["spec"]["triggers"]}
    assert "servelm:num_requests_waiting" in queries["waiting-requests"]
    assert 'namespace="serving"' in queries["waiting-requests"]
    exported = exported_names()
    for q in queries.values():
        assert set(METRIC.findall(q)) <= exported, q
    mon = by_kind(rendered["everything"], "ServiceMonitor")[0]
    assert mon["spec"]["endpoints"][0] == {"port": "http", "path": "/metrics", "interval": "15s"}
    hpa = by_kind(rendered["hpa"], "HorizontalPodAutoscaler")[0]
    assert {m["type"] for m in hpa["spec"]["metrics"]} == {"Resource", "Pods"}
    assert "replicas" not in by_kind(rendered["hpa"], "Deployment")[0]["spec"]


def test_rayservice_runs_the_replicas_and_the_pods_the_api_in_front(rendered):
    docs = rendered["ray"]
    rs = by_kind(docs, "RayService")[0]
    app = yaml.safe_load(rs["spec"]["serveConfigV2"])["applications"][0]
    module, _, attr = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), attr))  # the app builder exists (import without Ray)
    assert app["name"] == "servelm" and app["args"]["model"] == "/models/smol" and app["args"]["max_replicas"] == 4
    # the window the app builder passes to Ray Serve is one it accepts (longer than its metrics interval)
    assert check_look_back(app["args"]["look_back_period_s"]) == RayOptions.look_back_period_s
    cluster = rs["spec"]["rayClusterConfig"]
    pin = re.search(r'"ray\[serve\]==([^"]+)"', (CHART.parents[2] / "pyproject.toml").read_text()).group(1)
    assert cluster["rayVersion"] == pin  # KubeRay's rayVersion is the Ray the image has (servelm[ray]'s pin)
    assert cluster["workerGroupSpecs"][0]["maxReplicas"] == 4
    # the chart's pods run servelm's API process attached to that application through the head service
    c = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert c["command"][-3:] == ["python", "-m", "servelm.ray"]
    assert c["args"] == ["/models/smol", "--ray-attach", "--ray-app-name", app["name"], "--ray-address",
                         f"ray://{rs['metadata']['name']}-head-svc:10001"]
    assert {"name": "models", "mountPath": "/models", "readOnly": True} in c["volumeMounts"]  # its tokenizer


def _env(container: dict) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_bundled_postgresql_and_redis_are_wired_to_every_replica(rendered):
    import base64
    from urllib.parse import unquote, urlsplit

    docs = rendered["shared"]
    server_dep = next(d for d in by_kind(docs, "Deployment") if d["metadata"]["name"] == "llm-servelm")
    env = _env(server_dep["spec"]["template"]["spec"]["containers"][0])
    secret = next(d for d in by_kind(docs, "Secret") if d["metadata"]["name"] == "llm-servelm-postgresql")
    assert env["SERVELM_DATABASE_URL"] == {"secretKeyRef": {"name": "llm-servelm-postgresql", "key": "url"}}
    url = urlsplit(secret["stringData"]["url"] if "stringData" in secret else
                   base64.b64decode(secret["data"]["url"]).decode())
    assert (url.scheme, url.hostname, url.port, url.path) == ("postgresql+psycopg", "llm-servelm-postgresql", 5432,
                                                              "/servelm")
    assert unquote(url.password) == "p@ss/word"  # quoted inside the URL, whole again once parsed
    assert env["SERVELM_REDIS_URL"] == "redis://llm-servelm-redis:6379/0"
    assert "SERVELM_DATABASE_AUTO_UPGRADE" not in env  # replicas migrate at start by default
    names = {d["metadata"]["name"] for d in by_kind(docs, "Service")}
    assert {"llm-servelm-postgresql", "llm-servelm-redis"} <= names
    # the server's Service selects the server's pods only, never the bundled ones
    server = next(d for d in by_kind(docs, "Service") if d["metadata"]["name"] == "llm-servelm")
    for kind in ("StatefulSet", "Deployment"):
        for d in by_kind(docs, kind):
            labels = d["spec"]["template"]["metadata"]["labels"]
            selected = all(labels.get(k) == v for k, v in server["spec"]["selector"].items())
            assert selected == (d["metadata"]["name"] == "llm-servelm"), d["metadata"]["name"]


def test_external_shared_state_reaches_the_server_as_it_reads_it(tmp_path):
    docs = render({"database": {"existingSecret": "db", "autoUpgrade": False},
                   "redis": {"url": "redis://cache:6379/1", "failOpen": True}})
    env = _env(by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0])
    assert env["SERVELM_DATABASE_URL"] == {"secretKeyRef": {"name": "db", "key": "url"}}
    plain = {k: v for k, v in env.items() if isinstance(v, str)}
    plain.update(SERVELM_CONFIG=str(tmp_path / "none.yaml"), SERVELM_DATA_DIR=str(tmp_path),
                 SERVELM_DATABASE_URL="postgresql://u@db/servelm")
    (tmp_path / "none.yaml").write_text("{}\n")
    cfg = load_settings(env=plain)  # the chart's env values are ones the server accepts
    assert cfg.server.storage_config.redis_url == "redis://cache:6379/1" and cfg.admission.rate_limit_fail_open is True
    assert cfg.server.storage_config.database_auto_upgrade is False


@pytest.mark.parametrize(("values", "message"), [
    ({"database": {"url": "postgresql://a/b", "bundled": {"enabled": True, "password": "x"}}},
     "one control database"),
    ({"database": {"bundled": {"enabled": True}}}, "database.bundled.password"),
    ({"redis": {"url": "redis://a", "existingSecret": "r"}}, "one Redis"),
    ({"autoscaling": {"hpa": {"enabled": True}, "keda": {"enabled": True}}}, "exclusive"),
    ({"kind": "DaemonSet"}, "kind must be Deployment or StatefulSet"),
    ({"ray": {"enabled": True}}, "ray.model"),
])
def test_contradictory_values_fail_to_render(values, message):
    with pytest.raises(helm.HelmError, match=message):
        render(values)
