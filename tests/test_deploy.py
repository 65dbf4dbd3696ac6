"""Deployment artefacts checked without Docker or a cluster: profiles consistent,
manifests rendered from them and valid against the Kubernetes schema,
Dockerfiles linted, compose publishing on loopback only."""
from __future__ import annotations

import dataclasses
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from a3b_backend.deploy import kubernetes
from a3b_backend.profiles import PROFILES, PROJECT_ROOT

BIN = Path(sys.executable).parent
MANIFESTS = sorted((PROJECT_ROOT / "deploy" / "kubernetes").glob("*.yaml"))
DOCKERFILES = sorted((PROJECT_ROOT / "docker").glob("Dockerfile.*"))
K8S_VERSION = "1.31.0"


def test_every_profile_is_consistent():
    assert {p: kubernetes.check_profile(PROFILES[p]) for p in PROFILES} == {p: [] for p in PROFILES}


@pytest.mark.parametrize("profile, change, problem", [
    ("a100x8", dict(tensor_parallel_size=4), "tensor_parallel_size*pipeline_parallel_size = 4 but the profile "
                                             "declares 8 GPUs x 1 nodes = 8"),
    ("h200", dict(max_model_len=300000), "max_model_len 300000 exceeds the model's context 262144"),
    ("multinode", dict(distributed_executor_backend="ray"), "2 nodes need distributed_executor_backend 'mp'"),
    ("multinode", dict(tensor_parallel_size=16, pipeline_parallel_size=1), "spans nodes"),
    ("cpu", dict(tensor_parallel_size=2), "a CPU profile runs one worker per node"),
    ("cpu-2node", dict(pipeline_parallel_size=1), "a CPU profile runs one worker per node"),
    ("h200", dict(kv_cache_dtype="int3"), "kv_cache_dtype 'int3'"),
])
def test_inconsistent_profiles_are_named(profile, change, problem):
    problems = kubernetes.check_profile(dataclasses.replace(PROFILES[profile], **change))
    assert any(problem in p for p in problems), problems


def test_committed_manifests_are_rendered_from_the_profiles():
    assert kubernetes.main(["--check"]) == 0, "run `a3b-deploy` and commit deploy/kubernetes"
    assert {m.name for m in MANIFESTS} == set(kubernetes.render())


def test_manifests_validate_against_the_kubernetes_schema(tmp_path):
    tool = BIN / "kubernetes-validate"
    done = subprocess.run([str(tool), "-k", K8S_VERSION, "--strict", *map(str, MANIFESTS)],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    # and the validator does catch a broken one
    broken = yaml.safe_load_all((PROJECT_ROOT / "deploy" / "kubernetes" / "h200.yaml").read_text())
    broken = list(broken)
    broken[0]["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"] = "eight thousand"
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump_all(broken))
    assert subprocess.run([str(tool), "-k", K8S_VERSION, "--strict", str(bad)], capture_output=True).returncode != 0


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_manifest_serves_the_profile_safely(name):
    profile = PROFILES[name]
    docs = list(yaml.safe_load_all((PROJECT_ROOT / "deploy" / "kubernetes" / f"{name}.yaml").read_text()))
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    triton = pod["containers"][0]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert triton["readinessProbe"]["httpGet"]["path"] == "/v2/health/ready"
    assert triton["livenessProbe"]["httpGet"]["path"] == "/v2/health/live"
    assert {p["containerPort"] for p in triton["ports"]} >= {8000, 8001, 8002}
    assert {"name": "A3B_PROFILE", "value": name} in triton["env"]
    gpus = triton["resources"]["limits"].get("nvidia.com/gpu")
    assert gpus == (str(profile.gpus_per_node) if profile.gpus_per_node else None)
    assert any(v.get("emptyDir", {}).get("medium") == "Memory" for v in pod["volumes"]), "/dev/shm volume"
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8002"
    admin_key = next(e for e in triton["env"] if e["name"] == "A3B_ADMIN_KEY")
    assert admin_key["valueFrom"]["secretKeyRef"]["name"] == "a3b-triton-admin"
    assert pod["terminationGracePeriodSeconds"] > int(
        next(e["value"] for e in triton["env"] if e["name"] == "A3B_EXIT_TIMEOUT")) + 10 + 5
    others = [d for d in docs if d["kind"] == "StatefulSet"]
    assert len(others) == (1 if profile.nodes > 1 else 0)
    if others:
        # node 0 hosts the rendezvous on its Service; the others find it there and take rank = pod index + 1
        assert others[0]["spec"]["replicas"] == profile.nodes - 1
        assert {"name": "A3B_NODE_RANK", "value": "0"} in triton["env"]
        service = next(d for d in docs if d["kind"] == "Service")
        assert {"name": "dist", "port": 29501, "targetPort": "dist"} in service["spec"]["ports"]
        node = others[0]["spec"]["template"]["spec"]["containers"][0]
        assert node["command"] == ["/opt/a3b/scripts/vllm_node.sh"]
        env = {e["name"]: e.get("value", e.get("valueFrom")) for e in node["env"]}
        assert env["A3B_MASTER_ADDR"] == service["metadata"]["name"] and env["A3B_PROFILE"] == name
        assert "pod-index" in env["A3B_POD_INDEX"]["fieldRef"]["fieldPath"]


def test_tls_variant_encrypts_grpc_and_terminates_https_at_the_ingress():
    docs = list(yaml.safe_load_all((PROJECT_ROOT / "deploy" / "kubernetes" / "h200-tls.yaml").read_text()))
    args = docs[0]["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--grpc-use-ssl=true" in args and "--grpc-server-cert=/tls/tls.crt" in args
    ingress = next(d for d in docs if d["kind"] == "Ingress")
    assert ingress["spec"]["tls"][0]["secretName"] == "a3b-triton-tls"
    assert "auth-url" in " ".join(ingress["metadata"]["annotations"])


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_lints_clean_and_runs_unprivileged(dockerfile):
    done = subprocess.run([str(BIN / "hadolint"), "--no-color", str(dockerfile)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    text = dockerfile.read_text()
    assert re.search(r"^USER 1000", text, re.M), "runs as a non-root user"
    assert re.search(r"^EXPOSE 8000 8001 8002$", text, re.M)
    assert ":latest" not in text and re.search(r"^(ARG \w+=|FROM )\S+:\S+", text, re.M), "pinned base image"
    assert "HF_HUB_OFFLINE=1" in text, "downloads nothing at run time"


def test_compose_publishes_on_loopback_only():
    compose = yaml.safe_load((PROJECT_ROOT / "docker" / "compose.yaml").read_text())
    for name, service in compose["services"].items():
        assert service["ports"] and all(p.startswith("127.0.0.1:") for p in service["ports"]), name
