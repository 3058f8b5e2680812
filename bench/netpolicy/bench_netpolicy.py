#!/usr/bin/python3
"""Network-policy benchmarks, in namespaces of their own (the integration tests' topology).

  bench_netpolicy.py --tool BUILD/tests/integration/netpolicy/np_tool [--seconds 5] [--rounds 2]

Prints:
  - TCP throughput (iperf3, guest -> fake internet) through the policy with 1,000 rules, and
    with the policy programs detached in the same run (the 1:1 NAT stays in both), and the ratio;
  - the per-packet cost of the guest-side program (BPF_PROG_TEST_RUN), for a packet of an
    established flow and for one that must be checked against the 1,000 rules;
  - the time to replace 100 rules live.
Needs root, iperf3 and bpffs. Everything it creates is removed at exit.
"""
import argparse
import atexit
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration", "netpolicy"))
import test_netpolicy as t  # noqa: E402  (the topology and its cleanup)


def rules_1000():
    out = []
    for i in range(999):
        x = i + 7919
        if i % 2:
            out.append("198.18.%d.%d:443" % ((x >> 8) & 0xFF, x & 0xFF))
        else:
            # benchmarking space (198.19/16), outside every denied range, which no rule may name
            j = i // 2
            out.append("198.19.%d.%d/30" % (j // 64, (j % 64) * 4))
    return out + ["203.0.113.10"]


def iperf(seconds):
    r = t.in_ns(t.NS_GA, "iperf3", "-c", "203.0.113.10", "-t", str(seconds), "-J",
                timeout=seconds + 30)
    if r.returncode != 0:
        raise RuntimeError("iperf3: " + r.stdout[-500:] + r.stderr[-500:])
    return json.loads(r.stdout)["end"]["sum_received"]["bits_per_second"] / 1e9


def detach_policy():
    for where in ("ingress", "egress"):
        t.in_ns("kiln-" + t.SB_A, "tc", "filter", "del", "dev", "tap0", where, check=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    if os.geteuid() != 0 or not shutil.which("iperf3"):
        print("SKIP: needs root and iperf3")
        return 77
    t.TOOL = args.tool
    atexit.register(t.cleanup)
    t.setup()
    t.spawn(["ip", "netns", "exec", t.NS_I, "iperf3", "-s", "-B", "203.0.113.10"],
            wait_ready=False)
    time.sleep(0.5)

    with_policy, without = [], []
    for _ in range(args.rounds):
        t.tool("attach", t.SB_A, str(t.IDX_A))
        t.apply(t.SB_A, *rules_1000())
        with_policy.append(iperf(args.seconds))
        detach_policy()
        without.append(iperf(args.seconds))
    t.tool("attach", t.SB_A, str(t.IDX_A))
    w, wo = sum(with_policy) / len(with_policy), sum(without) / len(without)
    print("iperf3 TCP, guest -> internet, %d x %d s:" % (args.rounds, args.seconds))
    print("  with policy (1,000 rules): %.2f Gbit/s  %s" % (w, ["%.2f" % v for v in with_policy]))
    print("  policy detached:           %.2f Gbit/s  %s" % (wo, ["%.2f" % v for v in without]))
    print("  ratio: %.3f" % (w / wo))

    r = subprocess.run([args.tool, "testrun", "1000000"], capture_output=True, text=True)
    print(r.stdout.strip() or r.stderr.strip())

    r = t.tool("replace-time", t.SB_A, "100", "50")
    print(r.stdout.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
