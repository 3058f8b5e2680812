"""bench/ha/down.sh's driver: runs e2e_nodes' node-loss test RUNS times and prints, for each run,
the seconds from the node's death (-9) to its marking (against node_down_after_s: from then its
paused sandboxes are resumable elsewhere) and to its paused sandbox running on the other node,
then their medians. A failed run fails the bench."""
import os
import statistics
import sys
import unittest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "tests", "harness"), os.path.join(ROOT, "tests", "e2e")]

import test_nodes as t  # noqa: E402


def main():
    runs = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    got = []
    for i in range(runs):
        t.NodesTests.figures = {}
        suite = unittest.defaultTestLoader.loadTestsFromName(
            "test_nodes.NodesTests.test_spread_drain_death_return_and_upgrade")
        res = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
        f = t.NodesTests.figures
        if not res.wasSuccessful() or res.skipped or len(f) < 3:
            print(f"run {i + 1}: failed", flush=True)
            sys.exit(1)
        print(f"run {i + 1}: marked down (its paused sandboxes resumable elsewhere) {f['marked_down_s']:.1f} s "
              f"after the kill (bound {t.DOWN_AFTER} s); the paused sandbox running elsewhere "
              f"{f['death_to_running_elsewhere_s']:.1f} s after it "
              f"(its resume {f['resume_s']:.1f} s)", flush=True)
        got.append(f)
    print(f"median: marked down {statistics.median(g['marked_down_s'] for g in got):.1f} s, "
          f"running elsewhere {statistics.median(g['death_to_running_elsewhere_s'] for g in got):.1f} s "
          f"over {runs} runs")


if __name__ == "__main__":
    main()
