"""Loaded into `python -m ibex serve` by `benchmarks.load.bursts --probe` (via PYTHONPATH) only.

Marks each step of a call's directive read on one clock (`time.perf_counter`,
milliseconds), keyed by the call's agent (a burst's calls are for different
agents): the request decoded, the crossing into Trio, the directive branch's
start, the cache's read task (or, for a read started on the asyncio side, the
moment it takes the queued keys), the GET's asyncio side (connection leased,
command sent, reply bytes fed to the stream, reply parsed), the return to
Trio, the branch's end, the work done as branches land, the pipeline and the
send, each with the number of Trio scheduler passes (I/O checks) so far. A Trio
instrument records each task step longer than 0.2 ms (with its CPU time) and
counts every task step. It wraps the daemon's
functions from outside; nothing here is part of ibex. The events are written
as JSON to $IBEX_BURST_PROBE_OUT when the daemon exits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextvars
import json
import os
import sys
import time
import weakref
from typing import Any


def _install() -> None:
    import redis.asyncio as aredis
    import trio

    import ibex.service.assembler as assembler_module
    import ibex.service.convert as convert_module
    import ibex.service.handlers as handlers_module
    import ibex.sources.directive_cache as cache_module
    import ibex.sources.redis_directive as redis_module
    import ibex.sources.retrieval as retrieval_module

    events: list[tuple[float, str, str, int]] = []  # (ms, agent, step, scheduler passes)
    steps: list[tuple[float, float, float, str]] = []  # (start ms, ms, CPU ms, task name)
    counted = [0]
    passes = [0]  # passes of the Trio scheduler (one I/O check each)
    installed = [False]
    agents: dict[str, str] = {}  # request_id -> agent
    reading: contextvars.ContextVar[str] = contextvars.ContextVar("reading", default="")
    readers: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()

    def mark(agent: str, step: str) -> None:
        events.append((time.perf_counter() * 1000.0, agent[-4:], step, passes[0]))

    class Steps(trio.abc.Instrument):
        t0 = c0 = 0.0

        def after_io_wait(self, timeout: float) -> None:
            passes[0] += 1

        def before_task_step(self, task: Any) -> None:
            self.t0, self.c0 = time.perf_counter(), time.thread_time()

        def after_task_step(self, task: Any) -> None:
            counted[0] += 1
            d = time.perf_counter() - self.t0
            if d > 0.0002:
                cpu = (time.thread_time() - self.c0) * 1000.0
                steps.append((self.t0 * 1000.0, d * 1000.0, cpu, task.name[-40:]))

    from_proto = convert_module.request_from_proto

    def timed_from_proto(msg: Any) -> Any:
        request = from_proto(msg)
        agents[request.request_id] = request.agent_id
        mark(request.agent_id, "decoded")
        return request

    convert_module.request_from_proto = timed_from_proto

    in_trio = handlers_module.ContextService._assemble_in_trio

    async def timed_in_trio(self: Any, request: Any, *a: Any) -> Any:
        if not installed[0]:
            trio.lowlevel.add_instrument(Steps())
            installed[0] = True
        mark(request.agent_id, "in trio")
        return await in_trio(self, request, *a)

    handlers_module.ContextService._assemble_in_trio = timed_in_trio  # type: ignore[method-assign]

    directive = retrieval_module._directive

    async def timed_directive(src: Any, org: str, agent: str, version: str) -> Any:
        mark(agent, "branch start")
        try:
            return await directive(src, org, agent, version)
        finally:
            mark(agent, "branch end")

    retrieval_module._directive = timed_directive

    read = getattr(cache_module.DirectiveCache, "_read", None)
    if read is not None:  # one task per key

        async def timed_read(self: Any, key: Any, version: str, refresh: Any) -> None:
            mark(key[1], "cache read task")
            await read(self, key, version, refresh)

        cache_module.DirectiveCache._read = timed_read  # type: ignore[attr-defined]
    # The batched reads of missed keys: `DirectiveReads` (ibex.sources.directive_reads),
    # or the cache itself in code from before that module (a `--versus` checkout).
    try:
        import ibex.sources.directive_reads as reads_module

        reads_class: Any = reads_module.DirectiveReads
    except ImportError:
        reads_class = cache_module.DirectiveCache
    queued = getattr(reads_class, "_read_queued", None)
    if queued is not None:  # one task per batch of keys

        async def timed_queued(self: Any) -> None:
            for key in self._queued:
                mark(key[1], "cache read task")
            await queued(self)

        reads_class._read_queued = timed_queued
    take = getattr(reads_class, "_take", None)
    if take is not None:  # a read started on the asyncio side takes the queued keys

        def timed_take(self: Any, batch: Any) -> Any:
            wanted = take(self, batch)
            for _, agent, _ in wanted:
                mark(agent, "cache read task")
            return wanted

        reads_class._take = timed_take
    prefetch = getattr(cache_module.DirectiveCache, "prefetch", None)
    if prefetch is not None:

        def timed_prefetch(self: Any, org: str, agent: str, version: str) -> None:
            mark(agent, "prefetch")
            prefetch(self, org, agent, version)

        cache_module.DirectiveCache.prefetch = timed_prefetch  # type: ignore[attr-defined]

    get_directive = redis_module.RedisDirectiveSource.get_directive

    async def timed_get_directive(self: Any, org: str, agent: str, version: str = "") -> Any:
        try:
            return await get_directive(self, org, agent, version)
        finally:
            mark(agent, "back in trio")

    redis_module.RedisDirectiveSource.get_directive = timed_get_directive  # type: ignore[method-assign]

    aio_get = redis_module.RedisDirectiveSource._get

    async def timed_aio_get(self: Any, key: str) -> Any:
        agent = key.rsplit(":", 1)[-1]
        reading.set(agent)
        mark(agent, "asyncio get")
        try:
            return await aio_get(self, key)
        finally:
            mark(agent, "reply parsed")

    redis_module.RedisDirectiveSource._get = timed_aio_get  # type: ignore[method-assign]
    aio_get_many = getattr(redis_module.RedisDirectiveSource, "_get_many", None)
    if aio_get_many is not None:

        async def timed_aio_get_many(self: Any, keys: list[str], *more: Any) -> Any:
            agents = [key.rsplit(":", 1)[-1] for key in keys]
            reading.set(agents[0])
            for agent in agents:
                mark(agent, "asyncio get")
            try:
                return await aio_get_many(self, keys, *more)
            finally:
                for agent in agents:
                    mark(agent, "reply parsed")

        redis_module.RedisDirectiveSource._get_many = timed_aio_get_many  # type: ignore[attr-defined]

    get_connection = aredis.ConnectionPool.get_connection

    async def marked_get_connection(self: Any, *a: Any, **k: Any) -> Any:
        conn = await get_connection(self, *a, **k)
        agent = reading.get()
        if agent:
            mark(agent, "leased")
            if conn._reader is not None:
                readers[conn._reader] = agent
        return conn

    aredis.ConnectionPool.get_connection = marked_get_connection  # type: ignore[method-assign]

    feed = asyncio.StreamReader.feed_data

    def timed_feed(self: Any, data: bytes) -> None:
        agent = readers.get(self)
        if agent is not None:
            events.append((time.perf_counter() * 1000.0, agent[-4:], "reply bytes", passes[0]))
        feed(self, data)

    asyncio.StreamReader.feed_data = timed_feed  # type: ignore[method-assign]

    try:  # the feed's module, or the assembler of an older checkout
        from ibex.service.early_feed import EarlyAssemblyFeed as feed_class
    except ImportError:
        feed_class = assembler_module._EarlyAssemblyFeed
    landed = feed_class.branch_ended

    def timed_landed(self: Any, source: str, value: Any) -> None:
        agent = self.assembly.request.agent_id if self.assembly is not None else "?"
        mark(agent, f"landed {source}")
        landed(self, source, value)
        mark(agent, f"landed {source} done")

    feed_class.branch_ended = timed_landed  # type: ignore[method-assign]

    pure = assembler_module.assemble_pure

    def timed_pure(inputs: Any, **kw: Any) -> Any:
        mark(inputs.request.agent_id, "pipeline")
        try:
            return pure(inputs, **kw)
        finally:
            mark(inputs.request.agent_id, "pipeline done")

    assembler_module.assemble_pure = timed_pure

    send = getattr(handlers_module.ContextService, "_send_assembly", None)
    if send is not None:  # a checkout whose handler sends every answer from asyncio

        async def timed_send(self: Any, stream: Any, result: Any) -> None:
            agent = agents.pop(result.request_id, "?")
            mark(agent, "send")
            await send(self, stream, result)
            mark(agent, "sent")

        handlers_module.ContextService._send_assembly = timed_send  # type: ignore[method-assign]

    reply = getattr(handlers_module, "_reply", None)
    if reply is not None:  # the reply is made where the answer is, and written from there
        import ibex.service.edge.crossing as crossing_module

        def timed_reply(result: Any) -> Any:
            mark(agents.get(result.request_id, "?"), "send")
            return reply(result)

        handlers_module._reply = timed_reply
        now_send = crossing_module.send_reply_now
        late_send = crossing_module.send_reply

        def timed_now(stream: Any, metadata: Any, message: Any) -> bool:
            done = now_send(stream, metadata, message)
            if done:
                mark(agents.pop(message.request_id, "?"), "sent")
            return done

        async def timed_late(stream: Any, metadata: Any, message: Any) -> None:
            await late_send(stream, metadata, message)
            mark(agents.pop(message.request_id, "?"), "sent")

        crossing_module.send_reply_now = timed_now
        crossing_module.send_reply = timed_late

    def report() -> None:
        out = os.environ.get("IBEX_BURST_PROBE_OUT")
        if out:
            with open(out, "w") as f:
                json.dump({"events": events, "steps": steps, "task_steps": counted[0]}, f)

    atexit.register(report)


if "serve" in sys.argv and os.environ.get("IBEX_BURST_PROBE_OUT"):
    _install()
