#!/usr/bin/env python3
"""Checks that the daemon's folders include each other only downwards (docs/architecture.md):
a file in a folder may include files of its own folder and of the folders below it, never of a
folder above it. Tests (*_test.cc) and test helpers (*_testing.*) are held to the same order.
Exit status 1 with each offending include, 0 when there is none."""

import os
import re
import sys

# Highest first: each folder may include the ones after it.
LAYERS = ["metrics", "server", "checkpoint", "planner", "runtime", "optim", "graph", "comm",
          "config", "cluster", "security", "common"]

INCLUDE = re.compile(r'#include\s+"daemon/([a-z_]+)/')


def folder_of(path, daemon):
    rel = os.path.relpath(path, daemon).split(os.sep)
    return rel[0] if len(rel) > 1 else None


def main():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if len(sys.argv) > 1:
        root = sys.argv[1]
    daemon = os.path.join(root, "daemon")
    bad = []
    for dirpath, _, files in os.walk(daemon):
        for name in files:
            if not name.endswith((".h", ".cc")):
                continue
            path = os.path.join(dirpath, name)
            mine = folder_of(path, daemon)
            if mine not in LAYERS:
                continue
            with open(path, encoding="utf-8") as f:
                for number, line in enumerate(f, 1):
                    m = INCLUDE.search(line)
                    if not m or m.group(1) not in LAYERS:
                        continue
                    if LAYERS.index(m.group(1)) < LAYERS.index(mine):
                        bad.append(f"{os.path.relpath(path, root)}:{number}: {mine}/ includes "
                                   f"{m.group(1)}/, a layer above it")
    for b in bad:
        print(b)
    print(f"check_layers: {len(bad)} include(s) upwards")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
