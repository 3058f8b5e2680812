#!/usr/bin/python3
"""The name-checking proxy's cost, in namespaces of their own (the integration tests' topology).

  bench_sniproxy.py --tool BUILD/tests/integration/netpolicy/np_tool [--bytes N] [--rounds R]

A stand-in guest downloads N bytes over HTTP from the fake internet's 203.0.113.10:80 on a
keep-alive connection, R rounds, alternating in the same run between
  - "address": the rule 203.0.113.10:80 (an address rule: the kernel only, no proxy), and
  - "names":   the rule sub.example.com (resolved first: the connection goes through the proxy),
and prints, per mode, the median time from the request to the first byte of its answer (ms) and
the median throughput (MB/s), then the ratios names/address. Needs root. Everything it creates is
removed at exit.
"""
import argparse
import atexit
import os
import statistics
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tests", "integration", "netpolicy"))
import test_netpolicy as t  # noqa: E402  (the topology and its cleanup)


def run(mode, nbytes):
    t.apply(t.SB_C)
    if mode == "address":
        t.apply(t.SB_C, "203.0.113.10:80")
    else:
        t.apply(t.SB_C, "sub.example.com")
        assert "203.0.113.10" in t.probe(t.NS_GC, "dns", "sub.example.com").stdout
    r = t.probe(t.NS_GC, "bulk", "203.0.113.10", 80, "sub.example.com", nbytes, timeout=300)
    if r.returncode != 0:
        raise RuntimeError("%s: %s %s" % (mode, r.stdout, r.stderr))
    ttfb, mbps, _ = r.stdout.split()
    return float(ttfb), float(mbps)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tool", required=True)
    ap.add_argument("--bytes", type=int, default=200 * 1000 * 1000)
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root")
        return 1
    t.TOOL = args.tool
    atexit.register(t.cleanup)
    t.setup()
    t.sni_proxy()
    res = {"address": [], "names": []}
    for _ in range(args.rounds):
        for mode in ("address", "names"):
            res[mode].append(run(mode, args.bytes))
    med = {}
    for mode, v in res.items():
        med[mode] = (statistics.median(x[0] for x in v), statistics.median(x[1] for x in v))
        print("%-8s first byte %7.3f ms  throughput %8.1f MB/s  (rounds: %s)" % (
            mode, med[mode][0], med[mode][1],
            ", ".join("%.2f ms %.0f MB/s" % x for x in v)))
    print("names/address: throughput %.2fx, first byte %+.3f ms" % (
        med["names"][1] / med["address"][1], med["names"][0] - med["address"][0]))
    t.sni_stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
