"""deploy/k8s/, checked offline: every manifest validates against the Kubernetes
schema (kubernetes-validate bundles it), every command is this project's, and
the pieces fit together (Service names, ports, probes, settings, the HF cache)."""

from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from frontend.config import FrontendConfig
from tests.test_compose import CONSOLE_SCRIPTS, dockerfile_instructions
from worker.serve.config import WorkerConfig

MANIFESTS = sorted((Path(__file__).resolve().parent.parent / "deploy" / "k8s").glob("*.yaml"))


def documents() -> list[dict[str, Any]]:
    return [doc for path in MANIFESTS for doc in yaml.safe_load_all(path.read_text()) if doc]


def resource(kind: str, name: str) -> dict[str, Any]:
    (found,) = [d for d in documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return found


def container(name: str) -> dict[str, Any]:
    pod = resource("Deployment", f"minibatch-{name}")["spec"]["template"]["spec"]
    (found,) = pod["containers"]
    return dict(found)


def env(name: str) -> dict[str, str]:
    return {item["name"]: item["value"] for item in container(name)["env"]}


@pytest.mark.parametrize("doc", documents(), ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_manifest_validates_against_the_kubernetes_schema(doc: dict[str, Any]) -> None:
    kubernetes_validate.validate(doc, latest_version(), strict=True)


def _commands(doc: dict[str, Any]) -> list[list[str]]:
    """Every command a pod of ``doc`` runs: its containers' and their exec probes'."""
    if doc["kind"] != "Deployment":
        return []
    commands = []
    for spec in doc["spec"]["template"]["spec"]["containers"]:
        commands.append(spec["command"])
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            if "exec" in spec.get(probe, {}):
                commands.append(spec[probe]["exec"]["command"])
    return commands


@pytest.mark.parametrize("command", [c for d in documents() for c in _commands(d)], ids=str)
def test_every_command_is_a_console_script_of_this_project(command: list[str]) -> None:
    assert command[0] in CONSOLE_SCRIPTS, f"{command[0]} is not in pyproject's scripts"
    module_name, _, function_name = CONSOLE_SCRIPTS[command[0]].partition(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


@pytest.mark.parametrize("name", ["worker", "frontend"])
def test_deployments_select_their_own_pods(name: str) -> None:
    deployment = resource("Deployment", f"minibatch-{name}")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"] == labels
    assert resource("Service", f"minibatch-{name}")["spec"]["selector"] == labels


def test_frontends_find_every_worker_through_the_headless_service() -> None:
    service = resource("Service", "minibatch-worker")["spec"]
    assert service["clusterIP"] == "None"
    endpoint = urlsplit(env("frontend")["WORKER_ENDPOINT"])
    assert endpoint.hostname == "minibatch-worker"
    (port,) = service["ports"]
    assert endpoint.port == port["port"]
    (container_port,) = container("worker")["ports"]
    assert port["targetPort"] == container_port["name"]
    assert env("worker")["WORKER_BIND"] == f"tcp://*:{container_port['containerPort']}"


def test_probes_are_the_protocol_probe_and_the_http_checks() -> None:
    worker, frontend = container("worker"), container("frontend")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        command = worker[probe]["exec"]["command"]
        assert command[0] == "minibatch-probe"
        # The probe's own timeout ends first, so that its message is what is logged.
        assert float(command[command.index("--timeout-s") + 1]) < worker[probe]["timeoutSeconds"]
    assert frontend["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert frontend["livenessProbe"]["httpGet"]["path"] == "/health"
    http_port = int(env("frontend")["PORT"])
    assert frontend["ports"] == [{"name": "http", "containerPort": http_port}]


@pytest.mark.parametrize(
    ("name", "config"), [("worker", WorkerConfig), ("frontend", FrontendConfig)]
)
def test_settings_are_ones_the_process_reads(name: str, config: type[Any]) -> None:
    known = {f.metadata["env"] for f in dataclasses.fields(config)}
    unknown = set(env(name)) - known
    assert not unknown, f"{name} sets variables its config never reads: {sorted(unknown)}"


def test_workers_request_the_cores_their_threads_use() -> None:
    worker = container("worker")
    assert int(env("worker")["TORCH_THREADS"]) == int(worker["resources"]["requests"]["cpu"])
    for name in ("worker", "frontend"):
        assert {"cpu", "memory"} <= set(container(name)["resources"]["requests"])


def test_the_hf_cache_is_mounted_at_the_images_hf_home() -> None:
    hf_home = next(
        re.search(r"HF_HOME=(\S+)", args).group(1)  # type: ignore[union-attr]
        for keyword, args in dockerfile_instructions("worker")
        if keyword == "ENV" and "HF_HOME=" in args
    )
    (mount,) = container("worker")["volumeMounts"]
    assert mount["mountPath"] == hf_home
    pod = resource("Deployment", "minibatch-worker")["spec"]["template"]["spec"]
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    claim = volume["persistentVolumeClaim"]["claimName"]
    assert resource("PersistentVolumeClaim", claim)["spec"]["accessModes"] == ["ReadWriteMany"]
