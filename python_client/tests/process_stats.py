"""A process's footprint read from /proc, and least-squares trends of samples: what the load test
(tests/daemon/load.py) and bad-input test's memory bound measure a daemon by."""

import os
import re


def footprint(pid):
    """(RSS in MiB, open file descriptors, threads) of process `pid`."""
    with open(f"/proc/{pid}/status") as f:
        status = f.read()
    rss_kib = int(re.search(r"VmRSS:\s+(\d+)", status).group(1))
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return rss_kib / 1024, len(os.listdir(f"/proc/{pid}/fd")), threads


def slope(points):
    """The least-squares slope of (x, y) points; None with fewer than 3 or all x equal."""
    if len(points) < 3:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    den = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / den if den else None
