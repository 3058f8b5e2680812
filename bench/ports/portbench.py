"""portbench.py - what the port benches (bench_ports.py, bench_ports_stub.py) share."""
import threading
import time


def pct(xs, p):
    """The `p` quantile (0..1) of the figures `xs`, by rank."""
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(len(xs) * p))]


def burst(one, n, conc):
    """Calls `one()` (a request, returning its latency) `n` times from `conc` threads at once;
    returns (the latencies, the wall seconds of the whole)."""
    lat, lock, left = [], threading.Lock(), [n]

    def worker():
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            x = one()
            with lock:
                lat.append(x)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(conc)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat, time.perf_counter() - t0
