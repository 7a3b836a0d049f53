"""h2load (nghttp2's C load generator) sending real gRPC calls, and what it reports.

The grpcio driver (`benchmarks.load.driver`) shares the two cores with the
daemon and takes a fifth of them at saturation; its own time is in every
latency it reports. h2load costs a fraction of that per call, so capacity, the
floor and the tail are also measured with it and printed beside the grpcio
figures.

What h2load sends: one body file per h2load process, one process per tenant
(the 5-byte gRPC prefix, uncompressed, and a serialized
`AssembleContextRequest`) POSTed to the method's path with
`content-type: application/grpc`, `te: trailers`, a `grpc-timeout` and, when
given, `authorization: Bearer ...`. Every call of a tenant carries the same
body: the daemon's token-count cache hits on the history of all but the first,
which the grpcio driver's varied requests do not allow, so the two clients'
CPU figures differ by that too.

What h2load does not read: trailers. A gRPC error is an HTTP 200 to it, so the
calls' gRPC statuses come from the daemon's own `ibex_grpc_requests_total`
scraped before and after a run (`grpc_codes`); the floor servers answer every
call OK. Latency comes from h2load's `--log-file` (one row per call: start in
µs since the epoch, HTTP status, µs to the end of the response); with `--rps`
a call's start is its actual send, not a schedule, so a client that falls
behind shows as fewer calls rather than as latency.
"""

from __future__ import annotations

import contextlib
import re
import resource
import shutil
import struct
import subprocess
import tempfile
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.load.driver import METHOD
from benchmarks.load.report import percentile

INSTALL_HINT = "h2load is missing: `apt-get install nghttp2-client` (`just bench-capacity` does)"
_REQUESTS = re.compile(
    r"requests: (\d+) total, (\d+) started, (\d+) done, (\d+) succeeded, (\d+) failed, "
    r"(\d+) errored, (\d+) timeout"
)
OPEN_STREAMS = 64  # concurrent streams a connection may have in an open-loop (--rps) run
_FINISHED = re.compile(r"finished in ([\d.]+)(m?s), ([\d.]+) req/s")


def h2load_path() -> str:
    """The h2load binary, or a RuntimeError saying how to install it."""
    path = shutil.which("h2load")
    if path is None:
        raise RuntimeError(INSTALL_HINT)
    return path


def grpc_frame(message: bytes) -> bytes:
    """One length-prefixed gRPC message: flag 0 (uncompressed), 4-byte big-endian length."""
    return b"\x00" + struct.pack(">I", len(message)) + message


@contextlib.contextmanager
def body_file(message: bytes) -> Iterator[Path]:
    """A temporary file holding `message` framed as one gRPC request body."""
    with tempfile.NamedTemporaryFile(prefix="ibex-h2load-", suffix=".bin") as f:
        f.write(grpc_frame(message))
        f.flush()
        yield Path(f.name)


@dataclass(frozen=True)
class Load:
    """How h2load drives: `rps` calls/s in all (open, spread over `clients` connections)
    or, with `rps` None, `clients` x `streams` calls always in flight (closed loop)."""

    rps: int | None
    clients: int = 4
    streams: int = 8

    @property
    def label(self) -> str:
        return f"{self.rps}rps" if self.rps else "closed"

    def args(self) -> list[str]:
        if self.rps is None:
            return ["-c", str(self.clients), "-m", str(self.streams)]
        if self.rps % self.clients:
            raise ValueError(f"rps {self.rps} is not a multiple of {self.clients} clients")
        # --rps is per connection; -m caps the calls in flight on one, so it is set well
        # above rate x latency: a slow answer must not hold back the next scheduled call.
        per = self.rps // self.clients
        return ["-c", str(self.clients), "-m", str(OPEN_STREAMS), "--rps", str(per)]


@dataclass
class Run:
    """One h2load run: counts from its summary, latencies from its log, its own CPU."""

    done: int
    succeeded: int
    failed: int
    errored: int
    timeout: int
    seconds: float
    latency_ms: list[float] = field(default_factory=list)
    client_cpu_s: float = 0.0

    def summary(self, target_cpu_s: float, codes: Mapping[str, float] | None) -> dict[str, Any]:
        """The row: answers/s, latency percentiles, statuses, CPU per answer, h2load's CPU.

        `codes` are the daemon's gRPC status counts for the run (None for a floor
        server, which answers every call OK): answers are the OK ones."""
        lat = sorted(self.latency_ms)
        ok = self.succeeded if codes is None else int(codes.get("OK", 0))
        statuses = {"OK": ok} if codes is None else {k: int(v) for k, v in codes.items() if v}
        return {
            "client": "h2load",
            "calls": self.done,
            "answers": ok,
            "answers_per_s": round(ok / self.seconds, 1) if self.seconds else 0.0,
            "p50_ms": round(percentile(lat, 50), 2),
            "p90_ms": round(percentile(lat, 90), 2),
            "p99_ms": round(percentile(lat, 99), 2),
            "statuses": statuses,
            "http_failed": self.failed + self.errored + self.timeout,
            "cpu_ms_per_answer": round(target_cpu_s * 1000.0 / ok, 3) if ok else None,
            "client_cpu_cores": round(self.client_cpu_s / self.seconds, 2) if self.seconds else 0,
        }


def command(
    url: str,
    body: Path,
    load: Load,
    seconds: float,
    log: Path,
    *,
    deadline_s: float = 1.0,
    token: str | None = None,
    warm_up_s: float = 0.0,
) -> list[str]:
    """The h2load command line for one run against `url` (http://host:port)."""
    cmd = [h2load_path(), *load.args(), "-D", _duration(seconds), "-d", str(body)]
    if warm_up_s and load.rps is None:  # h2load refuses a warm-up with --rps
        cmd += ["--warm-up-time", _duration(warm_up_s)]
    headers = {
        "content-type": "application/grpc",
        "te": "trailers",
        "grpc-timeout": f"{max(1, round(deadline_s * 1000))}m",
    }
    if token:
        headers["authorization"] = f"Bearer {token}"
    for k, v in headers.items():
        cmd += ["-H", f"{k}: {v}"]
    return [*cmd, "--log-file", str(log), url.rstrip("/") + METHOD]


def _duration(seconds: float) -> str:
    """h2load's DURATION: whole milliseconds with their unit (it refuses "0.5")."""
    return f"{max(1, round(seconds * 1000))}ms"


def parse(stdout: str, log_text: str) -> Run:
    """h2load's summary lines and per-call log into a `Run`."""
    m = _REQUESTS.search(stdout)
    f = _FINISHED.search(stdout)
    if m is None or f is None:
        raise RuntimeError(f"h2load output not understood:\n{stdout[-2000:]}")
    _total, _started, done, ok, failed, errored, timeout = (int(x) for x in m.groups())
    seconds = float(f.group(1)) / (1000.0 if f.group(2) == "ms" else 1.0)
    latency = []
    for line in log_text.splitlines():
        parts = line.split("\t")
        if len(parts) >= 3 and parts[1] == "200":
            latency.append(int(parts[2]) / 1000.0)
    return Run(done, ok, failed, errored, timeout, seconds, latency)


def run(
    addr: str,
    messages: Sequence[bytes],
    load: Load,
    seconds: float,
    *,
    deadline_s: float = 1.0,
    token: str | None = None,
    warm_up_s: float = 0.0,
) -> Run:
    """Drive `addr` (host:port) for `seconds`: one h2load process per message (h2load sends
    one body), each with its share of `load`'s connections and rate, started together.

    One message per tenant keeps the daemon's per-org limits and caches as busy as
    the grpcio driver's mix of tenants makes them. h2load's CPU is measured from this
    process's reaped children (the h2load processes are the only children reaped here).
    """
    n = len(messages)
    if n == 0 or load.clients % n:
        raise ValueError(f"{load.clients} connections do not split over {n} messages")
    share = Load(
        None if load.rps is None else load.rps // n, clients=load.clients // n, streams=load.streams
    )
    if share.rps is not None and share.rps * n != load.rps:
        raise ValueError(f"rps {load.rps} does not split over {n} messages")
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        logs = [tmp / f"calls-{i}.tsv" for i in range(n)]
        cmds = [
            command(
                f"http://{addr}",
                stack.enter_context(body_file(m)),
                share,
                seconds,
                log,
                deadline_s=deadline_s,
                token=token,
                warm_up_s=warm_up_s,
            )
            for m, log in zip(messages, logs, strict=True)
        ]
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        procs = [
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for cmd in cmds
        ]
        outputs = []
        try:
            for proc in procs:
                out, err = proc.communicate(timeout=seconds + warm_up_s + 60)
                if proc.returncode != 0:
                    raise RuntimeError(f"h2load exited {proc.returncode}: {err[-2000:]}")
                outputs.append(out)
        finally:  # a failed or stuck run leaves no h2load behind
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs = [
            parse(out, log.read_text() if log.exists() else "")
            for out, log in zip(outputs, logs, strict=True)
        ]
    result = Run(
        done=sum(r.done for r in runs),
        succeeded=sum(r.succeeded for r in runs),
        failed=sum(r.failed for r in runs),
        errored=sum(r.errored for r in runs),
        timeout=sum(r.timeout for r in runs),
        seconds=max(r.seconds for r in runs),
        latency_ms=[x for r in runs for x in r.latency_ms],
    )
    result.client_cpu_s = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return result


def grpc_codes(metrics_text: str, method: str = "AssembleContext") -> dict[str, float]:
    """`ibex_grpc_requests_total{method}` by code, from a Prometheus text scrape."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        if family.name != "ibex_grpc_requests":
            continue
        for s in family.samples:
            if s.name.endswith("_total") and s.labels.get("method") == method:
                code = s.labels["code"]
                out[code] = out.get(code, 0.0) + s.value
    return out


def code_deltas(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """Calls finished between two scrapes, by gRPC status code."""
    return {k: after[k] - before.get(k, 0.0) for k in after if after[k] - before.get(k, 0.0)}


def scrape(port: int) -> str:
    """The daemon's /metrics text."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        body: bytes = resp.read()
    return body.decode()
