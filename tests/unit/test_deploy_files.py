"""The deployment files: systemd unit, example environment file, Kubernetes manifests."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ibex import config
from ibex.config import PREFIX, Settings, load_settings, parse_duration
from ibex.service.root import drain_grace, effective_settings
from ibex.service.startup_checks import check_bind_policy

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
UNIT = DEPLOY / "systemd" / "ibex-context.service"
ENV_EXAMPLE = DEPLOY / "ibex-context.env.example"
KUBE = DEPLOY / "kubernetes"
MANIFESTS = sorted(p for p in KUBE.glob("*.yaml") if p.name != "kustomization.yaml")
KINDS = {
    "ConfigMap",
    "Secret",
    "Deployment",
    "Service",
    "HorizontalPodAutoscaler",
    "PodDisruptionBudget",
    "NetworkPolicy",
}


# --------------------------------------------------------------------------- systemd


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Sections to key to values; systemd keys may repeat, so values are lists."""
    sections: dict[str, dict[str, list[str]]] = {}
    current: dict[str, list[str]] | None = None
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], {})
            continue
        assert current is not None, f"assignment outside a section: {line!r}"
        key, sep, value = line.partition("=")
        assert sep, f"not an assignment: {line!r}"
        current.setdefault(key.strip(), []).append(value.strip())
    return sections


REQUIRED_SERVICE = {
    "Type": "notify",
    "NotifyAccess": "main",
    "ExecStart": "/opt/ibex/.venv/bin/ibex serve --env-file %t/ibex/context.env",
    "WatchdogSec": "10",
    "Restart": "on-failure",
    "RestartSec": "1",
    "TimeoutStopSec": "30",
    "KillSignal": "SIGTERM",
    "KillMode": "mixed",
    "DynamicUser": "yes",
    "ProtectSystem": "strict",
    "ProtectHome": "yes",
    "PrivateTmp": "yes",
    "PrivateDevices": "yes",
    "NoNewPrivileges": "yes",
    "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
    "SystemCallArchitectures": "native",
    "ProtectKernelTunables": "yes",
    "ProtectKernelModules": "yes",
    "ProtectKernelLogs": "yes",
    "ProtectControlGroups": "yes",
    "ProtectClock": "yes",
    "ProtectHostname": "yes",
    "RestrictNamespaces": "yes",
    "RestrictRealtime": "yes",
    "RestrictSUIDSGID": "yes",
    "LockPersonality": "yes",
    "MemoryDenyWriteExecute": "yes",
    "CapabilityBoundingSet": "",
    "UMask": "0077",
    "RuntimeDirectory": "ibex",
    "LimitNOFILE": "65536",
}


def test_unit_has_the_required_settings() -> None:
    unit = parse_unit(UNIT.read_text())
    service = unit["Service"]
    for key, value in REQUIRED_SERVICE.items():
        assert service.get(key) == [value], key
    assert "@system-service" in service["SystemCallFilter"]
    # Metrics of all workers meet in the runtime directory systemd creates.
    assert "PROMETHEUS_MULTIPROC_DIR=%t/ibex" in service["Environment"]
    assert unit["Install"]["WantedBy"] == ["multi-user.target"]


def test_unit_reloads_with_the_env_file_as_it_is_then() -> None:
    """systemctl reload: root copies the root-only env file for the dynamic user, as at
    start, then SIGHUP to the supervisor, which reads that copy (--env-file) again."""
    service = parse_unit(UNIT.read_text())["Service"]
    copy = [
        "+/usr/bin/install -m 0400 /etc/ibex/context.env %t/ibex/context.env",
        "+/bin/chown --reference=%t/ibex %t/ibex/context.env",
    ]
    assert service["ExecStartPre"] == copy
    assert service["ExecReload"] == [*copy, "/bin/kill -HUP $MAINPID"]
    # The copy is what the daemon reads; systemd itself does not load the file, or a
    # line removed from it would outlive the reload in the service's environment.
    assert "EnvironmentFile" not in service
    assert service["RuntimeDirectory"] == ["ibex"]
    assert service["ExecStart"][0].endswith(" serve --env-file %t/ibex/context.env")


def test_unit_drain_fits_in_the_stop_timeout() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    assert drain_grace(Settings()) < float(service["TimeoutStopSec"][0])


def _unit_with_existing_binary(tmp_path: Path) -> Path:
    # `verify` checks that ExecStart's binary exists and is executable; the
    # install path does not exist here, so point a copy at this interpreter.
    text = re.sub(
        r"(?m)^ExecStart=.*$", f"ExecStart={sys.executable} -m ibex serve", UNIT.read_text()
    )
    copy = tmp_path / UNIT.name
    copy.write_text(text)
    return copy


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_verifies(tmp_path: Path) -> None:
    unit = _unit_with_existing_binary(tmp_path)
    # --man=no: do not require man pages for Documentation= on this machine.
    proc = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    # Unknown keys and unparsable values are only warnings (exit 0): fail on any
    # diagnostic about this unit, ignore noise about the host's own units.
    ours = [line for line in (proc.stdout + proc.stderr).splitlines() if UNIT.name in line]
    assert proc.returncode == 0, proc.stderr
    assert ours == []


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze not installed")
def test_unit_sandbox_exposure_stays_low(tmp_path: Path) -> None:
    unit = _unit_with_existing_binary(tmp_path)
    proc = subprocess.run(
        ["systemd-analyze", "security", "--offline=yes", "--threshold=20", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if "unrecognized option" in proc.stderr:
        pytest.skip("systemd-analyze security --offline needs systemd >= 250")
    # --threshold is on a 0..100 scale: 20 means an exposure level of 2.0 of 10
    # at most (1.2 with systemd 252 when written).
    assert proc.returncode == 0, proc.stdout[-2000:]


# --------------------------------------------------------------------------- env example


def settings_variables() -> set[str]:
    """Every IBEX_CONTEXT_* name load_settings reads: the settings table's variables."""
    return {PREFIX + row.suffix for row in config.TABLE.values()}


def env_example_assignments() -> tuple[dict[str, str], dict[str, str]]:
    """(active, commented) KEY=value lines of the example file."""
    active: dict[str, str] = {}
    commented: dict[str, str] = {}
    for line in ENV_EXAMPLE.read_text().splitlines():
        if m := re.fullmatch(r"(IBEX_CONTEXT_[A-Z0-9_]+)=(.*)", line):
            active[m[1]] = m[2]
        elif m := re.fullmatch(r"# (IBEX_CONTEXT_[A-Z0-9_]+)=(.*)", line):
            commented[m[1]] = m[2]
    return active, commented


def test_env_example_documents_every_setting() -> None:
    active, commented = env_example_assignments()
    assert set(active).isdisjoint(commented)
    assert set(active) | set(commented) == settings_variables()


def test_every_documented_variable_is_read_under_its_exact_name() -> None:
    """The example file is the operators' list: each name in it must be one the parser
    actually reads at run time (a renamed or misspelt key would silently keep its default)."""
    active, commented = env_example_assignments()
    missing = (set(active) | set(commented)) - config.known_variables()
    assert missing == set()


def test_env_example_commented_defaults_are_the_real_defaults() -> None:
    """A commented line shows the effective default: for a targeted setting the layer
    config's own field default (read through the function `ibex config` prints)."""
    _, commented = env_example_assignments()
    assert effective_settings(load_settings(commented)) == effective_settings(Settings())


def test_env_example_active_lines_load() -> None:
    active, _ = env_example_assignments()
    settings = load_settings(active)
    assert settings.metrics_addr == "127.0.0.1:9464"


# --------------------------------------------------------------------------- kubernetes


def test_manifests_declare_the_expected_kinds() -> None:
    # A text check that needs no YAML parser; the parsed checks follow.
    kinds = {m for p in MANIFESTS for m in re.findall(r"(?m)^kind: (\w+)$", p.read_text())}
    assert kinds == KINDS
    listed = re.findall(r"(?m)^  - (\S+\.yaml)$", (KUBE / "kustomization.yaml").read_text())
    assert sorted(listed) == sorted(p.name for p in MANIFESTS)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl not installed")
def test_kustomization_renders() -> None:
    proc = subprocess.run(
        ["kubectl", "kustomize", str(KUBE)], capture_output=True, text=True, timeout=60, check=False
    )
    assert proc.returncode == 0, proc.stderr
    assert set(re.findall(r"(?m)^kind: (\w+)$", proc.stdout)) == KINDS
    assert len(re.findall(r"(?m)^  namespace: ibex$", proc.stdout)) == len(KINDS)


def manifests() -> dict[str, dict[str, Any]]:
    yaml = pytest.importorskip("yaml", reason="PyYAML not installed (needed to parse manifests)")
    docs = [d for p in MANIFESTS for d in yaml.safe_load_all(p.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs), "one object per kind expected"
    return by_kind


def test_manifests_parse_with_api_versions() -> None:
    docs = manifests()
    assert set(docs) == KINDS
    versions = {kind: doc["apiVersion"] for kind, doc in docs.items()}
    assert versions == {
        "ConfigMap": "v1",
        "Secret": "v1",
        "Deployment": "apps/v1",
        "Service": "v1",
        "HorizontalPodAutoscaler": "autoscaling/v2",
        "PodDisruptionBudget": "policy/v1",
        "NetworkPolicy": "networking.k8s.io/v1",
    }


def test_deployment_probes_resources_and_security() -> None:
    docs = manifests()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert container[probe]["grpc"]["port"] == 9092, probe
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"grpc": 9092, "metrics": 9464}
    assert container["resources"]["requests"] == {"cpu": "1", "memory": "512Mi"}
    assert container["resources"]["limits"] == {"cpu": "1", "memory": "512Mi"}
    sec = container["securityContext"]
    assert sec["readOnlyRootFilesystem"] is True
    assert sec["allowPrivilegeEscalation"] is False
    assert sec["capabilities"]["drop"] == ["ALL"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    env_from = {next(iter(e)): next(iter(e.values()))["name"] for e in container["envFrom"]}
    assert env_from == {"configMapRef": "ibex-context", "secretRef": "ibex-context"}
    assert "replicas" not in docs["Deployment"]["spec"]  # owned by the HPA


def test_termination_grace_covers_pre_stop_and_drain() -> None:
    docs = manifests()
    pod = docs["Deployment"]["spec"]["template"]["spec"]
    pre_stop = pod["containers"][0]["lifecycle"]["preStop"]["sleep"]["seconds"]
    env = {**docs["ConfigMap"]["data"], **docs["Secret"]["stringData"]}
    drain = drain_grace(load_settings(env))
    assert pod["terminationGracePeriodSeconds"] > pre_stop + drain


def test_rollout_keeps_capacity_and_waits_for_a_warm_pod() -> None:
    """One new pod at a time, none taken away before its successor is ready; ready
    means gRPC Health SERVING (the kubelet's native probe), which the daemon says once
    its connections are warmed and stops saying when a drain starts."""
    deployment = manifests()["Deployment"]
    strategy = deployment["spec"]["strategy"]
    assert strategy == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    readiness = container["readinessProbe"]
    assert readiness["grpc"] == {"port": 9092}  # service "": the overall status
    assert readiness["failureThreshold"] * readiness["periodSeconds"] <= 10
    assert container["lifecycle"]["preStop"]["sleep"]["seconds"] >= 1


def test_config_and_secret_make_a_startable_configuration() -> None:
    docs = manifests()
    env = {**docs["ConfigMap"]["data"], **docs["Secret"]["stringData"]}
    settings = load_settings(env)
    assert settings.grpc_addr == "0.0.0.0:9092"
    assert settings.metrics_addr == "0.0.0.0:9464"
    # A non-loopback bind needs caller auth; the Secret provides it.
    assert settings.auth_tokens_sha256
    assert "IBEX_CONTEXT_MEMORY_API_TOKEN" not in docs["ConfigMap"]["data"]
    assert "IBEX_CONTEXT_AUTH_TOKENS_SHA256" not in docs["ConfigMap"]["data"]
    # Metrics on the pod address need a scrape token; its digest is a secret too.
    assert settings.metrics_token_sha256
    assert "IBEX_CONTEXT_METRICS_TOKEN_SHA256" not in docs["ConfigMap"]["data"]
    assert check_bind_policy(settings) is None  # starts, with no insecure override
    assert not settings.allow_insecure
    without = {k: v for k, v in env.items() if k != "IBEX_CONTEXT_METRICS_TOKEN_SHA256"}
    with pytest.raises(config.ConfigError, match="IBEX_CONTEXT_METRICS_ADDR"):
        check_bind_policy(load_settings(without))


def test_service_is_headless_and_selects_the_pods() -> None:
    docs = manifests()
    service = docs["Service"]["spec"]
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    assert service["clusterIP"] == "None"
    assert service["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["port"] for p in service["ports"]} == {"grpc": 9092, "metrics": 9464}
    pdb = docs["PodDisruptionBudget"]["spec"]
    assert pdb["selector"]["matchLabels"].items() <= pod_labels.items()
    assert docs["Deployment"]["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()


def test_hpa_scales_the_deployment_on_cpu() -> None:
    docs = manifests()
    hpa = docs["HorizontalPodAutoscaler"]["spec"]
    assert hpa["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": docs["Deployment"]["metadata"]["name"],
    }
    (metric,) = hpa["metrics"]
    assert metric["resource"]["name"] == "cpu"
    assert 1 <= hpa["minReplicas"] < hpa["maxReplicas"]


def test_network_policy_ports() -> None:
    docs = manifests()
    policy = docs["NetworkPolicy"]["spec"]
    assert sorted(policy["policyTypes"]) == ["Egress", "Ingress"]
    ingress_ports = sorted(p["port"] for rule in policy["ingress"] for p in rule["ports"])
    assert ingress_ports == [9092, 9464]
    egress_ports = {(p["protocol"], p["port"]) for rule in policy["egress"] for p in rule["ports"]}
    assert egress_ports == {
        ("TCP", 6379),
        ("TCP", 26379),
        ("TCP", 8080),
        ("UDP", 53),
        ("TCP", 53),
    }


def test_unit_does_not_restart_what_a_restart_cannot_fix() -> None:
    """A bad setting or file stops every start the same way (docs/operations.md, exit
    statuses); an address in use may clear, so it is not in the list."""
    from ibex.errors import ConfigError, ConfigFileError, ListenError

    service = parse_unit(UNIT.read_text())["Service"]
    statuses = {int(x) for x in service["RestartPreventExitStatus"][0].split()}
    assert statuses == {ConfigError.exit_status, ConfigFileError.exit_status} == {2, 4}
    assert ListenError.exit_status not in statuses


def test_unit_sets_up_per_worker_ports() -> None:
    service = parse_unit(UNIT.read_text())["Service"]
    env = dict(e.split("=", 1) for e in service["Environment"])
    settings = load_settings({**env, "IBEX_CONTEXT_WORKERS": "8"})
    assert settings.worker_ports() == tuple(range(9100, 9108))
    # Room for the largest worker count below the default metrics port, away from gRPC's.
    load_settings(
        {**env, "IBEX_CONTEXT_WORKERS": "256", "IBEX_CONTEXT_METRICS_ADDR": "127.0.0.1:9464"}
    )


def test_config_map_sets_connection_age_for_rebalancing() -> None:
    data = manifests()["ConfigMap"]["data"]
    age = parse_duration("AGE", data["IBEX_CONTEXT_MAX_CONNECTION_AGE"], bare=False)
    grace = parse_duration("GRACE", data["IBEX_CONTEXT_MAX_CONNECTION_AGE_GRACE"], bare=False)
    # Long enough to amortise reconnects, short enough that scale-ups get traffic soon;
    # the grace covers far more than the 45 ms a call may take.
    assert 60 <= age <= 1800
    assert 1 <= grace < age


def test_config_map_follows_redis_through_sentinel() -> None:
    docs = manifests()
    env = {**docs["ConfigMap"]["data"], **docs["Secret"]["stringData"]}
    settings = load_settings(env)
    assert len(settings.redis_sentinels) == 3
    assert all(addr.endswith(":26379") for addr in settings.redis_sentinels)
    assert settings.redis_sentinel_master
    assert settings.redis_configured and not settings.redis_cluster
    # The sentinel port is open for egress.
    egress = docs["NetworkPolicy"]["spec"]["egress"]
    assert 26379 in {p["port"] for rule in egress for p in rule["ports"]}


def test_service_comment_shows_client_side_round_robin() -> None:
    text = (KUBE / "service.yaml").read_text()
    assert '{"loadBalancingConfig":[{"round_robin":{}}]}' in text
    assert "dns:///ibex-context.ibex.svc.cluster.local:9092" in text
