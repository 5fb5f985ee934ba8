"""Entry point of the py_test targets: runs pytest on the test files named in argv.

Bazel runs this from the runfiles tree; the test files, conftest.py and the pyrannc package sit
beside it there. Arguments that name files are relative to this directory.
"""

import os
import sys

import pytest


def main() -> int:
    here = os.path.dirname(os.path.abspath(__file__))
    args = [a if a.startswith("-") or os.path.isabs(a) else os.path.join(here, a)
            for a in sys.argv[1:]]
    # The runfiles tree is read-only: no .pytest_cache, no bytecode next to the sources.
    sys.dont_write_bytecode = True
    return pytest.main(["-v", "-p", "no:cacheprovider", "--rootdir", here, *args])


if __name__ == "__main__":
    sys.exit(main())
