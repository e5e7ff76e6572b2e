"""deploy/: the Kubernetes overlays, the compose file and the Dockerfiles, checked without a cluster or a daemon.

Every overlay is rendered with ``kubectl kustomize`` and every object validated against the Kubernetes schemas
offline (``kubernetes-validate``); every container's command is parsed by splitserve's own argument parser, with
its ``$(VAR)`` references expanded from the ConfigMap; probe, Service and metrics ports agree with the flags; and
the metric names the autoscalers, the adapter rules and the Grafana dashboard use, and the health services the
probes ask for, exist in what a real cluster serves (started here and scraped).
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import grpc
import kubernetes_validate
import pytest
import yaml
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.cli import build_parser
from splitserve.engine.config import DEFAULT_STEP_LIMITS
from tests.cluster_helpers import wait_until
from tests.e2e.test_metrics import scrape

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
OVERLAYS = ("cpu", "gpu", "lora")
KUBERNETES_VERSION = "1.32.0"
POD_IP = "10.1.2.3"
WORKER_SERVICES = {"router": "splitserve.v1.Inference", "prefill": "splitserve.v1.PrefillWorker",
                   "decode": "splitserve.v1.DecodeWorker"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not on the PATH, so the overlays cannot be rendered here")
    objects = {}
    for overlay in OVERLAYS:
        result = subprocess.run(["kubectl", "kustomize", str(DEPLOY / "k8s" / "overlays" / overlay)],
                                capture_output=True, text=True, timeout=60)
        assert result.returncode == 0, result.stderr
        objects[overlay] = [obj for obj in yaml.safe_load_all(result.stdout) if obj]
    return objects


def _of_kind(objects: list[dict], kind: str) -> list[dict]:
    return [obj for obj in objects if obj["kind"] == kind]


def _splitserve_containers(objects: list[dict]):
    """(deployment, container, args with $(VAR) expanded) of every container running splitserve."""
    config = _of_kind(objects, "ConfigMap")[0]["data"]
    for deployment in _of_kind(objects, "Deployment"):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if "splitserve" not in container["image"]:
                continue
            env = {**config, "POD_IP": POD_IP}
            args = [re.sub(r"\$\((\w+)\)", lambda match, env=env: env[match.group(1)], arg)
                    for arg in container["args"]]
            yield deployment, container, args


def _flag(args: list[str], name: str) -> str | None:
    return args[args.index(name) + 1] if name in args else None


def test_every_object_is_valid_against_the_kubernetes_schemas(rendered):
    for objects in rendered.values():
        kinds = sorted(obj["kind"] for obj in objects)
        assert kinds.count("HorizontalPodAutoscaler") == 3 and kinds.count("PodDisruptionBudget") == 3, kinds
        for obj in objects:
            kubernetes_validate.validate(obj, KUBERNETES_VERSION, strict=True)


def test_every_container_command_parses_and_its_ports_and_probes_agree(rendered):
    parser = build_parser()
    for overlay, objects in rendered.items():
        services = _of_kind(objects, "Service")
        for deployment, container, args in _splitserve_containers(objects):
            parsed = parser.parse_args(args)  # argparse exits (SystemExit) on a flag it does not know
            assert parsed.handler is not None
            ports = {port["name"]: port["containerPort"] for port in container["ports"]}
            command = args[0]
            template = deployment["spec"]["template"]
            assert parsed.metrics_port == ports["metrics"], (overlay, command)
            assert template["metadata"]["annotations"]["prometheus.io/port"] == str(ports["metrics"])
            if command == "gateway":  # a pod of its own, in front of the router's Service
                assert parsed.port == ports["http"] and parsed.router == "splitserve-router:50051"
                assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": "http"}
                assert template["spec"]["terminationGracePeriodSeconds"] > container["lifecycle"]["preStop"]["sleep"]["seconds"]
                assert not container.get("volumeMounts"), "the gateway holds no secret"
                continue
            assert parsed.port == ports["grpc"], (overlay, command)
            assert container["livenessProbe"]["grpc"] == {"port": ports["grpc"]}  # liveness: the server, ""
            assert container["readinessProbe"]["grpc"] == {"port": ports["grpc"], "service": WORKER_SERVICES[command]}
            grace = template["spec"]["terminationGracePeriodSeconds"]
            pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
            assert grace >= pre_stop + parsed.drain_timeout + 5, (command, grace)
            if command in ("prefill", "decode"):
                assert parsed.host == POD_IP and parsed.router == "splitserve-router:50051"
                if overlay == "gpu":  # GPU to GPU over NCCL, not through both pods' host memory
                    assert parsed.kv_transfer == "p2p", command
                if parsed.kv_transfer == "p2p":  # the rendezvous binds the pod's address
                    assert parsed.kv_address in ("", POD_IP), (overlay, command)
                # The lora overlay's workers serve the adapters' volume, mounted read-only where --lora-dir says.
                assert parsed.lora_dir == ("/adapters" if overlay == "lora" else None), (overlay, command)
                if parsed.lora_dir:
                    mount = next(m for m in container["volumeMounts"] if m["mountPath"] == parsed.lora_dir)
                    volume = next(v for v in template["spec"]["volumes"] if v["name"] == mount["name"])
                    assert mount["readOnly"] and volume["persistentVolumeClaim"]["readOnly"]
                    claim = volume["persistentVolumeClaim"]["claimName"]
                    assert claim in [c["metadata"]["name"] for c in _of_kind(objects, "PersistentVolumeClaim")]
                router_service = next(s for s in services if s["metadata"]["name"] == "splitserve-router")
                assert 50051 in [port["port"] for port in router_service["spec"]["ports"]]
        for service in services:  # every Service's target port is a named port of the pods it selects
            selector = service["spec"]["selector"]
            pods = [d for d in _of_kind(objects, "Deployment")
                    if d["spec"]["template"]["metadata"]["labels"].items() >= selector.items()]
            names = {port["name"] for d in pods for c in d["spec"]["template"]["spec"]["containers"]
                     for port in c["ports"]}
            assert pods and {port["targetPort"] for port in service["spec"]["ports"]} <= names, service


def test_step_limits_match_the_device_and_the_prefill_autoscaler_follows_them(rendered):
    """The gpu overlay's workers take the engine's step limits on CUDA (the base, its CPU ones), and the prefill
    autoscaler's target is two steps of the prefill workers' budget on either."""
    parser = build_parser()
    for overlay, objects in rendered.items():
        device = "cuda" if overlay == "gpu" else "cpu"
        seqs, tokens = DEFAULT_STEP_LIMITS[device]
        budgets = []
        for _deployment, _container, args in _splitserve_containers(objects):
            parsed = parser.parse_args(args)
            if args[0] == "decode":
                assert parsed.max_num_seqs == seqs, overlay
            if args[0] == "prefill":
                assert parsed.max_num_batched_tokens == tokens, overlay
                budgets.append(parsed.max_num_batched_tokens)
        [hpa] = [h for h in _of_kind(objects, "HorizontalPodAutoscaler") if h["metadata"]["name"] == "splitserve-prefill"]
        [metric] = [m for m in hpa["spec"]["metrics"] if m["pods"]["metric"]["name"] == "splitserve_worker_queued_prompt_tokens"]
        assert budgets and int(metric["pods"]["target"]["averageValue"]) == 2 * budgets[0], overlay


def test_the_compose_file_and_dockerfiles():
    compose = yaml.safe_load((DEPLOY / "docker-compose.yml").read_text())
    parser = build_parser()
    commands = {name: service["command"] for name, service in compose["services"].items()
                if service.get("image", "").startswith("splitserve")}
    assert set(commands) == {"router", "gateway", "prefill", "decode"}
    for command in commands.values():
        parser.parse_args(command)
    assert {"redis"} <= compose["services"].keys()
    for name in ("Dockerfile.cpu", "Dockerfile.cuda"):
        text = (DEPLOY / "docker" / name).read_text()
        assert len(re.findall(r"^FROM ", text, re.M)) >= 2, f"{name} is multi-stage"
        [user] = re.findall(r"^USER (\S+)", text, re.M)
        assert user not in ("root", "0"), name
        assert re.search(r"^HEALTHCHECK .*\n.*splitserve health", text, re.M), name
        assert "prepare-model" in text, f"{name} converts the default model at build time"
        # The image the workers run in compiles at run time: the C++ kernels on CPU, Triton's launcher on CUDA,
        # both with a C compiler against Python's headers (the python images carry them; Ubuntu's need -dev).
        runtime = text[text.rindex("\nFROM "):]
        assert "g++" in runtime, name
        if "ubuntu" in runtime.split("\n")[1]:
            assert "python3-dev" in runtime, f"{name}: Triton's launcher needs Python.h"


def _metric_names_used(rendered) -> set[str]:
    """Every splitserve_* name the HPAs, the adapter rules and the dashboard refer to."""
    used = set()
    for objects in rendered.values():
        for hpa in _of_kind(objects, "HorizontalPodAutoscaler"):
            used |= {metric["pods"]["metric"]["name"] for metric in hpa["spec"]["metrics"] if metric["type"] == "Pods"}
    rules = yaml.safe_load((DEPLOY / "prometheus-adapter" / "rules.yaml").read_text())["rules"]
    used |= {re.match(r"(\w+)\{", rule["seriesQuery"]).group(1) for rule in rules}
    dashboard = json.loads((DEPLOY / "grafana" / "splitserve-dashboard.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel.get("targets", [])]
    used |= {name for expr in exprs for name in re.findall(r"\bsplitserve_\w+", expr)}
    return used


def test_metric_names_and_health_services_exist_in_a_running_cluster(rendered, shared_cluster):
    """On the e2e tier's shared cluster (tests/e2e/conftest.py: every process serves its metrics)."""
    used = _metric_names_used(rendered)
    assert {"splitserve_worker_queued_prompt_tokens", "splitserve_worker_kv_block_usage_ratio"} <= used
    served = set()
    for process in [shared_cluster.router, *shared_cluster.workers]:
        url = wait_until(lambda process=process: re.search(r"Prometheus metrics on (\S+/metrics)", process.log()),
                         30, message="metrics URL logged").group(1)
        served |= {name for name, _ in scrape(url)}
        service = WORKER_SERVICES[re.sub(r"\d+$", "", process.name)]
        with grpc.insecure_channel(process.address) as channel:  # health needs no credentials
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service),
                                                              timeout=10)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING, (process.name, service)
    assert used <= served, f"named in deploy/ but served by no process: {sorted(used - served)}"
