"""Smoke-test the OCI image (`just image-test`): what a platform team's cluster would check.

Starts the image with a read-only root filesystem (podman gives it a tmpfs
/tmp, as the Kubernetes manifest's emptyDir does) on free loopback ports with
metrics on (so the supervisor and a worker both run), then checks from the
host: gRPC health SERVING, one `AssembleContext` answered from the embedded
sample data (with `ibex assemble` of this venv), the serving process's uid is
not 0, the root filesystem refuses writes, no C compiler is present, the
tokenizer rank files verify (`ibex check` inside), /metrics answers and the
OCI labels are set. Prints the image size, then stops the container (SIGTERM,
a drain) and expects a clean exit. Runs on the host with the dev extra
(grpcio-health-checking).

Usage: python -m ibex.tools.image_test --image NAME [--podman CMD] [--run-flags FLAGS]
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence

START_TIMEOUT = 60.0  # seconds; start-up is a few seconds, a loaded machine is slower


class SmokeFailure(Exception):
    """One check of the image failed; the message says which and what was seen."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(list(cmd), text=True, capture_output=True, check=False)
    if check and proc.returncode != 0:
        raise SmokeFailure(f"{shlex.join(cmd)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}")
    return proc


def health_serving(addr: str) -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(addr) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        try:
            reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1.0)
        except grpc.RpcError:
            return False
        return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def smoke(image: str, podman: list[str], run_flags: list[str]) -> None:
    grpc_port, metrics_port = free_port(), free_port()
    name = f"ibex-image-test-{os.getpid()}"
    grpc_addr = f"127.0.0.1:{grpc_port}"
    env = [
        f"IBEX_CONTEXT_GRPC_ADDR={grpc_addr}",
        f"IBEX_CONTEXT_METRICS_ADDR=127.0.0.1:{metrics_port}",
    ]
    start = [*podman, "run", "--detach", "--name", name, "--read-only", *run_flags]
    run([*start, *(f"--env={e}" for e in env), image])
    stopped = False
    try:
        deadline = time.monotonic() + START_TIMEOUT
        started = time.monotonic()
        while not health_serving(grpc_addr):
            state = run([*podman, "inspect", "--format", "{{.State.Status}}", name]).stdout
            if state.strip() != "running" or time.monotonic() > deadline:
                logs = run([*podman, "logs", name], check=False)
                raise SmokeFailure(f"not SERVING (container {state.strip()}):\n{logs.stderr}")
            time.sleep(0.25)
        print(f"ok  health SERVING after {time.monotonic() - started:.1f} s on {grpc_addr}")

        ibex = os.path.join(os.path.dirname(sys.executable), "ibex")
        out = run([ibex, "assemble", "--addr", grpc_addr, "--json", "--timeout", "5"]).stdout
        reply = json.loads(out)
        if reply.get("status") != "OK" or reply.get("degraded"):
            raise SmokeFailure(f"AssembleContext: {out[:400]}")
        if "<directive" not in reply["assembledContext"] or not reply["memoriesIncluded"]:
            raise SmokeFailure(f"AssembleContext without the sample data: {out[:400]}")
        print(
            f"ok  AssembleContext: status OK, {reply['memoriesIncluded']} memories, "
            f"{reply['tokensUsed']} tokens"
        )

        status = run([*podman, "exec", name, "cat", "/proc/1/status"]).stdout
        uids = next(line for line in status.splitlines() if line.startswith("Uid:")).split()[1:]
        if "0" in uids:
            raise SmokeFailure(f"pid 1 runs with uids {uids}")
        print(f"ok  pid 1 (ibex serve) runs as uid {uids[0]}")

        readonly = run([*podman, "inspect", "--format", "{{.HostConfig.ReadonlyRootfs}}", name])
        write = run([*podman, "exec", name, "sh", "-c", "echo x > /opt/ibex/probe"], check=False)
        if readonly.stdout.strip() != "true" or write.returncode == 0:
            raise SmokeFailure("the root filesystem accepted a write")
        print("ok  read-only root filesystem (a write to /opt/ibex fails)")

        compilers = "for c in cc gcc c++ g++ clang; do command -v $c && exit 1; done; exit 0"
        if run([*podman, "exec", name, "sh", "-c", compilers], check=False).returncode != 0:
            raise SmokeFailure("a C compiler is on PATH in the final image")
        print("ok  no compiler on PATH")

        # The daemon holds its addresses, which `ibex check` tries to bind: check the
        # files with a free loopback address instead.
        check = run(
            [
                *podman,
                "exec",
                "--env",
                "IBEX_CONTEXT_METRICS_ADDR=",
                "--env",
                "IBEX_CONTEXT_GRPC_ADDR=127.0.0.1:0",
                name,
                "ibex",
                "check",
            ]
        ).stdout
        ranks = [line for line in check.splitlines() if line.startswith("tokenizer:")]
        if len(ranks) < 2 or not all(line.endswith(" ok") for line in ranks):
            raise SmokeFailure(f"ibex check inside the image:\n{check}")
        print(f"ok  tokenizer rank files verified inside ({len(ranks)})")

        url = f"http://127.0.0.1:{metrics_port}/metrics"
        with urllib.request.urlopen(url, timeout=5) as resp:  # loopback only
            if resp.status != 200 or b"ibex_" not in resp.read():
                raise SmokeFailure(f"{url} answered {resp.status} without ibex_ series")
        print("ok  /metrics answers")

        labels = json.loads(
            run([*podman, "image", "inspect", "--format", "{{json .Labels}}", image]).stdout
        )
        oci = sorted(k for k in labels if k.startswith("org.opencontainers.image."))
        if "org.opencontainers.image.title" not in oci:
            raise SmokeFailure(f"labels: {labels}")
        print(f"ok  {len(oci)} org.opencontainers.image.* labels")

        size = int(run([*podman, "image", "inspect", "--format", "{{.Size}}", image]).stdout)
        print(f"ok  image size {size / 1e6:.0f} MB ({size} bytes)")

        run([*podman, "stop", "--time", "30", name])
        stopped = True
        code = run([*podman, "inspect", "--format", "{{.State.ExitCode}}", name]).stdout.strip()
        if code != "0":
            logs = run([*podman, "logs", name], check=False)
            raise SmokeFailure(f"exit code {code} after SIGTERM:\n{logs.stderr[-2000:]}")
        print("ok  SIGTERM: drained and exited 0")
    finally:
        if not stopped:
            run([*podman, "stop", "--time", "5", name], check=False)
        run([*podman, "rm", "--force", name], check=False)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibex.tools.image_test", description=__doc__)
    parser.add_argument("--image", required=True)
    parser.add_argument("--podman", default="podman", help="podman command with global flags")
    parser.add_argument("--run-flags", default="", help="extra `podman run` flags")
    args = parser.parse_args(argv)
    try:
        smoke(args.image, shlex.split(args.podman), shlex.split(args.run_flags))
    except SmokeFailure as exc:
        print(f"FAIL {exc}", file=sys.stderr)
        return 1
    print(f"image-test passed: {args.image}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
