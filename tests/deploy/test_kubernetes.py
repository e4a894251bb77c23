"""deploy/kubernetes, checked without a cluster: every kustomization renders, validates
against the Kubernetes API schemas of the oldest and newest versions we support (strict: no
field Kubernetes does not know), the CRDs (KEDA, Prometheus Operator) have the structure
their controllers read, and what a cluster would find only at runtime holds: probe paths
exist on the gateway, ports agree with the commands' flags, drain deadlines fit the grace
periods, the ScaledObject's metric is one the gateway exposes, every flag parses."""

from __future__ import annotations

import re
import subprocess

import httpx
import pytest

from tests.deploy.kube import (
    KUBERNETES,
    TARGETS,
    Manifests,
    container,
    flag,
    labels_match,
    load_yaml,
    named_ports,
    render,
    setting,
)
from tests.gateway.helpers import GatewayServer, cyclic_reply
from tests.gateway.observability.test_dashboard import exposed_names
from zeroserve.cli.harness import REPO_ROOT

# The Kubernetes versions we support, oldest and newest: StatefulSet's
# persistentVolumeClaimRetentionPolicy is on by default from 1.27.
K8S_VERSIONS = ("1.27.0", "1.37.0")
CRD_KINDS = {("keda.sh/v1alpha1", "ScaledObject"), ("monitoring.coreos.com/v1", "ServiceMonitor")}
# Seconds a process needs after its own deadline to send its last messages and exit.
EXIT_MARGIN_S = 10


@pytest.fixture(scope="module", params=TARGETS)
def manifests(request) -> Manifests:
    return Manifests(request.param)


# -- schemas ---------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("target", TARGETS)
def test_every_kustomization_validates_strictly_against_the_kubernetes_schemas(target, version):
    kubernetes_validate = pytest.importorskip(
        "kubernetes_validate", reason="kubernetes-validate is not installed (the test extra)")
    from kubernetes_validate.utils import ValidationError

    checked = set()
    for obj in render(target):
        if (obj["apiVersion"], obj["kind"]) in CRD_KINDS:
            continue  # no schema bundled: test_crds_have_the_structure_their_controllers_read
        try:
            kubernetes_validate.validate(obj, version, strict=True)
        except ValidationError as e:
            pytest.fail(f"{target}: {obj['kind']}/{obj['metadata']['name']} on {version}: "
                        f"{e.message} at {list(e.path)}")
        checked.add(obj["kind"])
    assert {"Deployment", "StatefulSet", "Service", "HorizontalPodAutoscaler",
            "PodDisruptionBudget", "NetworkPolicy", "ConfigMap"} <= checked


def test_crds_have_the_structure_their_controllers_read(manifests):
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    (scaled,) = manifests.of_kind("ScaledObject")
    assert scaled["apiVersion"] == "keda.sh/v1alpha1"
    spec = scaled["spec"]
    assert set(spec) <= {"scaleTargetRef", "minReplicaCount", "maxReplicaCount",
                         "pollingInterval", "cooldownPeriod", "advanced", "triggers",
                         "idleReplicaCount", "fallback", "initialCooldownPeriod"}
    target = spec["scaleTargetRef"]
    assert manifests.get(target["kind"], target["name"])["apiVersion"] == target["apiVersion"]
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    # The HPA behaviour KEDA passes on is an HPA's: validate it as one.
    behavior = spec["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    kubernetes_validate.validate({
        "apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": "keda-behavior"},
        "spec": {"scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                    "name": "worker"},
                 "maxReplicas": spec["maxReplicaCount"], "behavior": behavior}},
        K8S_VERSIONS[-1], strict=True)
    (trigger,) = spec["triggers"]
    assert trigger["type"] == "prometheus" and trigger["metricType"] == "AverageValue"
    metadata = trigger["metadata"]
    assert set(metadata) <= {"serverAddress", "query", "threshold", "activationThreshold",
                             "namespace", "authModes", "ignoreNullValues", "unsafeSsl"}
    # KEDA reads every metadata value as a string; a YAML number is refused.
    assert all(isinstance(v, str) for v in metadata.values())
    assert re.match(r"^https?://", metadata["serverAddress"])
    assert float(metadata["threshold"]) > 0 and float(metadata["activationThreshold"]) >= 0

    (monitor,) = manifests.of_kind("ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    (service,) = [s for s in manifests.of_kind("Service")
                  if labels_match(monitor["spec"]["selector"]["matchLabels"],
                                  s["metadata"].get("labels", {}))]
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    assert endpoint["authorization"]["type"] == "Bearer"
    assert set(endpoint["authorization"]["credentials"]) == {"name", "key"}


# -- what a cluster would find at runtime ----------------------------------------------------


def gateway_ports(m: Manifests) -> dict[str, int]:
    """The gateway's ports as its command binds them."""
    c = container(m.gateway)
    return {"http": int(setting(c, "--port")),
            "zmq-router": int(setting(c, "--router-address").rsplit(":", 1)[1]),
            "zmq-tokens": int(setting(c, "--tokens-address").rsplit(":", 1)[1])}


def test_ports_agree_with_the_commands_flags(manifests):
    m = manifests
    gw = container(m.gateway)
    ports = gateway_ports(m)
    assert setting(gw, "--host") == "0.0.0.0"
    assert setting(gw, "--router-address").startswith("tcp://0.0.0.0:")
    assert named_ports(gw) == ports
    # Every Service's target port is one the gateway binds.
    for service in m.of_kind("Service"):
        if service["metadata"]["name"].startswith("gateway"):
            for port in service["spec"]["ports"]:
                assert port["targetPort"] in ports
                assert port["port"] == ports[port["targetPort"]]
    # Workers find every gateway through the headless plane Service, at the ports it binds.
    worker = container(m.worker)
    plane = m.get("Service", setting(worker, "--gateway-dns"))
    assert plane["spec"]["clusterIP"] == "None"
    # A gateway is ready only once a worker linked to it: workers must see it before.
    assert plane["spec"]["publishNotReadyAddresses"] is True
    assert labels_match(plane["spec"]["selector"], m.gateway["spec"]["template"]["metadata"]
                        ["labels"])
    assert int(setting(worker, "--gateway-router-port")) == ports["zmq-router"]
    assert int(setting(worker, "--gateway-tokens-port")) == ports["zmq-tokens"]
    # Probes and NetworkPolicy ports name ports that exist.
    for probe in ("livenessProbe", "readinessProbe", "startupProbe"):
        assert gw[probe]["httpGet"]["port"] in ports
    policy = m.get("NetworkPolicy", "gateway")
    worker_labels = m.worker["spec"]["template"]["metadata"]["labels"]
    zmq_rule, = [r for r in policy["spec"]["ingress"] if "from" in r]
    assert {p["port"] for p in zmq_rule["ports"]} == {"zmq-router", "zmq-tokens"}
    # (overlays/second-model lets a second worker group in too)
    assert any(labels_match(peer["podSelector"]["matchLabels"], worker_labels)
               for peer in zmq_rule["from"])
    open_rules = [r for r in policy["spec"]["ingress"] if "from" not in r]
    assert [p["port"] for r in open_rules for p in r["ports"]] == ["http"]
    # The workers' readiness check asks the gateway Service on its port.
    check = worker["readinessProbe"]["exec"]["command"]
    assert check[:2] == ["zeroserve", "check"]
    service = m.get("Service", "gateway")
    assert flag(check, "--url") == f"http://gateway:{service['spec']['ports'][0]['port']}"


def test_the_drain_deadlines_fit_the_grace_periods(manifests):
    m = manifests
    worker = container(m.worker)
    drain_s = float(setting(worker, "--drain-timeout"))
    assert worker.get("lifecycle") is None  # SIGTERM is the drain (worker.yaml says why)
    assert m.worker["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= \
        drain_s + EXIT_MARGIN_S
    gw = container(m.gateway)
    sleep_s = float(gw["lifecycle"]["preStop"]["exec"]["command"][1])
    shutdown_s = float(setting(gw, "--shutdown-timeout"))
    assert m.gateway["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] >= \
        sleep_s + shutdown_s + EXIT_MARGIN_S
    # The gateway's startup probe allows for a model's load (a Hub tokenizer's download).
    startup = gw["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300


def test_autoscaled_workloads_leave_their_replicas_to_the_autoscaler(manifests):
    """A `replicas` in the manifest would reset the autoscaler's count on every apply."""
    (hpa,) = manifests.of_kind("HorizontalPodAutoscaler")
    (scaled,) = manifests.of_kind("ScaledObject")
    for ref in (hpa["spec"]["scaleTargetRef"], scaled["spec"]["scaleTargetRef"]):
        assert "replicas" not in manifests.get(ref["kind"], ref["name"])["spec"], ref
    assert hpa["spec"]["minReplicas"] >= 2  # a gateway pod may go while another serves
    pdb = manifests.get("PodDisruptionBudget", "gateway")
    assert pdb["spec"]["minAvailable"] == 1


def test_security_contexts_and_writable_paths(manifests):
    for workload in (manifests.gateway, manifests.worker):
        pod = workload["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] == 1000  # the Dockerfile's user
        assert pod["automountServiceAccountToken"] is False
        for c in pod["containers"] + pod.get("initContainers", []):
            sc = c["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
            assert sc["capabilities"]["drop"] == ["ALL"]
            assert c["resources"]["requests"]
        mounts = {v["mountPath"] for v in container(workload)["volumeMounts"]}
        assert {"/tmp", "/home/zeroserve/.cache", "/run/zeroserve-keys"} <= mounts
    claims = [t["metadata"]["name"] for t in manifests.worker["spec"]["volumeClaimTemplates"]]
    assert claims == ["cache"]


def test_each_worker_pod_gets_only_its_own_secret_key(manifests, tmp_path):
    """Run the worker's key init container's script over a fake Secret volume."""
    pod = manifests.worker["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    secret_mount = next(v for v in init["volumeMounts"] if v["name"] == "worker-keys")
    key_mount = next(v for v in init["volumeMounts"] if v["name"] == "keys")
    secret, keys = tmp_path / "secret", tmp_path / "keys"
    secret.mkdir()
    keys.mkdir()
    for name in ("gateway.key", "worker-0.key_secret", "worker-1.key_secret"):
        (secret / name).write_text(name)
    script = init["command"][2].replace(secret_mount["mountPath"], str(secret)) \
        .replace(key_mount["mountPath"], str(keys))
    result = subprocess.run(["sh", "-c", script], env={"POD_NAME": "worker-1", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=10)
    assert result.returncode == 0, result.stderr
    found = {str(p.relative_to(keys)) for p in keys.rglob("*") if p.is_file()}
    assert found == {"gateway.key", "workers/worker-1.key_secret"}
    assert (keys / "workers" / "worker-1.key_secret").stat().st_mode & 0o777 == 0o600
    result = subprocess.run(["sh", "-c", script], env={"POD_NAME": "worker-7", "PATH": "/usr/bin:/bin"},
                            capture_output=True, text=True, timeout=10)
    assert result.returncode != 0 and "no key for worker-7" in result.stderr
    # The worker's id is its pod name, read from the same variable its command reads.
    worker = container(manifests.worker)
    ids = [v for v in worker["env"] if v["name"] == "ZEROSERVE_WORKER_ID"]
    assert ids[0]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


def test_the_secrets_script_makes_the_secrets_the_pods_read(manifests, tmp_path):
    from zeroserve.cli.harness import child_env, zeroserve_argv

    launcher = " ".join(zeroserve_argv("x")[:-1])
    result = subprocess.run([str(KUBERNETES / "secrets.sh"), str(tmp_path / "keys"), "2"],
                            env=child_env({"ZEROSERVE": launcher}), cwd=REPO_ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    import yaml

    secrets = {s["metadata"]["name"]: set(s["data"])
               for s in yaml.safe_load_all(result.stdout) if s}
    assert secrets == {
        "zeroserve-gateway-keys": {"gateway.key_secret", "worker-0.key", "worker-1.key"},
        "zeroserve-worker-keys": {"gateway.key", "worker-0.key_secret", "worker-1.key_secret"},
        "zeroserve-api-keys": {"api-keys", "metrics-key", "admin-key"},
    }
    # Every Secret item a manifest refers to is one the script makes.
    refs = set()
    for workload in (manifests.gateway, manifests.worker):
        pod = workload["spec"]["template"]["spec"]
        refs |= {(v["secret"]["secretName"], None) for v in pod["volumes"] if "secret" in v}
        for c in pod["containers"]:
            refs |= {(e["valueFrom"]["secretKeyRef"]["name"], e["valueFrom"]["secretKeyRef"]["key"])
                     for e in c.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})}
    (monitor,) = manifests.of_kind("ServiceMonitor")
    credentials = monitor["spec"]["endpoints"][0]["authorization"]["credentials"]
    refs.add((credentials["name"], credentials["key"]))
    for name, key in refs:
        assert name in secrets and (key is None or key in secrets[name]), (name, key)


def test_every_container_command_parses():
    """Each command's flags are ones `zeroserve` takes, with valid values (click parses
    them as the container would, without running anything)."""
    import click

    from zeroserve.cli.main import main

    for target in TARGETS:
        m = Manifests(target)
        for workload in (m.gateway, m.worker):
            for c in workload["spec"]["template"]["spec"]["containers"]:
                for command in (c["command"], c.get("readinessProbe", {}).get(
                        "exec", {}).get("command")):
                    if not command:
                        continue
                    assert command[0] == "zeroserve", command
                    sub = main.commands[command[1]]
                    try:
                        sub.make_context(command[1], list(command[2:]), resilient_parsing=False)
                    except click.exceptions.Exit:
                        pass
                    except click.ClickException as e:
                        pytest.fail(f"{target}: {command}: {e.format_message()}")


def test_overlays_pick_the_device_and_the_gpu_overlay_one_gpu_per_worker():
    for overlay, device in (("cpu", "cpu"), ("gpu", "cuda")):
        worker = container(Manifests(f"overlays/{overlay}").worker)
        assert flag(worker["command"], "--device") == device
    gpu = Manifests("overlays/gpu")
    resources = container(gpu.worker)["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == 1
    assert "nvidia.com/gpu" not in str(Manifests("overlays/cpu").objects)
    assert "nvidia.com/gpu" not in str(container(gpu.gateway))


def test_the_grafana_board_config_map_is_the_docs_board():
    docs = (REPO_ROOT / "docs" / "monitoring" / "grafana" / "zeroserve.json").read_text()
    assert (KUBERNETES / "base" / "grafana" / "zeroserve.json").read_text() == docs
    board = Manifests("base").get("ConfigMap", "zeroserve-grafana-dashboard")
    assert board["data"]["zeroserve.json"] == docs
    assert board["metadata"]["labels"]["grafana_dashboard"] == "1"


def test_probe_paths_exist_and_the_scaled_object_queries_metrics_the_gateway_exposes():
    m = Manifests("base")
    gw = container(m.gateway)
    paths = {gw[p]["httpGet"]["path"] for p in ("livenessProbe", "readinessProbe", "startupProbe")}
    paths |= {p["path"] for p in m.of_kind("ServiceMonitor")[0]["spec"]["endpoints"]}
    paths.add(m.gateway["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
    (trigger,) = m.of_kind("ScaledObject")[0]["spec"]["triggers"]
    queried = set(re.findall(r"zeroserve:[a-z0-9_]+", trigger["metadata"]["query"]))
    assert "zeroserve:num_requests_waiting" in queried  # vLLM's name
    with GatewayServer() as server:
        worker = server.worker(reply=cyclic_reply("ab")).start()
        assert worker.ready.wait(5)
        statuses = {path: httpx.get(server.url + path, timeout=5).status_code for path in paths}
        exposed = exposed_names(httpx.get(server.url + "/metrics", timeout=5).text)
        worker.stop()
    assert statuses == dict.fromkeys(paths, 200)
    assert queried <= exposed, sorted(queried - exposed)


def test_the_kubernetes_page_applies_what_exists():
    section = (REPO_ROOT / "docs" / "deployment" / "kubernetes.md").read_text()
    for path in re.findall(r"deploy/kubernetes/[\w/.-]+", section):
        assert (REPO_ROOT / path.rstrip(".")).exists(), path
    assert load_yaml(KUBERNETES / "base" / "kustomization.yaml")


def test_the_second_model_overlay_adds_a_worker_group_the_gateway_serves(tmp_path):
    """overlays/second-model: a second StatefulSet whose workers announce `second`, a
    gateway that serves it (with an alias over both), its pods let through to the ZeroMQ
    ports, its keys made by secrets.sh, its command parsing."""
    import click

    from zeroserve.cli.harness import child_env, zeroserve_argv
    from zeroserve.cli.main import main

    m = Manifests("overlays/second-model")
    second = m.get("StatefulSet", "worker-second")
    worker = container(second)
    assert flag(worker["command"], "--served-model-name") == "second"
    assert flag(worker["command"], "--device") == "cpu"
    gateway = container(m.gateway)["command"]
    assert flag(gateway, "--add-model").split("=")[0] == "second"
    assert "second:" in flag(gateway, "--model-alias")
    # Its pods are not the first group's (no overlapping selectors), yet reach the plane.
    first = m.worker["spec"]["selector"]["matchLabels"]
    pod_labels = second["spec"]["template"]["metadata"]["labels"]
    assert not labels_match(first, pod_labels)
    policy = m.get("NetworkPolicy", "gateway")
    assert any(labels_match(peer["podSelector"]["matchLabels"], pod_labels)
               for rule in policy["spec"]["ingress"] for peer in rule.get("from", []))
    for command in (worker["command"], gateway):
        try:
            main.commands[command[1]].make_context(command[1], list(command[2:]))
        except click.ClickException as e:
            pytest.fail(f"{command}: {e.format_message()}")
    launcher = " ".join(zeroserve_argv("x")[:-1])
    result = subprocess.run([str(KUBERNETES / "secrets.sh"), str(tmp_path / "keys"), "1",
                             "worker-second-0"], env=child_env({"ZEROSERVE": launcher}),
                            cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "worker-second-0.key_secret" in result.stdout and "worker-0.key:" in result.stdout
