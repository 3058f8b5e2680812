"""unittest_run.py - runs a test's Python unittest modules for ctest; a skip is not a pass.

Usage (from the test's folder, as `python3 -m unittest -v` would be run):
    python3 tests/harness/unittest_run.py <module or module.Class.test>...

Exit status: 0 when tests ran and every one passed; 77 when none failed but some were skipped
(with their reasons printed); 1 on any failure, error or unexpected success, or when nothing ran.
ctest treats 77 as a skip only for tests listed in tests/skip-allowed.txt (SKIP_RETURN_CODE is set
on those alone); for any other test it is a failure, and scripts/test.sh fails on any skip of an
unlisted test (docs/testing.md).
"""
import os
import sys
import unittest

SKIPPED = 77


def main(names):
    if not names:
        sys.exit(__doc__)
    sys.path.insert(0, os.getcwd())  # as `python3 -m unittest` does
    suite = unittest.defaultTestLoader.loadTestsFromNames(names)
    result = unittest.TextTestRunner(verbosity=2).run(suite)
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
