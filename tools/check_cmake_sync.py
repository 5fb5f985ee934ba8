#!/usr/bin/env python3
"""Checks that every CMakeLists.txt has the cc targets of the BUILD file beside it.

For each BUILD file with a CMakeLists.txt beside it, every cc_library / cc_binary / cc_test must
appear there (rannc_cc_library under its label's CMake name, binaries and tests under their own)
with the same source and header files (either list), the same in-repo dependencies and the same
third-party ones (//third_party:NAME is rannc::NAME; catch2_main, which rannc_cc_test links by
itself, is not compared). Prints each difference and exits 1 if there is any. CI runs it before the CMake build (.ci/run); docs/building.md says why the two builds
exist.
"""
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cmake_name(package, name, kind):
    if kind != "cc_library":
        return name
    return (package + ":" + name).replace("/", "_").replace(":", "_")


def bazel_targets(package):
    """{cmake name: (srcs and hdrs, in-repo deps as cmake names, third-party deps as rannc::NAME)}
    of a BUILD file."""
    targets = {}

    def rule(kind):
        def record(name, srcs=(), hdrs=(), deps=(), **_):
            internal, external = set(), set()
            for dep in deps:
                if dep.startswith(":"):
                    dep = "//" + package + dep
                if dep.startswith("//third_party:"):
                    if dep != "//third_party:catch2_main":
                        external.add("rannc::" + dep.partition(":")[2])
                    continue
                if not dep.startswith("//") or dep.startswith("//third_party"):
                    continue
                dep_package, _, dep_name = dep[2:].partition(":")
                dep_name = dep_name or os.path.basename(dep_package)
                internal.add(cmake_name(dep_package, dep_name, "cc_library"))
            targets[cmake_name(package, name, kind)] = (set(srcs) | set(hdrs), internal, external)
        return record

    def ignore(*_, **__):
        return None

    class Anything(dict):
        def __missing__(self, key):
            if key in ("cc_library", "cc_binary", "cc_test"):
                return rule(key)
            if key in ("glob", "select"):
                return lambda *a, **k: []
            return ignore

    with open(os.path.join(ROOT, package, "BUILD")) as f:
        source = f.read()
    source = re.sub(r"^load\(.*?\)\s*$", "", source, flags=re.M | re.S)
    exec(compile(source, package + "/BUILD", "exec"), Anything(__builtins__={}))
    return targets


def cmake_targets(package):
    """The same map from a CMakeLists.txt's rannc_cc_* calls."""
    with open(os.path.join(ROOT, package, "CMakeLists.txt")) as f:
        text = re.sub(r"#.*", "", f.read())
    targets = {}
    for kind, body in re.findall(r"rannc_cc_(library|binary|test|proto_library)\(([^)]*)\)", text):
        words = body.split()
        fields, key = {"SRCS": [], "HDRS": [], "DEPS": []}, None
        for word in words[1:]:
            if word.isupper() and word.replace("_", "").isalpha():
                key = word
            elif key in fields:
                fields[key].append(word)
        deps = {d for d in fields["DEPS"] if not d.startswith(("rannc::", "third_party_", "Threads::"))
                and not d.startswith("$")}
        external = {d for d in fields["DEPS"] if d.startswith("rannc::")}
        if kind == "proto_library":  # generated sources, compared by name only
            targets[words[0]] = None
            continue
        targets[words[0]] = (set(fields["SRCS"]) | set(fields["HDRS"]), deps, external)
    return targets


def main():
    problems = []
    for dirpath, dirnames, filenames in os.walk(ROOT):
        dirnames[:] = [d for d in dirnames if not d.startswith((".", "bazel-", "build"))]
        if "BUILD" not in filenames or "CMakeLists.txt" not in filenames:
            continue
        package = os.path.relpath(dirpath, ROOT)
        if package.startswith("third_party"):
            continue
        want, have = bazel_targets(package), cmake_targets(package)
        for name, (files, deps, external) in sorted(want.items()):
            if name not in have:
                problems.append(f"{package}/CMakeLists.txt: no {name}")
                continue
            if have[name] is None:
                continue
            for what, a, b in (("sources and headers", files, have[name][0]),
                               ("in-repo deps", deps, have[name][1]),
                               ("third-party deps", external, have[name][2])):
                if a != b:
                    problems.append(f"{package}/CMakeLists.txt: {name}'s {what} differ from "
                                    f"BUILD: missing {sorted(a - b)}, extra {sorted(b - a)}")
    for p in problems:
        print(p)
    print(f"check_cmake_sync: {len(problems)} difference(s)")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
