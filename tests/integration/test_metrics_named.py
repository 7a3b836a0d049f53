"""Every metric the docs, the runbooks, the alert rules and the dashboard name is on /metrics.

The names are read from the files themselves (README.md, docs/*.md, deploy/prometheus/*,
deploy/grafana/*), so a metric documented anywhere must be exported by a real daemon:
`ibex serve --workers 2` with IBEX_CONTEXT_METRICS_ADDR, real Redis and the memory
stand-in (so each dependency has its series), one call answered, then scraped.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from prometheus_client import CollectorRegistry, generate_latest

from ibex.ops.supervisor_metrics import ProcessMetrics
from ibex.testing.memory_server import FakeMemoryServer
from ibex.testing.redis_server import RedisServer
from tests.integration.test_workers import assemble, children, free_port, scrape, wait_for

ROOT = Path(__file__).resolve().parents[2]
NAMING_FILES = (
    ROOT / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
    *sorted(p for p in (ROOT / "deploy" / "prometheus").iterdir() if p.is_file()),
    *sorted(p for p in (ROOT / "deploy" / "grafana").iterdir() if p.is_file()),
)
# A metric name as these files write one: ibex's own series and the process_* series.
# Not part of a path or a file name (`ibex_x.py`), nor a call (`process_x(`); a
# recording rule (`ibex:...`) is no exported name.
_METRIC = re.compile(r"(?<![\w./:-])((?:ibex|process)_[a-z0-9_]*[a-z0-9])(?![\w(:])(?!\.\w)")
# What a family's samples add to its name in the exposition.
_SUFFIXES = ("", "_total", "_bucket", "_count", "_sum", "_created")


def named_metrics() -> dict[str, set[str]]:
    """Metric name -> the files (relative to the root) that name it."""
    named: dict[str, set[str]] = {}
    for path in NAMING_FILES:
        for name in _METRIC.findall(path.read_text(encoding="utf-8")):
            named.setdefault(name, set()).add(str(path.relative_to(ROOT)))
    return named


def exposed_names(text: str) -> set[str]:
    """Sample names in a Prometheus text exposition."""
    names = set()
    for line in text.splitlines():
        if line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def missing(named: dict[str, set[str]], exposed: set[str]) -> dict[str, set[str]]:
    return {
        name: where
        for name, where in named.items()
        if not any(name + suffix in exposed for suffix in _SUFFIXES)
    }


def test_the_names_are_found_where_the_runbooks_and_rules_use_them() -> None:
    named = named_metrics()
    assert "docs/operations.md" in named["process_cpu_seconds_total"]
    assert "deploy/prometheus/ibex-context.rules.yml" in named["ibex_shed_requests_total"]
    assert "deploy/grafana/ibex-context.json" in named["ibex_branch_outcomes_total"]
    # paths, file names and calls are not metric names
    assert _METRIC.findall("tests/ibex_x.py ibex_y.py process_z( ibex:rate_5m") == []
    assert _METRIC.findall("`ibex_a_total`. ibex_b_seconds, process_c_bytes.") == [
        "ibex_a_total",
        "ibex_b_seconds",
        "process_c_bytes",
    ]


def test_process_metrics_label_each_live_process_and_leave_out_a_gone_one() -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    registry = CollectorRegistry()
    registry.register(ProcessMetrics(lambda: [("supervisor", os.getpid()), ("worker-0", gone.pid)]))
    text = generate_latest(registry).decode()
    cpu = [line for line in text.splitlines() if line.startswith("process_cpu_seconds_total{")]
    assert len(cpu) == 1
    assert f'pid="{os.getpid()}"' in cpu[0] and 'process="supervisor"' in cpu[0]
    assert float(cpu[0].rsplit(" ", 1)[1]) > 0
    assert "process_resident_memory_bytes{" in text
    assert f'pid="{gone.pid}"' not in text


def test_every_named_metric_is_on_a_real_daemons_metrics(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    named = named_metrics()
    with FakeMemoryServer() as memory:
        grpc_port, metrics_port = free_port(), free_port()
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("IBEX_CONTEXT_", "PROMETHEUS_"))
        }
        env.update(
            IBEX_CONTEXT_GRPC_ADDR=f"127.0.0.1:{grpc_port}",
            IBEX_CONTEXT_METRICS_ADDR=f"127.0.0.1:{metrics_port}",
            IBEX_CONTEXT_DRAIN_GRACE="5s",
            IBEX_CONTEXT_REDIS_URL=redis_server.url,
            IBEX_CONTEXT_MEMORY_BASE_URL=memory.url,
            IBEX_CONTEXT_MEMORY_API_TOKEN=memory.token,
        )
        log_path = tmp_path / "stderr.log"
        with log_path.open("w") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "ibex", "serve", "--workers", "2"],
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=log,
                start_new_session=True,  # its own process group: teardown reaches the workers
            )
            try:
                wait_for(lambda: '"event":"workers_ready"' in log_path.read_text(), 120, "workers")
                done = assemble(grpc_port)  # labelled series appear with their first value
                assert done.returncode == 0, done.stderr
                text = scrape(metrics_port)
                assert missing(named, exposed_names(text)) == {}
                # one CPU series per live process, named and with its pid
                workers = children(proc.pid)
                cpu = {
                    line.split("{", 1)[1].split("}", 1)[0]
                    for line in text.splitlines()
                    if line.startswith("process_cpu_seconds_total{")
                }
                expected = {f'pid="{pid}"' for pid in (*workers, proc.pid)}
                assert {
                    label for labels in cpu for label in labels.split(",") if "pid" in label
                } == (expected)
                assert len(workers) == 2
                assert {
                    label for labels in cpu for label in labels.split(",") if "process" in label
                } == {'process="supervisor"', 'process="worker-0"', 'process="worker-1"'}
                proc.send_signal(signal.SIGTERM)
                assert proc.wait(timeout=30) == 0
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
