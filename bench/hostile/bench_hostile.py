"""bench_hostile.py - the hostile-guest suite's long form: every attack of attacks.py from tenant
A's sandbox for SECONDS each, and tenant B's neighbour's `exec echo` latency during it against the
same measured for BASELINE seconds just before it, plus /healthz.

Run by bench/hostile/hostile.sh (which starts the throwaway Postgres and Redis and sets
KILN_BUILD_DIR and KILN_SERVICES_ENV); it re-runs itself inside host and internet namespaces of
its own (attacks.in_namespaces), as tests/e2e/test_hostile.py does. Prints one line per attack:
the neighbour's p50/p95/max before and during, the p50 and p95 ratios, /healthz answers that were
200, and whether the platform held (an attack that got further than promised prints BROKEN and
makes the exit status 1).

usage: bench_hostile.py [SECONDS] [BASELINE]     (defaults 45 and 20)
"""
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import attacks  # noqa: E402


def fmt(p):
    return "/".join(f"{x:.2f}" for x in p)


def bench(seconds, baseline):
    s = attacks.Stack()
    prober = None
    broken = 0
    try:
        prober = attacks.Prober(s)
        print(f"# load before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}; attacks of {seconds} s, "
              f"baseline {baseline} s before each; neighbour exec latency in s (p50/p95/max)")
        print(f"{'attack':22} {'before':>18} {'during':>18} {'p50 x':>6} {'p95 x':>6} {'healthz':>9}  verdict")
        for name, fn in attacks.ATTACKS:
            if not s.attacker_usable():
                s.fresh_attacker()
            b0 = time.monotonic()
            time.sleep(baseline)
            # the probes started in the baseline (not one under way from the attacker's making)
            before = [x[1] for x in prober.window(b0, time.monotonic())[0]
                      if x[1] is not None and x[0] >= b0]
            verdict, figures = "held", {}
            try:
                start, end, figures = attacks.run_attack(s, prober, name, fn, seconds)
            except attacks.Broken as e:
                verdict = f"BROKEN: {e}"
                broken += 1
                start, end = b0 + baseline, time.monotonic()
            ex, hz = prober.window(start, end)
            during = [x[1] for x in ex if x[1] is not None]
            failed = len(ex) - len(during)
            pb, pd = attacks.pcts(before), attacks.pcts(during)
            ok = sum(1 for h in hz if h[1] == 200)
            print(f"{name:22} {fmt(pb):>18} {fmt(pd):>18} {pd[0] / pb[0]:6.2f} {pd[1] / pb[1]:6.2f} "
                  f"{ok:>4}/{len(hz):<4}  {verdict}" + (f" ({failed} execs failed)" if failed else ""),
                  flush=True)
            print(f"#   {name}: {figures}", flush=True)
        print(f"# load after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    finally:
        if prober:
            prober.stop()
        s.cleanup()
    return 1 if broken else 0


def main():
    args = sys.argv[1:]
    seconds = int(args[0]) if args else 45
    baseline = int(args[1]) if len(args) > 1 else 20
    if not os.environ.get("KILN_HOSTILE_INET_NS"):
        return attacks.in_namespaces([sys.executable, os.path.abspath(__file__), str(seconds), str(baseline)])
    return bench(seconds, baseline)


if __name__ == "__main__":
    sys.exit(main())
