"""The image recipe agrees with the Kubernetes manifests and keeps its promises statically.

The image itself is built and run by `just image image-test` (not in CI: minutes).
"""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parents[2]
CONTAINERFILE = (ROOT / "deploy/container/Containerfile").read_text()


def stages() -> list[str]:
    """The Containerfile's stages, each from its FROM line on."""
    return re.split(r"\n(?=FROM )", CONTAINERFILE)[1:]


def instructions(stage: str, keyword: str) -> list[str]:
    joined = re.sub(r"\\\n\s*", " ", stage)
    return [line[len(keyword) + 1 :] for line in joined.splitlines() if line.startswith(keyword)]


def deployment() -> dict[str, Any]:
    text = (ROOT / "deploy/kubernetes/deployment.yaml").read_text()
    doc: dict[str, Any] = yaml.safe_load(text)
    return doc


def test_multi_stage_with_the_base_as_an_argument() -> None:
    build, final = stages()
    assert (
        CONTAINERFILE.startswith("#") and "\nARG BASE=python:3.11-slim-bookworm\n" in CONTAINERFILE
    )
    assert build.startswith("FROM ${BASE} AS build")
    assert final.startswith("FROM ${BASE}\n")
    # dependencies come from the lock, by hash; the final stage installs nothing
    assert "--require-hashes" in build and "requirements-image.lock" in build
    assert instructions(final, "COPY") == ["--from=build /opt/ibex /opt/ibex"]
    for run in instructions(final, "RUN"):
        assert "install" not in run.replace("--", "")
        assert not re.search(r"apt|pip|gcc|build-essential", run)


def test_user_ports_and_entrypoint_match_the_deployment() -> None:
    _, final = stages()
    pod = deployment()["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    uid, gid = instructions(final, "USER")[0].split(":")
    assert int(uid) == pod["securityContext"]["runAsUser"] != 0
    assert int(gid) == pod["securityContext"]["runAsGroup"]
    assert f"--uid {uid}" in final and f"--gid {gid}" in final
    assert json.loads(instructions(final, "ENTRYPOINT")[0]) == container["command"]
    exposed = {int(p) for p in instructions(final, "EXPOSE")[0].split()}
    assert exposed == {p["containerPort"] for p in container["ports"]}
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]


def test_image_name_and_version_agree() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    (container,) = deployment()["spec"]["template"]["spec"]["containers"]
    assert container["image"] == f"registry.example.com/ibex/ibex-context:{version}"
    justfile = (ROOT / "justfile").read_text()
    assert 'IMAGE := "registry.example.com/ibex/ibex-context:" + VERSION' in justfile


def test_oci_labels() -> None:
    _, final = stages()
    labels = dict(re.findall(r"(org\.opencontainers\.image\.[a-z.]+)=\"([^\"]*)\"", final))
    for key in ("title", "description", "version", "revision", "created", "licenses"):
        assert labels[f"org.opencontainers.image.{key}"], key


def test_no_host_specific_flags_in_the_containerfile() -> None:
    for flag in ("vfs", "runc", "cgroup", "ulimit", "/etc/ssl/certs/ca-certificates.crt"):
        assert flag not in CONTAINERFILE


def test_build_context_admits_only_what_the_build_copies() -> None:
    ignore = (ROOT / ".containerignore").read_text().splitlines()
    admitted = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    copied = set()
    for build_stage in stages()[:1]:
        for copy in instructions(build_stage, "COPY"):
            copied.update(copy.split()[:-1])
    assert copied == admitted
