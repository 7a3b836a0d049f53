"""Loaded into `python -m ibex serve` by `benchmarks.load.after_wall` (via PYTHONPATH) only.

Times each step of a call whose retrieval was cut by its wall, from the wall
instant (the call's arrival on the Trio clock plus `RetrievalConfig.time_limit`):
the first wake of the loop after it, the cold branch's cancellation reaching
`MemoryHttpSource.cold`, retrieval's return, the pipeline, the crossing back
to asyncio (or the reply made on the Trio side, where it is written from), and
the send; for an answer made before the wall and handed over
at it (`ibex.service.early_feed.EarlyAssemblyFeed.wall_reached`), the hand-over
instead of retrieval's
return and the pipeline, and the speculation's own time. It wraps the daemon's
functions from outside (those a checkout lacks are left alone);
nothing here is part of ibex. Figures (milliseconds per call) are written as
JSON to $IBEX_WALL_PROBE_OUT when the daemon exits.
"""

from __future__ import annotations

import atexit
import bisect
import collections
import json
import os
import sys
import time
from typing import Any


def _install() -> None:
    import trio

    import ibex.ops.metrics as metrics_module
    import ibex.service.assembler as assembler_module
    import ibex.service.convert as convert_module
    import ibex.service.handlers as handlers_module
    import ibex.sources.memory_http as memory_http

    steps: dict[str, list[float]] = collections.defaultdict(list)
    # A call's marks [wall_at, retrieved, pipeline_end], by its Trio task until the pipeline
    # has run, then by its result: not by request id, which a load generator may repeat.
    calls: dict[Any, list[float]] = {}
    answers: dict[int, list[float]] = {}
    cancelled: dict[Any, float] = {}
    wakes: collections.deque[float] = collections.deque(maxlen=4096)
    installed = [False]

    def timed(name: str, fn: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                steps[name].append((time.perf_counter() - t0) * 1000)

        return run

    # Each Trio task step's end, task name and length: what runs between a wake and the
    # hand-over.
    task_steps: collections.deque[tuple[float, str, float]] = collections.deque(maxlen=8192)
    step_start = [0.0]

    class Wakes(trio.abc.Instrument):
        def after_io_wait(self, timeout: float) -> None:
            wakes.append(trio.current_time())

        def before_task_step(self, task: Any) -> None:
            step_start[0] = time.perf_counter()

        def after_task_step(self, task: Any) -> None:
            took = time.perf_counter() - step_start[0]
            task_steps.append((trio.current_time(), task.name.rsplit(".", 1)[-1], took))

    retrieve = assembler_module.retrieve
    walls: dict[int, float] = {}  # a call's wall instant, by its wall listener

    async def timed_retrieve(request: Any, **kw: Any) -> Any:
        if not installed[0]:
            trio.lowlevel.add_instrument(Wakes())
            installed[0] = True
        arrived = kw.get("arrived")
        listener = kw.get("wall_listener")
        if listener is not None and arrived is not None:
            walls[id(listener)] = arrived + kw["config"].time_limit
        try:
            got = await retrieve(request, **kw)
        finally:
            if listener is not None:
                walls.pop(id(listener), None)
        now = trio.current_time()
        task = trio.lowlevel.current_task()
        cancel = cancelled.pop(task, None)
        if arrived is None or not any(b.status == "timeout" for b in got.branches):
            return got
        wall_at = arrived + kw["config"].time_limit
        if cancel is not None:
            steps["2 cold branch cancelled"].append((cancel - wall_at) * 1000)
        if listener is not None and getattr(listener, "answer", None) is not None:
            # Made before the wall: the wake and the rest are the hand-over's steps.
            steps["3 retrieval returns (answer made early)"].append((now - wall_at) * 1000)
            return got
        seen = list(wakes)
        i = bisect.bisect_left(seen, wall_at)
        if i < len(seen):
            steps["1 loop wakes after the wall"].append((seen[i] - wall_at) * 1000)
        steps["3 retrieval returns"].append((now - wall_at) * 1000)
        if len(calls) >= 4096:  # calls that never reached the pipeline
            calls.clear()
        calls[task] = [wall_at, now]
        return got

    assembler_module.retrieve = timed_retrieve

    cold = memory_http.MemoryHttpSource.cold

    async def timed_cold(self: Any, *a: Any, **k: Any) -> Any:
        try:
            return await cold(self, *a, **k)
        except BaseException:
            cancelled[trio.lowlevel.current_task()] = trio.current_time()
            raise

    memory_http.MemoryHttpSource.cold = timed_cold  # type: ignore[method-assign]

    try:  # the feed's module, or the assembler of an older checkout
        from ibex.service.early_feed import EarlyAssemblyFeed as feed
    except ImportError:
        feed = getattr(assembler_module, "_EarlyAssemblyFeed", None)
    wall_reached = getattr(feed, "wall_reached", None)
    if feed is not None and wall_reached is not None:

        def handed(wall_at: float, result: Any) -> None:
            now = trio.current_time()
            wake = None  # the first wake after the wall: walked from the newest, cheaply
            for seen in reversed(wakes):
                if seen < wall_at:
                    break
                wake = seen
            if wake is not None:
                steps["1 loop wakes after the wall"].append((wake - wall_at) * 1000)
                ran = []
                for end, name, took in reversed(task_steps):
                    if end < wake:
                        break
                    ran.append((name, took))
                steps["1b task steps from the wake to the hand-over (count)"].append(len(ran))
                total = sum(took for _, took in ran) * 1000
                steps["1c their time, in all"].append(total)
                steps["1d the rest (scheduler, preemption)"].append((now - wake) * 1000 - total)
                by_name: dict[str, float] = collections.defaultdict(float)
                for name, took in ran:
                    by_name[name] += took * 1000
                for name, ms in by_name.items():
                    steps[f"1e of which {name}"].append(ms)
            steps["3h answer ready (handed over) at the wall"].append((now - wall_at) * 1000)
            if len(answers) >= 4096:
                answers.clear()
            # The probe's own time above is left out of the steps that follow.
            answers[id(result)] = [wall_at, now, trio.current_time(), 1.0]  # 1.0: handed over

        def timed_wall_reached(self: Any, got: Any) -> None:
            wall_at = walls.get(id(self))
            handoff = self.handoff
            if wall_at is None or handoff is None:
                wall_reached(self, got)
                return

            # Followed as it is handed over: the hand-over may send it at once.
            def marked(result: Any) -> None:
                handed(wall_at, result)
                handoff(result)

            self.handoff = marked
            try:
                wall_reached(self, got)
            finally:
                self.handoff = handoff

        feed.wall_reached = timed_wall_reached
        speculate = getattr(assembler_module.Assembler, "_speculate", None)
        if speculate is not None:
            assembler_module.Assembler._speculate = timed(  # type: ignore[attr-defined]
                "0 answer made before the wall (its own time)", speculate
            )

    pure = assembler_module.assemble_pure

    def timed_pure(inputs: Any, **kw: Any) -> Any:
        result = pure(inputs, **kw)
        try:
            mark = calls.pop(trio.lowlevel.current_task(), None)
        except RuntimeError:  # in a worker thread: not followed
            return result
        if mark is not None:
            mark.append(trio.current_time())
            if len(answers) >= 4096:  # calls that never reached the send
                answers.clear()
            answers[id(result)] = mark
        return result

    assembler_module.assemble_pure = timed_pure

    def sent(mark: list[float], start: float, end: float, crossed: bool) -> None:
        wall_at, retrieved, piped = mark[:3]
        handed_over = len(mark) > 3
        if piped > retrieved and not handed_over:
            steps["4 pipeline (after retrieval)"].append((piped - retrieved) * 1000)
        if crossed:
            steps["5 crossing back to asyncio"].append((start - piped) * 1000)
        else:
            path = "handed over" if handed_over else "pipeline"
            steps[f"5 reply made on the Trio side ({path})"].append((start - piped) * 1000)
        steps["6 send (convert, metrics, grpclib)"].append((end - start) * 1000)
        steps["after the wall, in all"].append((end - wall_at) * 1000)

    send = getattr(handlers_module.ContextService, "_send_assembly", None)
    if send is not None:  # a checkout whose handler sends every answer from asyncio

        async def timed_send(self: Any, stream: Any, result: Any) -> None:
            start = trio.current_time()
            await send(self, stream, result)
            mark = answers.pop(id(result), None)
            if mark is not None and len(mark) >= 3:
                sent(mark, start, trio.current_time(), True)

        handlers_module.ContextService._send_assembly = timed_send  # type: ignore[method-assign]

    reply = getattr(handlers_module, "_reply", None)
    if reply is not None:  # the reply is made where the answer is, and written from there
        import ibex.service.edge.crossing as crossing_module

        replies: dict[int, tuple[list[float], float]] = {}  # by the message: mark, start

        def timed_reply(result: Any) -> Any:
            start = trio.current_time()
            got = reply(result)
            mark = answers.pop(id(result), None)
            if mark is not None and len(mark) >= 3:
                if len(replies) >= 4096:
                    replies.clear()
                replies[id(got[1])] = (mark, start)
            return got

        handlers_module._reply = timed_reply
        now_send = crossing_module.send_reply_now
        late_send = crossing_module.send_reply

        def timed_now(stream: Any, metadata: Any, message: Any) -> bool:
            done = now_send(stream, metadata, message)
            if done and (got := replies.pop(id(message), None)) is not None:
                sent(got[0], got[1], trio.current_time(), False)
            return done

        async def timed_late(stream: Any, metadata: Any, message: Any) -> None:
            steps["6c answers the Trio side could not write"].append(0.0)
            got = replies.pop(id(message), None)
            start = trio.current_time()
            await late_send(stream, metadata, message)
            if got is not None:
                sent(got[0], start, trio.current_time(), True)

        crossing_module.send_reply_now = timed_now
        crossing_module.send_reply = timed_late

    convert_module.response_to_proto = timed(
        "6a of which response_to_proto", convert_module.response_to_proto
    )
    metrics_module.Metrics.observe_assembly = timed(  # type: ignore[method-assign]
        "6b of which observe_assembly", metrics_module.Metrics.observe_assembly
    )

    def report() -> None:
        out = os.environ.get("IBEX_WALL_PROBE_OUT")
        # Only a process that served calls writes (a supervisor has no steps to report).
        if out and steps:
            with open(out, "w") as f:
                json.dump(steps, f)

    atexit.register(report)


if "serve" in sys.argv and os.environ.get("IBEX_WALL_PROBE_OUT"):
    _install()
