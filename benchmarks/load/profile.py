"""Top entries of a py-spy `--format raw` profile (collapsed stacks with counts)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def _frame(name: str) -> str:
    """`func (path/to/module.py:123)` -> `func (module.py)`: group by function, not line."""
    func, _, where = name.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if "site-packages" in path or "lib/python" in path else path
    return f"{func} ({short.split('site-packages/')[-1]})"


# Where a sample's time goes, by the innermost matching frame (first match wins).
GROUPS = (
    ("pipeline (assemble_pure)", "assemble_pure "),
    ("memory HTTP client (http_pool)", "MemoryHttpSource."),
    ("redis directive", "RedisDirectiveSource."),
    ("request decode + validation", "check_request "),
    ("response encode (convert)", "response_to_proto "),
    ("retrieval orchestration", "retrieve "),
    ("grpclib + h2 (server)", "grpclib/"),
    ("grpclib + h2 (server)", " (h2/"),
    ("trio-asyncio loop", "trio_asyncio/"),
    ("trio scheduler / epoll", "_core/"),
    ("asyncio", "asyncio/"),
)


def _group(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needle in GROUPS:
            if needle in frame:
                return name
    return "other"


def top_entries(raw: Path, n: int = 30) -> dict[str, list[tuple[str, float]]]:
    """Percent of samples per function: as the leaf (self) and anywhere on the stack (total)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    samples = 0
    if not raw.exists():
        return {"self": [], "total": [], "groups": []}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [
            _frame(f)
            for f in stack.split(";")
            if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if not frames:
            continue
        samples += k
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
        groups[_group(frames)] += k
    pct = 100.0 / max(1, samples)
    return {
        "self": [(f, round(c * pct, 2)) for f, c in own.most_common(n)],
        "total": [(f, round(c * pct, 2)) for f, c in total.most_common(n)],
        "groups": [(g, round(c * pct, 2)) for g, c in groups.most_common()],
    }


# --- the daemon against the floor, under py-spy -------------------------------------------

USAGE = """Where ibex's CPU per answer goes beyond the floor's, at one open-loop rate.

The daemon (one worker, the standard stack: Redis, the memory stand-in hot 2 ms /
cold 8 ms) and the trio-asyncio floor server (`benchmarks.load.floor`) are each
driven by h2load at `--rate` for `--seconds` while py-spy samples them (200 Hz,
idle samples dropped), one after the other. Each group's share of the samples
times the process's CPU per answer (from /proc) gives milliseconds per answer;
the difference is what ibex adds. py-spy counts a thread that is runnable but
waiting for a core as busy where it last stopped (the epoll wait, a socket
send), so on a loaded machine those groups read high.

Run: ``python -m benchmarks.load.profile [--rate 100] [--seconds 20]``

``--versus DIR [--rounds 6] [--saturated]``: this checkout's CPU per answer and
checkout DIR's, in turns on one stack (a change is kept when the medians differ
by more than the spread). ``--calls``: Python function calls per answer under
cProfile, the daemon against the floor; counts do not move with the machine's
load, so they show added work where sampled time cannot. ``--micro``: the
memory pool's request-path steps in µs of CPU, both ways of each in turns.
``--syscalls [--versus DIR] [--rounds N]``: syscalls per answer of the daemon
under ``strace -f -c`` (each checkout in turns when DIR is given).
"""


def _spy_and_drive(
    pid: int, addr: str, messages: list[bytes], rate: int, seconds: float, raw: Path
) -> tuple[float, int]:
    """py-spy on `pid` while h2load drives `addr`: (CPU seconds of `pid`, answers)."""
    import subprocess
    import sys

    from benchmarks.load import h2load
    from benchmarks.load.stack import cpu_seconds

    spy_bin = Path(sys.executable).parent / "py-spy"
    if not spy_bin.exists():
        raise SystemExit("needs py-spy: .venv/bin/pip install py-spy")
    spy = subprocess.Popen(
        [str(spy_bin), "record", "--pid", str(pid), "--rate", "200", "--format", "raw",
         "--nonblocking", "--subprocesses", "--duration", str(int(seconds)),
         "--output", str(raw)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        cpu0 = cpu_seconds(pid)
        run = h2load.run(addr, messages, h2load.Load(rate), seconds)
        cpu = cpu_seconds(pid) - cpu0
    finally:
        try:
            spy.wait(timeout=seconds + 30)
        except subprocess.TimeoutExpired:
            spy.kill()
            spy.wait()
    return cpu, run.succeeded


def versus_floor(rate: int, seconds: float, pythonpath: str = "") -> dict[str, object]:
    """The daemon (with `pythonpath` in front of the checkout: a probe or an experiment
    loaded from outside, as `benchmarks.load.after_wall` loads its probe) then the floor."""
    import tempfile

    from benchmarks.load import h2load
    from benchmarks.load.driver import build_requests
    from benchmarks.load.floor import _Bare
    from benchmarks.load.stack import ROOT, Stack

    tmp = Path(tempfile.mkdtemp(prefix="ibex-versus-"))
    out: dict[str, object] = {"rate": rate, "seconds": seconds}
    with Stack() as stack:
        messages = build_requests(stack.tenants, len(stack.tenants), 0, versions=True)
        extra = {"PYTHONPATH": f"{pythonpath}:{ROOT}"} if pythonpath else {}
        with stack.daemon(1, ROOT, **extra) as daemon:
            h2load.run(daemon.addr, messages, h2load.Load(rate), 2.0)  # warm
            cpu, n = _spy_and_drive(daemon.root_pid, daemon.addr, messages, rate, seconds,
                                    tmp / "ibex.txt")  # fmt: skip
            out["ibex"] = {"cpu_ms_per_answer": round(1000 * cpu / max(1, n), 3), "answers": n,
                           **top_entries(tmp / "ibex.txt")}  # fmt: skip
        floor = _Bare("trio-asyncio")
        try:
            h2load.run(floor.addr, messages, h2load.Load(rate), 2.0)
            cpu, n = _spy_and_drive(floor.proc.pid, floor.addr, messages, rate, seconds,
                                    tmp / "floor.txt")  # fmt: skip
            out["floor"] = {"cpu_ms_per_answer": round(1000 * cpu / max(1, n), 3), "answers": n,
                            **top_entries(tmp / "floor.txt")}  # fmt: skip
        finally:
            floor.stop()
    return out


def alternate(other: Path, rate: int | None, seconds: float, rounds: int) -> dict[str, list[float]]:
    """CPU ms per answer of this checkout and of checkout `other`, in turns, `rounds` times,
    one stack for both (Redis, the memory stand-in): a change's saving is the difference
    of the medians, kept only when it is beyond the spread. `rate` None drives closed-loop
    (saturated) and also reports answers/s."""
    from benchmarks.load import h2load
    from benchmarks.load.driver import build_requests
    from benchmarks.load.stack import ROOT, Stack, cpu_seconds

    out: dict[str, list[float]] = {"this": [], "other": [], "this_rps": [], "other_rps": []}
    with Stack() as stack:
        messages = build_requests(stack.tenants, len(stack.tenants), 0, versions=True)
        for i in range(rounds):
            order = (("this", ROOT), ("other", other)) if i % 2 == 0 else (
                ("other", other), ("this", ROOT))  # fmt: skip
            for name, root in order:
                with stack.daemon(1, root) as daemon:
                    h2load.run(daemon.addr, messages, h2load.Load(rate), 1.5)  # warm
                    cpu0 = cpu_seconds(daemon.root_pid)
                    run = h2load.run(daemon.addr, messages, h2load.Load(rate), seconds)
                    cpu = cpu_seconds(daemon.root_pid) - cpu0
                out[name].append(round(1000 * cpu / max(1, run.succeeded), 3))
                out[name + "_rps"].append(round(run.succeeded / seconds, 1))
    return out


def micro(rounds: int = 8) -> dict[str, list[float]]:
    """CPU µs of the memory pool's request-path steps, alternating the two ways of each:
    a connect to an IP literal (`tcp_connect`'s direct path against trio's
    `open_tcp_stream`, accept and close included in both) and one pooled call on an
    in-memory connection with the caller's deadline first (no safety-net scope of the
    pool's) against one with the pool's deadline first."""
    import socket
    import time

    import trio
    import trio.testing

    from ibex.sources.http_connect import tcp_connect
    from ibex.sources.http_pool import HttpPool

    out: dict[str, list[float]] = {
        "connect_direct": [], "connect_open_tcp_stream": [],
        "call_caller_deadline_first": [], "call_pool_deadline_first": [],
    }  # fmt: skip
    ok = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok"

    class _Link:
        def close(self) -> None:
            pass

        def unusable(self) -> bool:
            return False

    async def serve(stream: trio.abc.Stream) -> None:
        buf = b""
        while chunk := await stream.receive_some():
            buf += chunk
            while b"\r\n\r\n" in buf:
                _, _, buf = buf.partition(b"\r\n\r\n")
                await stream.send_all(ok)

    async def run() -> None:
        with socket.socket() as ls:
            ls.bind(("127.0.0.1", 0))
            ls.listen(1024)
            port = ls.getsockname()[1]
            direct = tcp_connect("127.0.0.1", port, None)

            async def via_trio() -> None:
                (await trio.open_tcp_stream("127.0.0.1", port)).socket.close()

            async def via_direct() -> None:
                _stream, link = await direct()
                link.close()

            async with trio.open_nursery() as nursery:

                async def connect() -> tuple[trio.abc.Stream, _Link]:
                    client, server = trio.testing.memory_stream_pair()
                    nursery.start_soon(serve, server)
                    return client, _Link()

                pool = HttpPool("http://memory.test", headers={"Authorization": "Bearer x"},
                                max_connections=4, keepalive_expiry=60.0, timeout=2.0,
                                max_response_bytes=10_000, connect=connect)  # fmt: skip
                for _ in range(200):
                    await pool.request("GET", "/a")
                for r in range(rounds):
                    ways = [("connect_direct", via_direct, None, 300),
                            ("connect_open_tcp_stream", via_trio, None, 300),
                            ("call_caller_deadline_first", None, 0.5, 2000),
                            ("call_pool_deadline_first", None, 5.0, 2000)]  # fmt: skip
                    for name, fn, outer, n in ways if r % 2 == 0 else ways[::-1]:
                        t = time.thread_time()
                        for _ in range(n):
                            if fn is not None:
                                await fn()
                                ls.accept()[0].close()
                            else:
                                with trio.move_on_after(outer or 0.0):
                                    await pool.request("GET", "/a")
                        out[name].append(round((time.thread_time() - t) / n * 1e6, 2))
                nursery.cancel_scope.cancel()

    trio.run(run)
    return out


def _strace_counts(path: Path) -> dict[str, tuple[int, int]]:
    """`strace -c` output: syscall -> (calls, errors)."""
    out = {}
    for line in path.read_text().splitlines():
        parts = line.split()
        if len(parts) >= 5 and parts[3].isdigit() and parts[-1] != "total":
            out[parts[-1]] = (int(parts[3]), int(parts[4]) if len(parts) == 6 else 0)
    return out


def syscalls(
    roots: list[Path], rate: int, seconds: float, rounds: int
) -> dict[str, list[dict[str, list[float]]]]:
    """Syscalls per answer of each checkout's daemon (one worker) under h2load at `rate`,
    counted by `strace -f -c` for `seconds`, the checkouts in turns, `rounds` times, on
    one stack. Counts, not timings: they move little with the machine's load."""
    import shutil
    import signal
    import subprocess
    import tempfile
    import time

    from benchmarks.load import h2load
    from benchmarks.load.driver import build_requests
    from benchmarks.load.stack import Stack

    strace = shutil.which("strace")
    if strace is None:
        raise SystemExit("needs strace (Debian: apt-get install strace)")
    tmp = Path(tempfile.mkdtemp(prefix="ibex-syscalls-"))
    out: dict[str, list[dict[str, list[float]]]] = {str(r): [] for r in roots}
    with Stack() as stack:
        messages = build_requests(stack.tenants, len(stack.tenants), 0, versions=True)
        for i in range(rounds):
            for root in roots if i % 2 == 0 else roots[::-1]:
                with stack.daemon(1, root) as daemon:
                    h2load.run(daemon.addr, messages, h2load.Load(rate), 1.5)  # warm
                    trace = tmp / f"{i}-{root.name}.txt"
                    spy = subprocess.Popen(
                        [strace, "-f", "-c", "-o", str(trace), "-p", str(daemon.root_pid)],
                        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(0.5)  # attached
                    run = h2load.run(daemon.addr, messages, h2load.Load(rate), seconds)
                    spy.send_signal(signal.SIGINT)
                    spy.wait(timeout=30)
                n = max(1, run.succeeded)
                counts = _strace_counts(trace)
                out[str(root)].append(
                    {k: [round(c / n, 2), round(e / n, 2)] for k, (c, e) in counts.items()}
                )
    return out


CALLS_PROBE = Path(__file__).resolve().parent / "calls_probe"


def _profiled(pid: int, addr: str, messages: list[bytes], rate: int, seconds: float,
              out: Path) -> int:  # fmt: skip
    """cProfile on `pid` (its `calls_probe`) while h2load drives `addr`: answers."""
    import os
    import signal
    import time

    from benchmarks.load import h2load

    h2load.run(addr, messages, h2load.Load(rate), 1.5)  # warm
    os.kill(pid, signal.SIGUSR1)
    run = h2load.run(addr, messages, h2load.Load(rate), seconds)
    os.kill(pid, signal.SIGUSR2)
    deadline = time.monotonic() + 30
    while not out.exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # let the dump finish writing
    return run.succeeded


def _per_answer(stats_path: Path, answers: int) -> dict[str, tuple[float, float]]:
    """function -> (calls, cProfile's own seconds) per answer."""
    import pstats

    out: dict[str, tuple[float, float]] = {}
    raw = pstats.Stats(str(stats_path)).stats  # type: ignore[attr-defined]
    for (path, line, name), (_, calls, own, _cum, _callers) in raw.items():
        short = path.split("site-packages/")[-1].split("/ibex/", 1)[-1]
        key = f"{name} ({short}:{line})"
        c, t = out.get(key, (0.0, 0.0))
        out[key] = (c + calls / answers, t + own / answers)
    return out


def calls_versus_floor(rate: int, seconds: float) -> dict[str, object]:
    """Python function calls per answer, the daemon against the floor, under cProfile."""
    import os
    import subprocess
    import sys
    import tempfile

    from benchmarks.load.driver import build_requests
    from benchmarks.load.stack import ROOT, Stack, free_port, wait_listening

    tmp = Path(tempfile.mkdtemp(prefix="ibex-calls-"))
    res: dict[str, object] = {"rate": rate, "seconds": seconds}
    with Stack() as stack:
        messages = build_requests(stack.tenants, len(stack.tenants), 0, versions=True)
        probe = {"PYTHONPATH": f"{CALLS_PROBE}:{ROOT}", "IBEX_CALLS_PROBE_OUT": str(tmp / "i")}
        with stack.daemon(1, ROOT, **probe) as daemon:
            n_ibex = _profiled(daemon.root_pid, daemon.addr, messages, rate, seconds, tmp / "i")
        port = free_port()
        env = {**os.environ, **probe, "IBEX_CALLS_PROBE_OUT": str(tmp / "f")}
        cmd = [sys.executable, "-m", "benchmarks.load.floor", "--serve", "trio-asyncio", str(port)]
        floor = subprocess.Popen(  # its stderr: asyncio's notes on connections h2load drops
            cmd, cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        try:
            if not wait_listening(floor, port):
                raise RuntimeError("the floor server did not start")
            n_floor = _profiled(floor.pid, f"127.0.0.1:{port}", messages, rate, seconds,
                                tmp / "f")  # fmt: skip
        finally:
            floor.kill()
            floor.wait()
    ibex, base = _per_answer(tmp / "i", max(1, n_ibex)), _per_answer(tmp / "f", max(1, n_floor))
    res["answers"] = {"ibex": n_ibex, "floor": n_floor}
    res["calls_per_answer"] = {"ibex": round(sum(c for c, _ in ibex.values())),
                               "floor": round(sum(c for c, _ in base.values()))}  # fmt: skip
    rows = sorted(set(ibex) | set(base),
                  key=lambda k: -(ibex.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]))  # fmt: skip
    res["most_added_calls"] = [
        (k, round(ibex.get(k, (0, 0))[0], 1), round(base.get(k, (0, 0))[0], 1)) for k in rows[:40]
    ]
    return res


def _write_results(name: str, data: object) -> None:
    """`data` as JSON in benchmarks/results/`name`."""
    import json

    path = Path(__file__).resolve().parents[1] / "results" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {path}")


def main(argv: list[str] | None = None) -> None:
    import argparse
    import statistics

    p = argparse.ArgumentParser(description=USAGE.splitlines()[0])
    p.add_argument("--rate", type=int, default=100)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--pythonpath", default="", help="a directory put before the checkout")
    p.add_argument(
        "--versus",
        type=Path,
        default=None,
        help="another checkout: alternate the two (CPU per answer) instead",
    )
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--saturated", action="store_true", help="with --versus: closed loop")
    p.add_argument(
        "--calls", action="store_true", help="function calls per answer (cProfile), ibex vs floor"
    )
    p.add_argument("--micro", action="store_true", help="the memory pool's steps, µs of CPU")
    p.add_argument(
        "--syscalls", action="store_true", help="syscalls per answer (strace -c), with --versus too"
    )
    args = p.parse_args(argv)
    if args.syscalls:
        from benchmarks.load.stack import ROOT

        roots = [ROOT] if args.versus is None else [ROOT, args.versus]
        got = syscalls(roots, args.rate, args.seconds, args.rounds)
        runs_all = [r for runs in got.values() for r in runs]
        names = sorted({k for r in runs_all for k in r},
                       key=lambda k: -max(r.get(k, [0, 0])[0] for r in runs_all))  # fmt: skip
        print(f"syscalls per answer at {args.rate} rps (h2load, strace -f -c), per round; "
              "failed ones in brackets")  # fmt: skip
        for root, runs in got.items():
            print(f"-- {root}")
            for name in [*names, "total"]:
                if name == "total":
                    per = [(sum(c for c, _ in r.values()), sum(e for _, e in r.values()))
                           for r in runs]  # fmt: skip
                else:
                    per = [tuple(r.get(name, [0.0, 0.0])) for r in runs]
                if max(c for c, _ in per) >= 0.05:
                    cells = " ".join(f"{c:6.2f} ({e:.2f})" for c, e in per)
                    print(f"   {name:18s} {cells}")
        _write_results("load.profile_syscalls.json", got)
        return
    if args.micro:
        for name, v in micro(args.rounds).items():
            print(f"{name:28s} µs CPU median {statistics.median(v):7.1f} "
                  f"(min {min(v):.1f} max {max(v):.1f}, {len(v)} rounds)")  # fmt: skip
        return
    if args.calls:
        res = calls_versus_floor(args.rate, args.seconds)
        per = res["calls_per_answer"]
        assert isinstance(per, dict)
        print(f"Python function calls per answer at {args.rate} rps: ibex {per['ibex']}, "
              f"floor {per['floor']} (answers {res['answers']})")  # fmt: skip
        print(f"{'ibex':>8s} {'floor':>8s}  function (most calls added first)")
        for name, a, b in res["most_added_calls"]:  # type: ignore[attr-defined]
            print(f"{a:8.1f} {b:8.1f}  {name}")
        _write_results("load.profile_calls.json", res)
        return
    if args.versus is not None:
        ab = alternate(args.versus, None if args.saturated else args.rate, args.seconds,
                       args.rounds)  # fmt: skip
        for name in ("this", "other"):
            v, r = ab[name], ab[name + "_rps"]
            print(f"{name:6s} CPU ms/answer median {statistics.median(v):.3f} "
                  f"(min {min(v):.3f} max {max(v):.3f}) "
                  f"answers/s {statistics.median(r):.0f}  {v}")  # fmt: skip
        return
    res = versus_floor(args.rate, args.seconds, args.pythonpath)
    ibex, floor = res["ibex"], res["floor"]
    assert isinstance(ibex, dict) and isinstance(floor, dict)
    ci, cf = ibex["cpu_ms_per_answer"], floor["cpu_ms_per_answer"]
    print(f"CPU ms/answer at {args.rate} rps (h2load): ibex {ci}, floor {cf}, "
          f"ratio {ci / cf if cf else float('nan'):.2f}")  # fmt: skip
    gi, gf = dict(ibex["groups"]), dict(floor["groups"])
    print(f"{'group':34s} {'ibex ms':>8s} {'floor ms':>8s} {'added':>8s}")
    for g in sorted(set(gi) | set(gf), key=lambda g: -(gi.get(g, 0) * ci - gf.get(g, 0) * cf)):
        a, b = gi.get(g, 0.0) * ci / 100, gf.get(g, 0.0) * cf / 100
        print(f"{g:34s} {a:8.3f} {b:8.3f} {a - b:8.3f}")
    print("-- ibex, top by self time (% of samples)")
    for name, pct in ibex["self"][:20]:
        print(f"   {pct:6.2f}  {name}")
    _write_results("load.profile_versus_floor.json", res)


if __name__ == "__main__":
    main()
