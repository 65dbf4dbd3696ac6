"""Kubernetes manifests rendered from the profiles.

    a3b-deploy [--out deploy/kubernetes] [--check]

One file per profile (`<profile>.yaml`) and a TLS variant (`<profile>-tls.yaml`):
Deployment (Triton health endpoints as readiness/liveness/startup probes,
non-root, /dev/shm sized for vLLM's workers, GPU requests from the profile),
Service with Prometheus scrape annotations, and for TLS the gRPC SSL flags plus
an Ingress terminating HTTPS with an authentication hook. Multi-node profiles
make the Deployment node 0 (server + engine, the rendezvous port on its
Service) and add a StatefulSet of the other nodes (scripts/vllm_node.sh, node
rank = pod index + 1).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import yaml

from a3b_backend.deploy.rendered import write_or_check
from a3b_backend.profiles import (DEFAULT_MASTER_PORT, MASTER_ADDR_ENV, MASTER_PORT_ENV, MODEL_DIR_ENV,
                                  NODE_RANK_ENV, PROFILE_ENV, PROFILES, PROJECT_ROOT, Profile, check_profile)

APP = "a3b-triton"
PORTS = {"http": 8000, "grpc": 8001, "metrics": 8002}
# The other nodes read their rank from this (the StatefulSet's pod index).
POD_INDEX_ENV = "A3B_POD_INDEX"
EXIT_TIMEOUT_S = 60
# scripts/serve.sh on SIGTERM: the drain (EXIT_TIMEOUT_S), Triton's own exit
# timeout after it (10 s), its kill grace (5 s), and a margin.
SHUTDOWN_BOUND_S = EXIT_TIMEOUT_S + 10 + 5 + 5
MODEL_MOUNT = "/models"
TLS_MOUNT = "/tls"
def _image(p: Profile) -> str:
    return f"{APP}:{'gpu' if p.gpus_per_node else 'cpu'}"


def _labels(p: Profile, role: str = "server") -> dict[str, str]:
    return {"app.kubernetes.io/name": APP, "app.kubernetes.io/instance": p.name, "app.kubernetes.io/component": role}


def _resources(p: Profile) -> dict[str, Any]:
    if not p.gpus_per_node:
        return {"requests": {"cpu": "2", "memory": "8Gi"}, "limits": {"memory": "12Gi"}}
    gpus = str(p.gpus_per_node)
    return {"requests": {"cpu": str(4 * p.gpus_per_node), "memory": f"{32 * p.gpus_per_node}Gi",
                         "nvidia.com/gpu": gpus},
            "limits": {"memory": f"{48 * p.gpus_per_node}Gi", "nvidia.com/gpu": gpus}}


def _volumes(p: Profile, tls: bool) -> tuple[list[dict], list[dict]]:
    # vLLM's multiprocess workers and NCCL exchange tensors through /dev/shm,
    # which container runtimes cap at 64 MiB unless given a memory volume.
    shm = f"{max(1, 2 * p.gpus_per_node)}Gi"
    volumes = [{"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm}}]
    mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    if p.gpus_per_node:
        volumes.append({"name": "models", "persistentVolumeClaim": {"claimName": f"{APP}-models", "readOnly": True}})
        mounts.append({"name": "models", "mountPath": MODEL_MOUNT, "readOnly": True})
    if tls:
        volumes.append({"name": "tls", "secret": {"secretName": f"{APP}-tls"}})
        mounts.append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
    return volumes, mounts


def _server_args() -> list[str]:
    """gRPC TLS, on top of what scripts/serve.sh (the image's entrypoint) sets:
    repository, ports, exit timeout and, from A3B_ADMIN_KEY, the restricted
    admin APIs."""
    return ["--grpc-use-ssl=true", f"--grpc-server-cert={TLS_MOUNT}/tls.crt",
            f"--grpc-server-key={TLS_MOUNT}/tls.key"]


def _probe(path: str, period: int, failures: int) -> dict[str, Any]:
    return {"httpGet": {"path": path, "port": "http"}, "periodSeconds": period, "failureThreshold": failures,
            "timeoutSeconds": 5}


def _node_env(p: Profile) -> list[dict[str, Any]]:
    """What every node of a profile shares: the profile and the model."""
    env = [{"name": PROFILE_ENV, "value": p.name}, {"name": "HF_HUB_OFFLINE", "value": "1"}]
    if p.gpus_per_node:
        env.insert(1, {"name": MODEL_DIR_ENV, "value": f"{MODEL_MOUNT}/{Path(p.model_dir).name}"})
    return env


def _env(p: Profile) -> list[dict[str, Any]]:
    env = [*_node_env(p),
           {"name": "A3B_EXIT_TIMEOUT", "value": str(EXIT_TIMEOUT_S)},
           # serve.sh puts Triton's admin APIs behind the header `admin-key`;
           # inference, health and metadata stay open (put authentication in front of them).
           {"name": "A3B_ADMIN_KEY", "valueFrom": {"secretKeyRef": {"name": f"{APP}-admin", "key": "key"}}}]
    if p.nodes > 1:
        # node 0 hosts the rendezvous (torch.distributed's store) on its own address
        env += [{"name": NODE_RANK_ENV, "value": "0"},
                {"name": MASTER_ADDR_ENV, "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
                {"name": MASTER_PORT_ENV, "value": str(DEFAULT_MASTER_PORT)}]
    return env


def _server_container(p: Profile, tls: bool) -> dict[str, Any]:
    _, mounts = _volumes(p, tls)
    ports = [{"name": n, "containerPort": port} for n, port in PORTS.items()]
    container: dict[str, Any] = {
        "name": "triton", "image": _image(p), "imagePullPolicy": "IfNotPresent",
        "env": _env(p), "ports": ports,
        # Model load (a 35B checkpoint from disk onto the GPUs) takes minutes:
        # the startup probe allows 30, then readiness/liveness take over.
        "startupProbe": _probe("/v2/health/ready", 10, 180),
        "readinessProbe": _probe("/v2/health/ready", 5, 3),
        "livenessProbe": _probe("/v2/health/live", 10, 6),
        "resources": _resources(p), "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    if tls:
        container["args"] = _server_args()
    if p.nodes > 1:
        ports.append({"name": "dist", "containerPort": DEFAULT_MASTER_PORT})
    return container


def _pod_spec(p: Profile, containers: list[dict], tls: bool) -> dict[str, Any]:
    volumes, _ = _volumes(p, tls)
    return {
        "securityContext": {"runAsNonRoot": True, "runAsUser": 1000, "runAsGroup": 1000, "fsGroup": 1000},
        "terminationGracePeriodSeconds": SHUTDOWN_BOUND_S,
        "containers": containers, "volumes": volumes,
    }


def manifests(p: Profile, tls: bool = False) -> list[dict[str, Any]]:
    name = f"{APP}-{p.name}"
    labels = _labels(p)
    scrape = {"prometheus.io/scrape": "true", "prometheus.io/port": str(PORTS["metrics"]),
              "prometheus.io/path": "/metrics"}
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            # One engine per pod; scale out with replicas (each holds the whole model).
            "replicas": 1, "selector": {"matchLabels": labels},
            "strategy": {"type": "Recreate"} if p.gpus_per_node else {"type": "RollingUpdate"},
            "template": {"metadata": {"labels": labels, "annotations": scrape},
                         "spec": _pod_spec(p, [_server_container(p, tls)], tls)},
        },
    }
    service_ports = [{"name": n, "port": port, "targetPort": n} for n, port in PORTS.items()]
    if p.nodes > 1:
        service_ports.append({"name": "dist", "port": DEFAULT_MASTER_PORT, "targetPort": "dist"})
    service = {"apiVersion": "v1", "kind": "Service",
               "metadata": {"name": name, "labels": labels, "annotations": scrape},
               "spec": {"selector": labels, "ports": service_ports}}
    out = [deployment, service]
    if p.nodes > 1:
        out.append(_other_nodes(p, name, tls))
    if tls:
        out.append(_ingress(p, name))
    return out


def _other_nodes(p: Profile, head: str, tls: bool) -> dict[str, Any]:
    """Nodes 1..nodes-1: vLLM's headless workers joining node 0's engine through its Service.
    After the handshake the nodes also reach each other's pod IPs on ports vLLM
    picks (its message queues): a NetworkPolicy must allow pod-to-pod traffic."""
    labels = _labels(p, "vllm-node")
    _, mounts = _volumes(p, tls)
    env = [*_node_env(p),
           {"name": POD_INDEX_ENV,
            "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['apps.kubernetes.io/pod-index']"}}},
           {"name": MASTER_ADDR_ENV, "value": head},
           {"name": MASTER_PORT_ENV, "value": str(DEFAULT_MASTER_PORT)}]
    node = {
        "name": "vllm-node", "image": _image(p), "imagePullPolicy": "IfNotPresent",
        "command": ["/opt/a3b/scripts/vllm_node.sh"],
        "env": env, "resources": _resources(p), "volumeMounts": mounts,
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
    }
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": {"name": f"{head}-node", "labels": labels},
            "spec": {"serviceName": head, "replicas": p.nodes - 1, "selector": {"matchLabels": labels},
                     "template": {"metadata": {"labels": labels}, "spec": _pod_spec(p, [node], tls)}}}


def _ingress(p: Profile, name: str) -> dict[str, Any]:
    # Triton's HTTP endpoint has no TLS of its own: HTTPS ends at the ingress,
    # which also asks an external auth service (e.g. oauth2-proxy) per request.
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress",
            "metadata": {"name": name, "labels": _labels(p), "annotations": {
                "nginx.ingress.kubernetes.io/auth-url": "http://oauth2-proxy.auth.svc.cluster.local/oauth2/auth",
                "nginx.ingress.kubernetes.io/proxy-buffering": "off",
                "nginx.ingress.kubernetes.io/proxy-read-timeout": "3600"}},
            "spec": {"ingressClassName": "nginx",
                     "tls": [{"hosts": [f"{name}.example.com"], "secretName": f"{APP}-tls"}],
                     "rules": [{"host": f"{name}.example.com", "http": {"paths": [{
                         "path": "/v2", "pathType": "Prefix",
                         "backend": {"service": {"name": name, "port": {"name": "http"}}}}]}}]}}


class _Dumper(yaml.SafeDumper):
    """Plain YAML: no &anchors for the label dicts the objects share."""

    def ignore_aliases(self, data: Any) -> bool:
        return True


def render() -> dict[str, str]:
    """File name -> YAML text, for every profile, plain and with TLS."""
    header = "# Rendered by `a3b-deploy` from a3b_backend/profiles.py; do not edit by hand.\n"
    files = {}
    for p in PROFILES.values():
        for tls in (False, True):
            docs = manifests(p, tls)
            files[f"{p.name}{'-tls' if tls else ''}.yaml"] = header + yaml.dump_all(docs, Dumper=_Dumper, sort_keys=False)
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=PROJECT_ROOT / "deploy" / "kubernetes")
    parser.add_argument("--check", action="store_true", help="fail on profile problems or stale manifests")
    args = parser.parse_args(argv)
    problems = [msg for p in PROFILES.values() for msg in check_profile(p)]
    stale = write_or_check({args.out / name: text for name, text in render().items()}, args.check)
    problems += [f"stale manifest {path} (run a3b-deploy)" for path in stale]
    for msg in problems:
        print(msg, file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
