"""Running the daemon: logs, metrics, traces, systemd notification, worker processes.

- `logs`: one JSON event per line, no secrets, no memory text (`configure_logging`);
- `metrics`: every Prometheus metric the daemon records (`Metrics`), a single
  process's updates held and folded in at collection by `metrics_held`;
  `metrics_http`: the ``/metrics`` listener (`serve_metrics`);
  `supervisor_metrics`: what the supervisor of several workers exposes;
- `tracing`: whether OpenTelemetry is wanted and its set-up (`setup_tracing`);
  `otel_sdk`: the SDK side, loaded only when tracing is on;
- `sdnotify`: READY, STOPPING and the watchdog for systemd (`Notifier`);
- `workers`: the supervisor of ``--workers N`` (`supervise`), `envfile` its
  ``--env-file`` reader;
- `branch_errors`: failed branches counted and logged as a rate-limited summary
  (`BranchErrors`).

Each name is imported from its module on first use: prometheus_client must
not be imported before the supervisor sets PROMETHEUS_MULTIPROC_DIR.
"""

from ibex._lazy import lazy_exports

__all__ = [
    "BranchErrors",
    "Metrics",
    "Notifier",
    "configure_logging",
    "read_env_file",
    "serve_metrics",
    "setup_tracing",
    "supervise",
    "tracing_wanted",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "BranchErrors": "branch_errors",
        "Metrics": "metrics",
        "Notifier": "sdnotify",
        "configure_logging": "logs",
        "read_env_file": "envfile",
        "serve_metrics": "metrics_http",
        "setup_tracing": "tracing",
        "supervise": "workers",
        "tracing_wanted": "tracing",
    },
)
