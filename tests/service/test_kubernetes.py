"""deploy/kubernetes: rendered by a real tool, checked against the Kubernetes schema, and consistent.

Here: the tests that start one or two services or processes, or open sockets; the others are in
tests/unit/test_kubernetes.py.
"""

from __future__ import annotations

import copy
import shutil

import kubernetes_validate
import pytest

from tests.support.kube import find, rendered

K8S_VERSION = "1.32.0"  # the schema version checked against (kubernetes-validate ships it)




@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return rendered()




def test_kubectl_renders_the_kustomization():
    if not shutil.which("kubectl"):
        pytest.skip("no kubectl (Debian's kubectl / kubernetes-client package): the files are checked as they are")
    kinds = sorted((d["kind"], d["metadata"]["name"]) for d in rendered())
    assert kinds == sorted([("Namespace", "specserve"), ("Deployment", "draft"), ("Service", "draft"),
                            ("Deployment", "target"), ("Service", "target"), ("Deployment", "gateway"),
                            ("Service", "gateway"), ("Deployment", "frontend"), ("Service", "frontend"),
                            ("ServiceMonitor", "specserve")])


def test_objects_pass_the_kubernetes_schema(docs):
    checked = 0
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com"):
            continue  # a CRD (Prometheus Operator): checked by test_service_monitor_selects_the_services
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        checked += 1
    assert checked == 9
    broken = copy.deepcopy(find(docs, "Deployment", "target"))
    broken["spec"]["template"]["spec"]["containers"][0]["resourcez"] = {}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSION, strict=True)
