"""deploy/kubernetes: rendered by a real tool, checked against the Kubernetes schema, and consistent.

- `kubectl kustomize` renders the kustomization offline (skipped where kubectl is not installed;
  the files are then read as they are);
- every built-in object passes kubernetes-validate's strict check against the Kubernetes API
  schema (an unknown field fails it: shown on a broken copy);
- the target replicas sit behind a headless Service, the name the gateway resolves with
  --discover-targets; the target requests a GPU; the ServiceMonitor selects Services that exist and
  ports they name; every SPECSERVE_* variable is one the services read;
- the front ends' Deployment connects to the gateway's link: the address it is given is the gateway
  Service's `link` port, the port the gateway listens on for front ends.

Here: the tests that start no process and open no socket; the others are in tests/service/test_kubernetes.py.
"""

from __future__ import annotations

import pytest

from tests.support.compose import known_variables
from tests.support.kube import find, rendered


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return rendered()




def env_of(deployment: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_targets_are_found_through_a_headless_service(docs):
    target_svc = find(docs, "Service", "target")
    assert target_svc["spec"]["clusterIP"] == "None"
    gateway = env_of(find(docs, "Deployment", "gateway"))
    host, port = gateway["SPECSERVE_GATEWAY_TARGET"].split(":")
    assert host == "target" and int(port) in [p["port"] for p in target_svc["spec"]["ports"]]
    assert gateway["SPECSERVE_GATEWAY_DISCOVER_TARGETS"] == "1"
    target = find(docs, "Deployment", "target")
    assert target["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert env_of(target)["SPECSERVE_TARGET_PORT"] == port
    for d in docs:
        if d["kind"] == "Deployment":
            unknown = {k for k in env_of(d) if k.startswith("SPECSERVE_")} - known_variables()
            assert not unknown, (d["metadata"]["name"], unknown)


def test_service_monitor_selects_the_services(docs):
    monitor = find(docs, "ServiceMonitor", "specserve")
    selector = monitor["spec"]["selector"]["matchLabels"]
    services = [d for d in docs if d["kind"] == "Service"
                and selector.items() <= d["metadata"].get("labels", {}).items()]
    assert {s["metadata"]["name"] for s in services} == {"gateway", "draft", "target"}
    ports = {p["name"] for s in services for p in s["spec"]["ports"]}
    assert {e["port"] for e in monitor["spec"]["endpoints"]} <= ports


def test_frontends_connect_to_the_gateways_link(docs):
    frontend, gateway = env_of(find(docs, "Deployment", "frontend")), env_of(find(docs, "Deployment", "gateway"))
    host, port = frontend["SPECSERVE_GATEWAY_FRONTEND_OF"].split(":")
    service = find(docs, "Service", "gateway")
    link = next(p for p in service["spec"]["ports"] if p["name"] == "link")
    assert host == "gateway" and int(port) == link["port"]
    assert gateway["SPECSERVE_GATEWAY_FRONTEND_LINK"].split(":")[1] == port
    container = find(docs, "Deployment", "gateway")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "link", "containerPort": int(port)} in container["ports"]
    clients = find(docs, "Service", "frontend")
    assert clients["spec"]["selector"] == find(docs, "Deployment", "frontend")["spec"]["selector"]["matchLabels"]
