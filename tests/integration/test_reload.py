#!/usr/bin/env python3
"""SIGHUP through the real daemon (issue 7): it re-reads its --config file and keeps
serving; a changed log_level takes effect at once; a file with an error is logged and
the running settings are kept; keys that need a restart are named; without --config a
SIGHUP changes nothing and harms nothing; SIGTERM afterwards still exits 0.

usage: python3 -m pytest tests/integration/test_reload.py --kvblendd KVBLENDD --kvblend KVBLEND
"""
import os
import signal
import tempfile
import time

import kvbtest


def test_reload(kvblendd, kvblend):
    tmp = tempfile.mkdtemp(prefix="kvb-reload-")
    conf = f"{tmp}/kvblendd.conf"
    check = kvbtest.Checks()
    d = None

    def cli(*args):
        return d.cli(*args)

    def log():
        return d.log_text()

    def write_conf(text):
        with open(conf + ".new", "w") as f:
            f.write("[kvblendd]\n" + text)
        os.replace(conf + ".new", conf)

    def hup_and_wait(d, marker):
        """SIGHUP, then wait for the reload's log line (the count of marker grows)."""
        before = log().count(marker)
        d.send_signal(signal.SIGHUP)
        for _ in range(100):
            if log().count(marker) > before or d.poll() is not None:
                break
            time.sleep(0.05)
        return log().count(marker) > before

    def failing_request():
        """A request that fails (unknown model): the daemon logs it at debug level."""
        return cli("lookup", "--model", "no-such-model", "00" * 32).returncode != 0

    def start(*args):
        nonlocal d
        d = kvbtest.Daemon(kvblendd, kvblend, tmp, "--map-size", "64M", first=args,
                           timeout_ms=2000)
        d.start()
        return d

    write_conf("log_level = info\nworkers = 2\n")
    d = start("--config", conf)
    try:
        check("a failed request is not logged at info", failing_request() and
              "failed:" not in log())

        write_conf("log_level = debug\nworkers = 2\n")
        check("SIGHUP: one line says what was reloaded",
              hup_and_wait(d, "SIGHUP: reloaded") and "log_level info -> debug" in log(), log())
        check("the daemon survives SIGHUP", d.poll() is None, f"status {d.poll()}")
        check("and keeps serving (ping)", cli("ping").returncode == 0)
        check("log_level debug applies at once", failing_request() and "failed:" in log(), log())

        # A file with an error: logged, old settings kept (still debug), still serving.
        write_conf("log_level = loud\nworkers = 2\n")
        check("a bad file is logged", hup_and_wait(d, "keeping the running settings") and
              "log_level: invalid value 'loud'" in log(), log())
        n = log().count("failed:")
        check("after a bad file: still serving, still at debug",
              d.poll() is None and cli("ping").returncode == 0 and failing_request() and
              log().count("failed:") > n, log()[-2000:])

        # A key that only applies at start is named, not silently ignored; info again.
        write_conf("log_level = info\nworkers = 3\n")
        check("restart-only keys are named", hup_and_wait(d, "SIGHUP: reloaded") and
              "log_level debug -> info; changed, applied at the next start only: workers"
              in log(), log()[-2000:])
        n = log().count("failed:")
        check("log_level back to info", failing_request() and log().count("failed:") == n)

        # A burst of SIGHUPs while serving.
        for _ in range(5):
            d.send_signal(signal.SIGHUP)
        time.sleep(0.3)
        check("a burst of SIGHUPs: still serving", d.poll() is None and cli("ping").returncode == 0)
    finally:
        rc = d.stop()
        check("SIGTERM after reloads: exits 0", rc == 0, f"status {rc}")

    # Without --config there is nothing to re-read: SIGHUP is logged and harmless.
    d = start()
    try:
        check("no --config: SIGHUP is harmless",
              hup_and_wait(d, "reloaded the command line (no --config file)") and
              d.poll() is None and cli("ping").returncode == 0, log()[-2000:])
    finally:
        rc = d.stop()
        check("daemon exits 0", rc == 0, f"status {rc}")
    if check.failed:
        print(log()[-4000:])
    kvbtest.remove(tmp)
    check.done()
