"""Deployment files, checked offline: compose.yaml + the HAProxy balancer, and the Kubernetes manifests.

The Kubernetes part renders deploy/k8s with `kubectl kustomize` where kubectl is installed and validates
every resource against the Kubernetes API schemas (kubernetes-validate, strict: unknown fields fail).
The invariants that matter for serving (probes, drain timing, threads, the HPA's metric) are checked on
the YAML itself, with or without kubectl.
"""

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from service.config import Settings
from service.metrics import Metrics

REPO = Path(__file__).resolve().parents[1]
K8S = REPO / "deploy" / "k8s"
DEPLOYMENTS = {  # compose service / k8s overlay -> (classify bundle, translate bundle)
    "linformer": ("classify-linformer", "translate-linformer"),
    "transformer": ("classify-transformer", "translate-transformer"),
    "performer": ("classify-performer", ""),
}


def load_compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def haproxy_sections() -> dict[str, list[str]]:
    """`backend linformer` -> its directive lines (comments dropped)."""
    sections: dict[str, list[str]] = {}
    current = None
    for raw in (REPO / "docker" / "haproxy.cfg").read_text().splitlines():
        line = raw.split("#", 1)[0].rstrip()
        if not line.strip():
            continue
        if not line[0].isspace():
            current = line.strip()
            sections[current] = []
        else:
            sections[current].append(line.strip())
    return sections


def default_request_timeout_s() -> float:
    return Settings.model_fields["request_timeout_s"].default


# ---- compose ----


def test_compose_deployments_scale_behind_the_balancer_and_differ_only_in_their_bundles():
    services = load_compose()["services"]
    shared = None
    for name, (classify, translate) in DEPLOYMENTS.items():
        service = dict(services[name])
        assert "ports" not in service, f"{name} publishes a host port: a second replica could not start"
        assert "container_name" not in service
        assert str(service["scale"]).startswith("${") or service["scale"] == 1
        env = dict(service.pop("environment"))
        assert (env.pop("LINFORMER_CLASSIFY_MODEL"), env.pop("LINFORMER_TRANSLATE_MODEL")) == (classify, translate)
        service.pop("scale"), service.pop("profiles", None)
        if shared is None:
            shared = (service, env)
        assert (service, env) == shared, f"{name} differs from the others in more than its bundles"
    assert services["performer"]["profiles"] == ["performer"]
    assert "profiles" not in services["linformer"] and "profiles" not in services["transformer"]
    grace = re.fullmatch(r"(\d+)s", services["linformer"]["stop_grace_period"])
    assert grace and int(grace.group(1)) >= default_request_timeout_s() + 5  # the service's drain bound


# where the deployments choose otherwise than the service, on purpose: one ORT thread per one-CPU replica, and the
# CPU image's provider named
DEPLOYMENT_CHOICES = {
    "LINFORMER_ORT_INTRA_OP_THREADS", "LINFORMER_ORT_INTER_OP_THREADS", "LINFORMER_EXECUTION_PROVIDER"
}


def assert_the_services_default(name: str, value: str | None) -> None:
    """A deployment's `value` for the LINFORMER_* setting `name` is what the service would use anyway. A setting
    whose default is None (decided per bundle, like LINFORMER_MAX_BATCH_TOKENS) must not be given a value: a
    stale 16384 there replaced every bundle's measured batching in both deployments until the seventeenth session."""
    from pydantic import TypeAdapter

    field = Settings.model_fields[name.removeprefix("LINFORMER_").lower()]
    if field.default is None:
        assert value is None, f"{name}={value} replaces what the service decides per bundle"
        return
    assert TypeAdapter(field.annotation).validate_python(value) == field.default, f"{name}={value}: not the default"


def test_the_deployments_serving_settings_are_the_services_own_defaults():
    for name, value in load_compose()["x-serving-env"].items():
        if name in DEPLOYMENT_CHOICES:
            continue
        if value is None:  # no value in compose: the shell's, else unset
            continue
        default = re.fullmatch(r"\$\{(\w+):-(.*)\}", value)  # the shell's, else this default
        assert default and default.group(1) == name, f"{name}: {value}"
        assert_the_services_default(name, default.group(2))
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    literals = dict(item.split("=", 1) for item in kustomization["configMapGenerator"][0]["literals"])
    for name in {f"LINFORMER_{field.upper()}" for field in Settings.model_fields} - DEPLOYMENT_CHOICES:
        if name in literals or Settings.model_fields[name.removeprefix("LINFORMER_").lower()].default is None:
            assert_the_services_default(name, literals.get(name))


def test_balancer_routes_each_port_to_its_deployment_by_least_connections_and_readiness():
    services = load_compose()["services"]
    published = {p.split(":")[1] for p in services["balancer"]["ports"]}
    sections = haproxy_sections()
    for port, name in (("8000", "linformer"), ("8001", "transformer"), ("8002", "performer")):
        assert port in published
        assert f"bind :{port}" in sections[f"frontend {name}"]
        assert f"default_backend {name}" in sections[f"frontend {name}"]
        backend = sections[f"backend {name}"]
        assert "balance leastconn" in backend
        # every replica of the compose service, found through Docker's DNS
        assert any(re.fullmatch(rf"server-template \S+ 1-\d+ {name}:8000", line) for line in backend), backend
    defaults = sections["defaults"]
    assert "http-check send meth GET uri /readyz" in defaults and "http-check expect status 200" in defaults
    server = next(line for line in defaults if line.startswith("default-server"))
    assert " check " in f"{server} " and "resolvers docker" in server and "init-addr none" in server
    # a stopping replica refuses new connections at once: those are retried elsewhere, nothing else is
    assert "retry-on conn-failure" in defaults and any(line.startswith("option redispatch") for line in defaults)
    server_timeout = next(line for line in defaults if line.startswith("timeout server"))
    assert float(server_timeout.split()[-1].rstrip("s")) > default_request_timeout_s()
    assert any(line.startswith("nameserver") and "127.0.0.11:53" in line for line in sections["resolvers docker"])


def test_compose_loadtest_profile_runs_locust_against_both_deployments_through_the_balancer():
    services = load_compose()["services"]
    hosts = {}
    for name in ("locust-linformer", "locust-transformer"):
        assert services[name]["profiles"] == ["loadtest"]
        command = services[name]["command"]
        hosts[name] = command[command.index("--host") + 1]
        assert "./loadtest:/app/loadtest" in services[name]["volumes"]
    assert hosts == {"locust-linformer": "http://balancer:8000", "locust-transformer": "http://balancer:8001"}


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose is not installed")
def test_docker_compose_reads_the_root_file_with_every_profile():
    done = subprocess.run(["docker-compose", "--profile", "loadtest", "--profile", "performer", "config", "-q"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert done.returncode == 0, done.stderr


# ---- Kubernetes ----


def overlay_env(kind: str) -> dict[str, str]:
    kustomization = yaml.safe_load((K8S / kind / "kustomization.yaml").read_text())
    assert kustomization["resources"] == ["../base"] and kustomization["nameSuffix"] == f"-{kind}"
    ops = yaml.safe_load(kustomization["patches"][0]["patch"])
    return {op["value"]["name"]: op["value"]["value"] for op in ops}


def test_k8s_overlays_are_a_deployment_per_attention_kind_with_its_bundles():
    top = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert set(DEPLOYMENTS) <= set(top["resources"])
    for kind, (classify, translate) in DEPLOYMENTS.items():
        assert overlay_env(kind) == {"LINFORMER_CLASSIFY_MODEL": classify, "LINFORMER_TRANSLATE_MODEL": translate}


def test_k8s_pod_drains_within_its_grace_period_and_sizes_ort_to_its_cpu_limit():
    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    # preStop keeps serving while the endpoint is removed, then SIGTERM drains for at most
    # REQUEST_TIMEOUT_S + 5 s (service/__main__.py): all of it must fit the grace period
    command = container["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    readiness = container["readinessProbe"]
    assert int(command[1]) >= readiness["periodSeconds"] * readiness["failureThreshold"]
    assert int(command[1]) + default_request_timeout_s() + 5 < pod["terminationGracePeriodSeconds"]
    env = {e["name"]: e for e in container["env"]}
    threads = env["LINFORMER_ORT_INTRA_OP_THREADS"]["valueFrom"]["resourceFieldRef"]
    assert threads["resource"] == "limits.cpu" and threads["containerName"] == container["name"]
    limits, requests = container["resources"]["limits"], container["resources"]["requests"]
    assert {"cpu", "memory"} <= set(limits) and {"cpu", "memory"} <= set(requests)
    assert env["LINFORMER_HOST"]["value"] == "0.0.0.0"


def test_k8s_hpa_scales_on_cpu_and_on_a_queue_depth_metric_the_service_exports():
    hpa = yaml.safe_load((K8S / "base" / "hpa.yaml").read_text())
    metrics = {m["type"]: m for m in hpa["spec"]["metrics"]}
    assert metrics["Resource"]["resource"]["name"] == "cpu"
    name = metrics["Pods"]["pods"]["metric"]["name"]
    exported = {metric.name for metric in Metrics().registry.collect()}
    assert name in exported, f"{name} is not among the service's metrics {sorted(exported)}"
    rules = yaml.safe_load((K8S / "prometheus-adapter-rules.yaml").read_text())["rules"]["custom"]
    assert any(rule["name"]["as"] == name and name in rule["seriesQuery"] for rule in rules)
    monitor = yaml.safe_load((K8S / "servicemonitor.yaml").read_text())
    service = yaml.safe_load((K8S / "base" / "service.yaml").read_text())
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["endpoints"][0]["path"] == "/metrics"


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl (for `kubectl kustomize`) is not installed")
def test_k8s_kustomization_renders_resources_that_validate_against_the_kubernetes_schemas():
    import kubernetes_validate

    done = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    resources = [r for r in yaml.safe_load_all(done.stdout) if r]
    version = kubernetes_validate.latest_version()
    for resource in resources:
        if resource["kind"] == "ServiceMonitor":  # a CRD: no schema in the Kubernetes API
            continue
        kubernetes_validate.validate(resource, version, strict=True)  # raises on an error
    by_kind: dict[str, dict[str, dict]] = {}
    for resource in resources:
        by_kind.setdefault(resource["kind"], {})[resource["metadata"]["name"]] = resource
    assert set(by_kind["Deployment"]) == {f"linformer-serve-{kind}" for kind in DEPLOYMENTS}
    for name, deployment in by_kind["Deployment"].items():
        assert deployment["metadata"]["namespace"] == "linformer"
        pod = deployment["spec"]["template"]
        assert deployment["spec"]["selector"]["matchLabels"].items() <= pod["metadata"]["labels"].items()
        (config,) = pod["spec"]["containers"][0]["envFrom"]
        assert config["configMapRef"]["name"] in by_kind["ConfigMap"]  # the generated, hashed name
        service = by_kind["Service"][name]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        hpa = by_kind["HorizontalPodAutoscaler"][name]
        assert hpa["spec"]["scaleTargetRef"]["name"] == name
    # each Service selects only its own deployment's pods
    selectors = [tuple(sorted(s["spec"]["selector"].items())) for s in by_kind["Service"].values()]
    assert len(set(selectors)) == len(DEPLOYMENTS)


def test_schema_validation_rejects_a_misspelt_field():
    import kubernetes_validate

    deployment = yaml.safe_load((K8S / "base" / "deployment.yaml").read_text())
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    container["readinesProbe"] = container.pop("readinessProbe")
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(deployment, kubernetes_validate.latest_version(), strict=True)
