"""unittest_run.py - runs a test's Python unittest modules for ctest; a skip is not a pass.

Usage (from the test's folder, as `python3 -m unittest -v` would be run):
    python3 tests/harness/unittest_run.py <module or module.Class.test>...

Exit status: 0 when tests ran and every one passed; 77 when none failed but some were skipped
(with their reasons printed); 1 on any failure, error or unexpected success, or when nothing ran.
ctest treats 77 as a skip only for tests listed in tests/skip-allowed.txt (SKIP_RETURN_CODE is set
on those alone); for any other test it is a failure, and scripts/test.sh fails on any skip of an
unlisted test (docs/testing.md).

At the end it prints each test's seconds, longest first (a class's setUpClass counts in its first
test's), so that a slow case shows in ctest's output.
"""
import os
import sys
import time
import unittest

SKIPPED = 77


class TimedResult(unittest.TextTestResult):
    """A TextTestResult that keeps the seconds from one test's end (or the run's start) to the next
    one's, per test."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.mark = time.monotonic()
        self.seconds = []

    def stopTest(self, test):
        super().stopTest(test)
        now = time.monotonic()
        self.seconds.append((now - self.mark, test.id()))
        self.mark = now


def print_seconds(result):
    print("unittest_run: seconds per test, longest first:", file=sys.stderr)
    for secs, name in sorted(result.seconds, reverse=True):
        print(f"  {secs:7.1f}  {name}", file=sys.stderr)


def main(names):
    if not names:
        sys.exit(__doc__)
    sys.path.insert(0, os.getcwd())  # as `python3 -m unittest` does
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    result = unittest.TextTestRunner(verbosity=2, resultclass=TimedResult).run(suite)
    print_seconds(result)
    if not result.wasSuccessful():
        return 1
    if result.testsRun == 0:
        print("unittest_run: no test ran", file=sys.stderr)
        return 1
    if result.skipped:
        print(f"unittest_run: {len(result.skipped)} of {result.testsRun} tests skipped:",
              file=sys.stderr)
        for test, reason in result.skipped:
            print(f"  {test.id()}: {reason}", file=sys.stderr)
        return SKIPPED
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
