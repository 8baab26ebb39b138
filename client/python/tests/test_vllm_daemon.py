"""kvblend.vllm.daemon: the connector's circuit breaker against real sockets (no engine).

A dead endpoint (no socket file, or a socket file nobody listens on) opens the link with
a line that says so; a live daemon that misses its deadlines (stopped with SIGSTOP, as a
busy one is late) pauses kvblend for about a second at a time, and kvblend is used again
within a second of the daemon answering; only a run of more than three late answers
lengthens the pause; the back-off never passes its few-second cap.
Importing kvblend.vllm.daemon imports neither torch nor vLLM.
"""

from __future__ import annotations

import errno
import itertools
import logging
import signal
import socket
import time

import pytest

from kvblend.errors import Timeout, Unavailable
from kvblend.vllm import daemon as link
from kvblend.vllm.daemon import DaemonDown, DaemonLink

#: Deadline of the links' calls (a dead ipc endpoint costs one: ZeroMQ waits for a peer).
TIMEOUT_MS = 200
#: Slack on a wait for the link's pause (a shared 2-core machine).
SLACK_S = 0.05


_ids = itertools.count()


class Log(logging.Handler):
    """A logger of its own (``logger``) and the lines it emitted (``lines``)."""

    def __init__(self) -> None:
        super().__init__()
        self.lines: list[str] = []
        self.logger = logging.getLogger(f"test-vllm-daemon-{next(_ids)}")
        self.logger.propagate = False
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def log():
    return Log()


@pytest.mark.parametrize("dead", ["no socket file", "refused"])
def test_a_dead_endpoint_opens_the_link_and_the_line_says_why(tmp_path, log, dead):
    path = tmp_path / "kvblend.sock"
    if dead == "refused":  # a socket file left by a daemon that is gone
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(path))
        s.close()
    d = DaemonLink(f"ipc://{path}", TIMEOUT_MS, None, log.logger)
    with pytest.raises(Timeout) as e:  # ZeroMQ waits for a peer: the call's deadline
        d.client().ping()
    d.failed(e.value)
    assert d.is_open
    assert len(log.lines) == 1 and dead in log.lines[0], log.lines
    t0 = time.monotonic()
    with pytest.raises(DaemonDown):
        d.client()  # during the back-off: at once, no call
    assert time.monotonic() - t0 < 0.05
    time.sleep(link.BACKOFF_FIRST_S + SLACK_S)
    with pytest.raises(DaemonDown) as e:
        d.client()  # the retry's probe: refused at once
    assert dead in str(e.value)
    assert d.is_open and len(log.lines) == 1


def test_a_slow_spell_pauses_kvblend_about_a_second_at_a_time(daemon, log):
    d = DaemonLink(daemon.endpoint, TIMEOUT_MS, None, log.logger)
    d.client().ping()
    d.ok()
    assert not d.is_open and not log.lines
    daemon.send_signal(signal.SIGSTOP)
    try:
        for late in range(1, 4):  # a busy spell: each try misses its deadline
            try:
                d.client().ping()  # (connecting says hello: a call too)
            except DaemonDown as down:
                pytest.fail(f"try {late}: kvblend still off {link.BACKOFF_FIRST_S + SLACK_S:.2f}"
                            f" s after a late answer: {down}")
            except Timeout as e:
                d.failed(e)
            else:
                pytest.fail("a stopped daemon answered")
            assert d.is_open
            with pytest.raises(DaemonDown):
                d.client()  # paused: at once, no call
            time.sleep(link.BACKOFF_FIRST_S + SLACK_S)
    finally:
        daemon.send_signal(signal.SIGCONT)
    d.client().ping()  # the daemon answers again: kvblend on at once
    d.ok()
    assert not d.is_open
    assert len(log.lines) == 2, log.lines
    assert "timed out" in log.lines[0] and "accepts connections" in log.lines[0], log.lines
    assert "answers again" in log.lines[1]


def test_the_back_off_stays_under_its_cap(tmp_path, log):
    assert link.BACKOFF_MAX_S <= 5
    d = DaemonLink(f"ipc://{tmp_path}/kvblend.sock", TIMEOUT_MS, None, log.logger)
    pauses = []
    for i in range(10):  # failed retries of a daemon that stays down
        d.failed(Unavailable(-errno.ECONNREFUSED, f"refused ({i})"))
        pauses.append(d.retry_in)
    assert pauses[:3] == pytest.approx([1.0, 2.0, 4.0], abs=0.1), pauses
    assert max(pauses) <= link.BACKOFF_MAX_S and pauses[-1] > link.BACKOFF_MAX_S - 0.1, pauses
    assert len(log.lines) == 1 and "refused" in log.lines[0], log.lines


def test_only_a_long_run_of_late_answers_lengthens_the_pause(daemon, log):
    d = DaemonLink(daemon.endpoint, TIMEOUT_MS, None, log.logger)  # live: its probe connects
    pauses = []
    for i in range(7):  # a daemon that stays late: each try times out
        d.failed(TimeoutError(f"late answer {i + 1}"))
        pauses.append(d.retry_in)
    assert pauses == pytest.approx([1.0, 1.0, 1.0, 2.0, 4.0, 5.0, 5.0], abs=0.1), pauses
    assert len(log.lines) == 1 and "timed out" in log.lines[0], log.lines
    d.ok()  # an answer forgets the run
    d.failed(TimeoutError("late again"))
    assert d.retry_in == pytest.approx(1.0, abs=0.1)
