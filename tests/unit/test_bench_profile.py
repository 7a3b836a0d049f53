"""benchmarks.load.profile: reading `strace -c`'s summary for syscalls per answer."""

from __future__ import annotations

from pathlib import Path

from benchmarks.load.profile import _strace_counts

# `strace -f -c -o FILE` as strace 6 writes it: the errors column is blank when none failed.
SUMMARY = """\
% time     seconds  usecs/call     calls    errors syscall
------ ----------- ----------- --------- --------- ----------------
 45.10    0.012000           2      4286           epoll_wait
 20.00    0.005000           2      3022      1200 recvfrom
  5.00    0.001000           1      1824           sendto
------ ----------- ----------- --------- --------- ----------------
100.00    0.018000           2      9132      1200 total
"""


def test_the_summary_gives_calls_and_errors_per_syscall(tmp_path: Path) -> None:
    path = tmp_path / "strace.txt"
    path.write_text(SUMMARY)
    assert _strace_counts(path) == {
        "epoll_wait": (4286, 0),
        "recvfrom": (3022, 1200),
        "sendto": (1824, 0),
    }
