"""bench/ha/down.sh's driver: runs e2e_nodes' node-loss test RUNS times and prints, for each run,
the seconds from the node's stop to its marking (against node_down_after_s) and to its paused
sandbox running on the other node, then their medians. A failed run fails the bench."""
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
        t.NodeLossTests.figures = {}
        suite = unittest.defaultTestLoader.loadTestsFromName(
            "test_nodes.NodeLossTests.test_a_lost_node_its_paused_sandbox_elsewhere_its_vms_fenced_then_a_drain")
        res = unittest.TextTestRunner(stream=sys.stderr, verbosity=0).run(suite)
        f = t.NodeLossTests.figures
        if not res.wasSuccessful() or res.skipped or len(f) < 3:
            print(f"run {i + 1}: failed", flush=True)
            sys.exit(1)
        print(f"run {i + 1}: marked down {f['marked_down_s']:.1f} s after the stop (bound {t.DOWN_AFTER} s); "
              f"the paused sandbox running elsewhere {f['stop_to_running_elsewhere_s']:.1f} s after it "
              f"(its resume {f['resume_s']:.1f} s)", flush=True)
        got.append(f)
    print(f"median: marked down {statistics.median(g['marked_down_s'] for g in got):.1f} s, "
          f"running elsewhere {statistics.median(g['stop_to_running_elsewhere_s'] for g in got):.1f} s "
          f"over {runs} runs")


if __name__ == "__main__":
    main()
