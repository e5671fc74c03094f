"""deploy/kubernetes renders, and what it renders is what Kubernetes and our processes accept.

Each overlay is rendered by ``kubectl kustomize`` (Debian's kubernetes-client: kustomize 2.0; newer
kubectl renders the same), and then, offline:

- every object validates strictly against the Kubernetes API schemas of the oldest and newest
  versions kubernetes-validate carries (the Prometheus operator's resources, which it has no schema
  for, are checked against what they refer to);
- every image is one docker/ builds; every flag a container passes is in its program's ``--help``;
  every port a flag names is a declared container port, every probe and Service names a declared
  port, every Service selects pods of a workload, every ``$(VAR)`` is defined;
- the PrometheusRule carries docker/prometheus/alerts.yml's groups as they are (one source).

``kubectl apply --dry-run=client`` needs an API server even so (it asks it for the API's schema),
so it is not run: the schemas above are the same ones.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
CRDS = {"ServiceMonitor", "PrometheusRule"}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet"}

kubectl = shutil.which("kubectl")
pytestmark = pytest.mark.skipif(kubectl is None, reason="no kubectl (Debian: apt install kubernetes-client)")


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    assert kubectl is not None
    done = subprocess.run(
        [kubectl, "kustomize", str(DEPLOY / "overlays" / overlay)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


def workloads(objects: tuple[dict[str, Any], ...]) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] in WORKLOADS]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    spec = workload["spec"]["template"]["spec"]
    return list(spec.get("initContainers", [])) + list(spec["containers"])


def versions() -> list[str]:
    from kubernetes_validate import utils

    every = sorted(utils.all_versions(), key=lambda v: tuple(int(x) for x in v.split(".")))
    return [every[0], every[-1]]


def test_there_are_overlays_for_a_trial_production_and_rdma() -> None:
    assert {"dev", "production", "rdma", "external-etcd"} <= set(OVERLAYS)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_object_validates_against_the_kubernetes_api_schemas(overlay: str) -> None:
    kubernetes_validate = pytest.importorskip("kubernetes_validate")
    objects = rendered(overlay)
    checked = 0
    for version in versions():
        for obj in objects:
            if obj["kind"] in CRDS:
                continue
            kubernetes_validate.validate(obj, version, strict=True)
            checked += 1
    assert checked >= 2 * 6
    # The checker itself: a misspelt field fails it (strict), as does a wrong type.
    daemonset = copy.deepcopy(next(o for o in objects if o["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, versions()[-1], strict=True)
    daemonset = copy.deepcopy(next(o for o in objects if o["kind"] == "DaemonSet"))
    daemonset["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "data"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(daemonset, versions()[-1], strict=True)


def built_images() -> set[str]:
    """The images docker/compose.yaml builds from docker/ (name without tag)."""
    compose = yaml.safe_load((ROOT / "docker" / "compose.yaml").read_text())
    names = set()
    for service in compose["services"].values():
        if "build" not in service and "<<" not in service:
            continue
        image = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", service.get("image") or compose["x-kvstore"]["image"])
        names.add(image.rsplit(":", 1)[0])
    return names


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_images_are_the_ones_docker_builds(overlay: str) -> None:
    built = built_images()
    assert {"kvstore", "kvstore-etcd"} <= built
    used = {c["image"].rsplit(":", 1)[0] for w in workloads(rendered(overlay)) for c in containers(w)}
    assert used and used <= built, used - built


@cache
def accepted_flags(program: str) -> frozenset[str]:
    """The long options ``program`` (``kvstore SUB`` or ``etcd``) prints in its --help."""
    if program == "etcd":
        etcd = shutil.which("etcd")
        if etcd is None:
            pytest.skip("no etcd (Debian: apt install etcd-server)")
        argv = [etcd, "--help"]
    else:
        argv = [sys.executable, "-m", "kvstore_cli", *program.split()[1:], "--help"]
    done = subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=ROOT)
    text = done.stdout + done.stderr
    assert done.returncode == 0 and "--" in text, text
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))


def program_of(container: dict[str, Any]) -> tuple[str, list[str]] | None:
    """The program a container runs, as accepted_flags names it, and its arguments."""
    if "command" in container:
        return None  # a shell step (an init container): no flags of ours
    image = container["image"].rsplit(":", 1)[0]
    args = list(container.get("args", []))
    if image == "kvstore":
        return f"kvstore {args[0]}", args[1:]
    if image == "kvstore-etcd":
        return "etcd", args
    raise AssertionError(f"unknown image {image}")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_flag_is_one_the_process_accepts(overlay: str) -> None:
    seen = 0
    for workload in workloads(rendered(overlay)):
        for container in containers(workload):
            found = program_of(container)
            if found is None:
                continue
            program, args = found
            accepted = accepted_flags(program)
            for arg in args:
                if arg.startswith("--"):
                    flag = arg.split("=", 1)[0]
                    assert flag in accepted, f"{workload['metadata']['name']}: {program} has no {flag}"
                    seen += 1
    assert seen > 10
    assert "--no-such-flag" not in accepted_flags("kvstore daemon")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_setting_passed_in_the_environment_is_one_the_process_takes(overlay: str) -> None:
    """KVSTORE_<COMPONENT>_* variables are settings: an unknown or malformed one stops the process."""
    from kvstore.config import ConductorConfig, DaemonConfig, MasterConfig, load

    models: dict[str, Any] = {"master": MasterConfig, "daemon": DaemonConfig, "conductor": ConductorConfig}
    for workload in workloads(rendered(overlay)):
        for container in containers(workload):
            found = program_of(container)
            if found is None or not found[0].startswith("kvstore "):
                continue
            component = found[0].split()[1]
            prefix = f"KVSTORE_{component.upper()}_"
            names = {e["name"] for e in container.get("env", [])}
            stray = {n for n in names if n.startswith("KVSTORE_") and not n.startswith(prefix)} - PROCESS_WIDE
            assert not stray, f"{workload['metadata']['name']}: {stray} are not settings of kvstore {component}"
            environ = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
            settings = {n: v for n, v in environ.items() if n.startswith(prefix)}
            load(models[component], component, settings, **_required(component))
    with pytest.raises(Exception, match="TENANT_FILE"):
        load(MasterConfig, "master", {"KVSTORE_MASTER_TENANT_FILE": "/x"})


PROCESS_WIDE = {"KVSTORE_CLUSTER_SECRET", "KVSTORE_ADMIN_TOKEN", "KVSTORE_TOKEN"}
"""Variables every kvstore process reads besides its settings (README, Authentication)."""


def _required(component: str) -> dict[str, Any]:
    """What the command line gives a component's config besides the environment."""
    return {"daemon": {"name": "n", "master": "127.0.0.1:50051"}, "conductor": {"openai": ["http://e:8000"]}}.get(
        component, {}
    )


PORT_FLAGS = re.compile(r"^--(?:port|admin-port|metrics-port|ucx-port)=(\d+)$|^--listen-[a-z]+-urls=.*:(\d+)$")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_ports_probes_services_and_variables_agree(overlay: str) -> None:
    objects = rendered(overlay)
    pods = []
    for workload in workloads(objects):
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert workload["spec"]["selector"]["matchLabels"].items() <= labels.items()
        ports: dict[str, int] = {}
        for container in containers(workload):
            named = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            numbers = set(named.values())
            ports.update(named)
            for arg in container.get("args", []):
                m = PORT_FLAGS.match(arg)
                if m:
                    assert int(m.group(1) or m.group(2)) in numbers, f"{arg}: not a port of {container['name']}"
            for probe in ("readinessProbe", "livenessProbe"):
                if probe in container:
                    action = container[probe].get("httpGet") or container[probe].get("tcpSocket")
                    assert action["port"] in named or action["port"] in numbers, (container["name"], probe)
            defined = {e["name"] for e in container.get("env", [])}
            if any(a.startswith("--ucx-port") for a in container.get("args", [])):
                # a daemon refuses to serve UCX with a cluster secret (UCX carries no authentication)
                assert "KVSTORE_CLUSTER_SECRET" not in defined, container["name"]
            for arg in container.get("args", []):
                for var in re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", arg):
                    assert var in defined, f"{container['name']}: $({var}) is not defined"
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("resourceFieldRef")
                if ref:
                    assert ref["containerName"] == container["name"]
        pods.append((labels, ports))
    services = [o for o in objects if o["kind"] == "Service"]
    assert services
    for service in services:
        selected = [ports for labels, ports in pods if service["spec"]["selector"].items() <= labels.items()]
        assert selected, f"Service {service['metadata']['name']} selects no pods"
        for port in service["spec"]["ports"]:
            assert all(port["targetPort"] in ports for ports in selected), (service["metadata"]["name"], port)


@pytest.mark.parametrize("overlay", [o for o in OVERLAYS if o != "dev"])
def test_the_prometheus_operator_resources_scrape_what_the_rules_expect(overlay: str) -> None:
    objects = rendered(overlay)
    services = {o["metadata"]["name"]: o for o in objects if o["kind"] == "Service"}
    monitors = [o for o in objects if o["kind"] == "ServiceMonitor"]
    rules = yaml.safe_load((ROOT / "docker" / "prometheus" / "alerts.yml").read_text())
    jobs = set(re.findall(r'job="([^"]+)"', (ROOT / "docker" / "prometheus" / "alerts.yml").read_text()))
    scraped = set()
    for monitor in monitors:
        wanted = monitor["spec"]["selector"]["matchLabels"]
        chosen = [s for s in services.values() if wanted.items() <= s["metadata"].get("labels", {}).items()]
        assert len(chosen) == 1, (monitor["metadata"]["name"], [s["metadata"]["name"] for s in chosen])
        (service,) = chosen
        names = {p["name"] for p in service["spec"]["ports"]}
        assert all(e["port"] in names for e in monitor["spec"]["endpoints"])
        scraped.add(service["metadata"]["name"])  # the operator's job label: the Service's name
    assert jobs == scraped
    # A master that authenticates answers /metrics only with a token: the operator's, from the Secret.
    (master,) = [w for w in workloads(objects) if w["metadata"]["name"] == "kvstore-master"]
    env = {e["name"]: e for e in master["spec"]["template"]["spec"]["containers"][0].get("env", [])}
    secret = env.get("KVSTORE_CLUSTER_SECRET", {}).get("valueFrom", {}).get("secretKeyRef", {})
    (masters_monitor,) = [m for m in monitors if m["metadata"]["name"] == "kvstore-masters"]
    (endpoint,) = masters_monitor["spec"]["endpoints"]
    if secret and not secret.get("optional", False):
        token = env["KVSTORE_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]
        assert endpoint["authorization"]["credentials"] == {"name": token["name"], "key": token["key"]}
    else:
        assert "authorization" not in endpoint
    (rule,) = [o for o in objects if o["kind"] == "PrometheusRule"]
    assert rule["spec"]["groups"] == rules["groups"], "run scripts/prometheus-rule.py after editing alerts.yml"
    if shutil.which("promtool"):
        path = Path(f"/tmp/kvstore-k8s-rules-{overlay}.yml")
        path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}))
        done = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
        path.unlink()
        assert done.returncode == 0 and "SUCCESS: 18 rules found" in done.stdout, done.stdout + done.stderr


def test_the_checked_in_rule_is_what_the_script_writes() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("prometheus_rule", ROOT / "scripts" / "prometheus-rule.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert (DEPLOY / "monitoring" / "prometheusrule.yaml").read_text() == module.rendered()


def test_the_production_overlay_requires_the_secret_and_reads_the_tenants_from_it() -> None:
    objects = rendered("production")
    for workload in workloads(objects):
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if container["image"].rsplit(":", 1)[0] != "kvstore":
                continue  # etcd
            env = {e["name"]: e for e in container.get("env", [])}
            ref = env["KVSTORE_CLUSTER_SECRET"]["valueFrom"]["secretKeyRef"]
            assert ref["name"] == "kvstore-auth" and ref["optional"] is False, workload["metadata"]["name"]
    (master,) = [o for o in objects if o["metadata"]["name"] == "kvstore-master" and o["kind"] == "StatefulSet"]
    (container,) = master["spec"]["template"]["spec"]["containers"]
    tenants = {e["name"]: e.get("value") for e in container["env"]}["KVSTORE_MASTER_TENANTS_FILE"]
    mount = next(m for m in container["volumeMounts"] if tenants.startswith(m["mountPath"] + "/"))
    volume = next(v for v in master["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "kvstore-auth"
    assert tenants.rsplit("/", 1)[1] in {i["path"] for i in volume["secret"]["items"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_process_finds_the_same_etcd_and_it_is_there(overlay: str) -> None:
    objects = rendered(overlay)
    endpoints = {
        e["value"]
        for w in workloads(objects)
        for c in containers(w)
        for e in c.get("env", [])
        if e["name"] == "ETCD_ENDPOINTS"
    }
    assert len(endpoints) == 1, endpoints
    (value,) = endpoints
    ours = [o for o in objects if o["metadata"]["name"] == "kvstore-etcd"]
    if overlay == "external-etcd":
        assert not ours and "kvstore-etcd" not in value
    else:
        assert {o["kind"] for o in ours} == {"StatefulSet", "Service"} and value == "kvstore-etcd:2379"
