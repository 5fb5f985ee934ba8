"""The short version of the load test (load.py; docs/hardening.md, "Load"): 16 clients creating,
training and deleting small jobs against one ranncd for 100 s, with slow-loris sockets and a
stalled state_dict reader in the second half. Bounds, each with room for a loaded 2-core
machine and none that a leak or a stuck daemon would meet:
- no error other than RESOURCE_EXHAUSTED on creation (the expected back-pressure), every client
  finishes jobs, the daemon stops cleanly on SIGTERM afterwards;
- the adversaries do not stall the others: steps go on while they hold their sockets and
  stream, with p99 latency within 4x (plus a second) of before;
- the daemon's footprint goes back: once every client and adversary has gone, an idle daemon
  holds the file descriptors it held idle before the load (after one warm-up job; within 4), its
  threads within 16 (gRPC's sync server reaps the pollers it added under load lazily), and its
  RSS within 256 MiB. A leaked job, descriptor or thread per creation would be hundreds after
  the hundreds of jobs the run makes; under ASan, whose quarantine keeps freed memory, RSS is
  not bounded.
The slopes over the phases are printed, not bounded: over 30-40 s of job churn they swing by
a hundred descriptors a minute either way (the long run in docs/benchmarks.md reports them over
minutes)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import load  # noqa: E402


def test_load_with_slow_loris_and_a_stalled_reader():
    s = load.run(clients=16, seconds=100, warmup=20, steps=5, workers=2, loris=16, stalled=1,
                 timeout=60.0)
    report = load.render(s)
    print(report)
    assert s["errors_by_code"] == {}, report + "\n" + s["daemon_log_tail"]
    assert s["daemon_exit"] == 0, report + "\n" + s["daemon_log_tail"]
    assert s["clients_reported"] == 16, report
    assert s["clients_without_a_job"] == 0, report
    assert s["adversaries"]["stalled_streams"] == 1 and not s["adversaries"]["errors"], report
    assert s["adversaries"]["connections"] >= 16, report
    before, during = s["phases"]["clients only"], s["phases"]["with adversaries"]
    assert before["steps"] > 0 and during["steps"] > 0, report
    assert (during["step_latency_s"]["p99"]
            <= 4 * before["step_latency_s"]["p99"] + 1.0), report
    idle_before, idle_after = s["idle"]["before"], s["idle"]["after"]
    assert idle_after["fds"] <= idle_before["fds"] + 4, report
    # gRPC's sync server reaps the pollers it added under load lazily (+2 and +3 seen idle).
    assert idle_after["threads"] <= idle_before["threads"] + 16, report
    if not os.environ.get("RANNC_SANITIZER"):
        assert idle_after["rss_mib"] <= idle_before["rss_mib"] + 256, report

if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
