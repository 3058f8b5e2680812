"""bench/metering/pause6.sh's driver: runs test_enforcement_six RUNS times and prints, for each
run, the time from zero seen to each of the 6 vCPU stops, then the last-of-6 figures' median and
maximum. A run whose test fails is reported and the bench exits non-zero."""
import os
import statistics
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "harness"),
                os.path.join(ROOT, "tests", "integration", "metering")]

import test_enforcement_six as t  # noqa: E402


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    lasts = []
    for i in range(runs):
        t.EnforcementSixTests.lags = None
        suite = unittest.defaultTestLoader.loadTestsFromTestCase(t.EnforcementSixTests)
        res = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
        lags = t.EnforcementSixTests.lags
        if not res.wasSuccessful() or res.skipped or not lags:
            print(f"run {i + 1}: failed", flush=True)
            sys.exit(1)
        print(f"run {i + 1}: zero seen -> vCPUs stopped (s): "
              + " ".join(f"{x:.3f}" for x in lags) + f"; last of 6 {lags[-1]:.3f} s", flush=True)
        lasts.append(lags[-1])
    print(f"last of 6 paused after zero seen: median {statistics.median(lasts):.3f} s,"
          f" max {max(lasts):.3f} s over {runs} runs")


if __name__ == "__main__":
    main()
