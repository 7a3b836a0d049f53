"""precise_wakeup: Trio's waits end at their deadline, not at the next whole millisecond.

No timing is asserted as a speed: these pin when the timer is armed, that a wait
never ends early, that stale expiries never reach Trio, and that everything is
undone at exit. The lateness itself is measured by `python -m benchmarks.timer_lateness`.
"""

from __future__ import annotations

import math
import os
import time

import pytest
import trio
import trio.lowlevel

from ibex.patches import trio_epoll as precise_wakeup
from ibex.patches.trio_epoll import TimerFd, precise_wakeups, wants_timer


@pytest.mark.parametrize(
    ("timeout", "armed"),
    [
        (0.0402, True),  # epoll would wait 41 ms
        (0.0025, True),
        (0.000_3, True),  # under a millisecond: epoll would wait a whole one
        (0.040, False),  # whole milliseconds: epoll is on time
        (0.040_01, False),  # within the slack above a whole millisecond
        (0.0, False),  # a poll, not a wait
        (math.inf, False),
        (86_400.0, False),
    ],
)
def test_only_waits_that_epoll_would_round_up_arm_the_timer(timeout: float, armed: bool) -> None:
    assert wants_timer(timeout) is armed


async def test_waits_end_at_or_after_their_deadline_never_before() -> None:
    with precise_wakeups() as on:
        assert on
        for i in range(40):
            d = 0.0011 + i * 0.000_07
            t0 = time.perf_counter()
            await trio.sleep(d)
            assert time.perf_counter() - t0 >= d


async def test_the_timer_is_armed_with_the_waits_own_timeout(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    armed: list[float] = []
    real_arm = TimerFd.arm
    monkeypatch.setattr(TimerFd, "arm", lambda self, s: (armed.append(s), real_arm(self, s)))
    with precise_wakeups():
        await trio.sleep(0.0034)
    # Trio asks for what is left of the sleep each time it blocks: just under 3.4 ms the
    # first time, less on any later wait (a loaded machine may wake the loop early).
    assert armed and 0.0025 < armed[0] <= 0.0034
    assert all(0 < s <= armed[0] for s in armed)


async def test_a_stale_expiry_is_consumed_and_never_reaches_trio() -> None:
    """An armed timer whose wait ended early fires during a later wait it was not armed for."""
    with precise_wakeups():
        with trio.move_on_after(0.0002):  # arms ~0.2 ms, fires inside the whole-ms wait below
            await trio.sleep_forever()
        precise_wakeup._TIMERS[id(precise_wakeup._io_manager())].arm(0.0005)
        await trio.sleep(0.003)  # whole milliseconds: not armed; the stale expiry arrives
        await trio.lowlevel.checkpoint()


async def test_everything_is_undone_at_exit() -> None:
    with precise_wakeups():
        (timer,) = precise_wakeup._TIMERS.values()
        fd = timer.fd
        os.fstat(fd)
    assert precise_wakeup._TIMERS == {}
    with pytest.raises(OSError):
        os.fstat(fd)
    await trio.sleep(0.0012)  # the patched class falls back to Trio's own wait


def test_outside_trio_it_refuses() -> None:
    with pytest.raises(RuntimeError), precise_wakeups():
        pass
