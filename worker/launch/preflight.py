"""What `minibatch-serve` refuses before it starts anything, beyond what loading
its settings refuses: ports that overlap or are taken, worker timing its own settings
make unworkable, and CPU settings this CPU cannot run. Each refusal says what to
set instead."""

from __future__ import annotations

import ipaddress
import os
import socket
from collections.abc import Mapping

from protocol.endpoints import DEFAULT_HTTP_HOST, TcpEndpoint, check_endpoint_value
from protocol.settings import ConfigError, load
from protocol.stop_timing import FRONTEND_ANSWERS_LEFT_BEFORE_S, FRONTEND_STOP_GRACE_S
from worker.engine.fake_engine import FAKE_MODEL_NAME
from worker.launch.child import KILL_AFTER_S
from worker.launch.config import NO_WORKER_ENDPOINTS, SupervisorConfig
from worker.model.cpu_isa import check_aten_capability, chosen_isa
from worker.serve.config import WorkerConfig, is_listened_on, tcp_bind_address


def check_before_start(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Every check of the settings as loaded, in the order a user fixes them."""
    check_cpu_settings(environ)
    check_worker_timing(config, environ)
    check_worker_bind_reachable(config, environ)
    check_ports_apart(config, environ)
    check_no_worker_endpoints(config)
    check_worker_ports_free(config, environ)


# Where one is, torch may find a GPU, and a worker of DEVICE unset runs there,
# reading no KERNEL_ISA: NVIDIA's control device, AMD's compute device.
_GPU_DEVICE_FILES = ("/dev/nvidiactl", "/dev/kfd")


def _worker_config(environ: Mapping[str, str]) -> WorkerConfig | None:
    """The workers' settings, in this same environment; None where one is wrong
    in itself, for the worker to refuse, naming it."""
    try:
        return load(WorkerConfig, [], environ)
    except ConfigError:
        return None


def check_cpu_settings(environ: Mapping[str, str]) -> None:
    """Refuse a KERNEL_ISA or ATEN_CPU_CAPABILITY that this CPU cannot run, as a
    worker on the CPU would, but now: the worker refused it once torch and its
    model had loaded, 10 to 16 s after the frontend had come up and said it
    listened. A worker that may run on a GPU (DEVICE=cuda, or unset on a host
    with one) or that runs the fake engine reads neither: left to it."""
    worker = _worker_config(environ)
    if worker is None:
        return
    on_cpu = worker.device == "cpu" or (
        not worker.device and not any(map(os.path.exists, _GPU_DEVICE_FILES))
    )
    if on_cpu and worker.model_id != FAKE_MODEL_NAME:
        chosen_isa(environ)
        check_aten_capability(environ)


def _workers_bind(config: SupervisorConfig, environ: Mapping[str, str]) -> tuple[str, str]:
    """The setting and endpoint the first worker binds: WORKER_BIND if set, else
    WORKER_ENDPOINT (the others bind the next ports, or numbered ipc paths)."""
    bind = environ.get("WORKER_BIND", "")
    return ("WORKER_BIND", bind) if bind else ("WORKER_ENDPOINT", config.worker_endpoint)


def check_worker_bind_reachable(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse a WORKER_BIND that this stack's frontends, which connect to
    WORKER_ENDPOINT, cannot reach: another port or socket path, or an address
    that is not WORKER_ENDPOINT's host's, nor a wildcard of its family (``*`` and
    0.0.0.0 bind IPv4's addresses alone, ``[::]`` IPv6's). The stack came up and
    never became ready, without a word. A WORKER_BIND that is no endpoint at all
    is refused as the worker would refuse it."""
    bind = environ.get("WORKER_BIND", "")
    if not bind:
        return
    check_endpoint_value(bind, "WORKER_BIND")
    tcp_bind, tcp_endpoint = TcpEndpoint.parse(bind), TcpEndpoint.parse(config.worker_endpoint)
    if tcp_bind is not None and tcp_endpoint is not None:
        if tcp_bind.port == tcp_endpoint.port and _binds_for(tcp_bind.host, tcp_endpoint.host):
            return
    elif _same_socket_file(bind, config.worker_endpoint, config.num_workers == 1):
        return
    if tcp_endpoint is not None:
        wildcard = "[::]" if tcp_endpoint.is_ipv6 else "*"
        fix = f"tcp://{wildcard}:{tcp_endpoint.port} binds it on every address"
    else:
        fix = f"set it to {config.worker_endpoint}, or unset it"
    raise ConfigError(
        f"WORKER_BIND={bind} is not where this stack's frontends connect "
        f"(WORKER_ENDPOINT={config.worker_endpoint}): bind the same port or path ({fix})"
    )


def _same_socket_file(bind: str, endpoint: str, follows_endpoint_link: bool) -> bool:
    """Two ipc endpoints naming one socket file, however its directory is written
    (``/run/./w.sock``, a link to the directory); else the same text. The bind's
    own last part is taken as written (binding replaces a link there with a
    socket of its own); the endpoint's is followed if ``follows_endpoint_link``
    (connecting follows a link, but the numbered paths of several workers beside
    it are no links)."""
    ipc = "ipc://"
    if not (bind.startswith(ipc) and endpoint.startswith(ipc)):
        return bind == endpoint
    paths = [bind.removeprefix(ipc), endpoint.removeprefix(ipc)]
    if any(path.startswith("@") for path in paths):  # Linux's abstract names: no file
        return paths[0] == paths[1]
    bind_file, endpoint_file = (
        os.path.join(os.path.realpath(os.path.dirname(path)), os.path.basename(path))
        for path in paths
    )
    if follows_endpoint_link and bind_file == os.path.realpath(paths[1]):
        return True
    return bind_file == endpoint_file


def _binds_for(bind_host: str, endpoint_host: str) -> bool:
    """Whether a listener on ``bind_host`` is reached at ``endpoint_host``: an
    address in common, or a wildcard of its family. A host that does not resolve
    is left for the bind or the connect to refuse."""
    bound = _bind_addresses("0.0.0.0" if bind_host == "*" else bind_host)
    reached = _bind_addresses(endpoint_host)
    if not bound or not reached:
        return True
    return any(
        a.version == b.version and (a == b or a.is_unspecified) for a in bound for b in reached
    )


def check_ports_apart(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse frontend ports (PORT and the next NUM_FRONTENDS - 1) that overlap the
    workers' (WORKER_BIND's if set, else WORKER_ENDPOINT's, and the next
    NUM_WORKERS - 1) on one address: whichever binds second fails, and the first,
    taken for the other kind, made the frontends give CURVE advice and a worker
    blame "another program". Hosts are looked up only for ports in common."""
    name, endpoint = _workers_bind(config, environ)
    first = TcpEndpoint.parse(endpoint)
    if first is None:
        return
    http_ports = range(config.port, config.port + config.num_frontends)
    worker_ports = range(first.port, first.port + config.num_workers)
    shared = sorted(set(http_ports) & set(worker_ports))
    http_host = environ.get("HOST", DEFAULT_HTTP_HOST)  # the frontends' own setting
    if shared and _same_address(first.host, http_host):
        raise ConfigError(
            f"the frontends' ports (PORT={config.port}, NUM_FRONTENDS={config.num_frontends}: "
            f"{http_ports.start}-{http_ports.stop - 1}) and the workers' "
            f"({name}={endpoint}, NUM_WORKERS={config.num_workers}: "
            f"{worker_ports.start}-{worker_ports.stop - 1}) share port {shared[0]}: move "
            "one range clear of the other"
        )


def check_worker_ports_free(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse worker ports another program listens on before anything starts: the
    frontends, which start at once, served through another stack's worker there
    for the 8 s until this stack's own worker failed to bind."""
    name, endpoint = _workers_bind(config, environ)
    first = tcp_bind_address(endpoint)
    if first is None:
        return
    host, first_port = first
    for port in range(first_port, first_port + config.num_workers):
        if is_listened_on(host, port):
            raise ConfigError(
                f"port {port} of the workers' ({name}={endpoint}, NUM_WORKERS="
                f"{config.num_workers}) is taken by another program, perhaps another "
                f"stack's worker: set {name} to a free address"
            )


def _same_address(worker_host: str, http_host: str) -> bool:
    """Whether listeners on these hosts could want one socket: an address in
    common, or a wildcard of the other's family. Each is read as binding reads it
    (``127.1``, ``0``, ``::0``; a ZMQ ``*`` is IPv4's wildcard); a host that does
    not resolve is left for binding to refuse."""
    worker = _bind_addresses("0.0.0.0" if worker_host == "*" else worker_host)
    http = _bind_addresses(http_host)
    return any(
        a.version == b.version and (a == b or a.is_unspecified or b.is_unspecified)
        for a in worker
        for b in http
    )


def _bind_addresses(host: str) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    name = host.strip("[]")
    if not name:
        return []  # HOST="", which the frontend refuses, naming it
    try:
        infos = socket.getaddrinfo(name, 0, flags=socket.AI_PASSIVE, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return []
    addresses = []
    for *_, sockaddr in infos:
        address = ipaddress.ip_address(str(sockaddr[0]).split("%")[0])
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
            address = address.ipv4_mapped
        addresses.append(address)
    return addresses


# When frontends stopped alongside the workers answer what is left themselves.
_FRONTENDS_ANSWER_LEFT_AT_S = FRONTEND_STOP_GRACE_S - FRONTEND_ANSWERS_LEFT_BEFORE_S
# The longest STOP_GRACE_S: a worker's hand-back at its end (a step may run a
# second past it) must reach those frontends before then, and the worker must
# not be killed (KILL_AFTER_S) before it is sent.
MAX_STOP_GRACE_S = min(_FRONTENDS_ANSWER_LEFT_AT_S, KILL_AFTER_S) - 1.0


def check_worker_timing(config: SupervisorConfig, environ: Mapping[str, str]) -> None:
    """Refuse timing the workers' settings, in this same environment, make
    unworkable with the supervisor's: it would declare a live worker dead between
    two heartbeats, again and again."""
    worker = _worker_config(environ)
    if worker is None:
        return
    problems = config.timing_problems(worker.heartbeat_interval_s, worker.frontend_timeout_s)
    if worker.stop_grace_s > MAX_STOP_GRACE_S:
        problems.append(
            f"STOP_GRACE_S={worker.stop_grace_s:g} is more than {MAX_STOP_GRACE_S:g}: "
            "frontends stopped with the workers answer what is left "
            f"{_FRONTENDS_ANSWER_LEFT_AT_S:g} s into their stop, "
            f"and minibatch-serve kills a worker {KILL_AFTER_S:g} s after asking it to stop, "
            "so what it hands back later is lost; lower STOP_GRACE_S"
        )
    if problems:
        raise ConfigError("; ".join(problems))


def check_no_worker_endpoints(config: SupervisorConfig) -> None:
    """WORKER_ENDPOINTS, which --help lists among a frontend's settings, was
    silently overridden: refused, saying where the workers are."""
    if config.worker_endpoints.strip():
        raise ConfigError(NO_WORKER_ENDPOINTS)
