"""The hostile-guest suite (short form): tenant A's sandbox, root from its first instruction, runs
every attack of bench/hostile/attacks.py through the public exec API for a few seconds each —
the host's Postgres, Redis, kiln-node, gateway and metadata addresses, another tenant's sandbox,
spoofed MAC and IP, a DNS flood, console, fork bomb, memory, disk fill, disk I/O, and last a flood
of malformed and oversized frames on the agent channel — while tenant B's neighbour sandbox is
probed every second. Each attack must fail or stay inside A; B must answer every exec within 30 s
throughout, /healthz stay 200, and nothing of B change.

Run as a script: it builds its own host and internet namespaces (as test_egress.py), runs the
tests inside the host one through tests/harness/unittest_run.py (a skip fails), and removes
everything afterwards. The long form is bench/hostile/hostile.sh.
"""
import os
import sys
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench", "hostile"))
import attacks  # noqa: E402

SECONDS = int(os.environ.get("KILN_HOSTILE_SECONDS", "4"))


class HostileGuestTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.s = attacks.Stack()
        cls.addClassCleanup(cls.s.cleanup)
        cls.prober = attacks.Prober(cls.s)
        cls.addClassCleanup(cls.prober.stop)

    def attack(self, name):
        fn = dict(attacks.ATTACKS)[name]
        try:
            _, _, figures = attacks.run_attack(self.s, self.prober, name, fn, SECONDS)
        except attacks.Broken as e:
            self.fail(f"{name}: {e}")
        print(f"  {name}: {figures}", file=sys.stderr)

    # unittest runs these by name: the destructive ones (agent channel) last
    def test_1_host_services_metadata_and_neighbour_are_closed(self):
        self.attack("reach_host_services")

    def test_2_spoofed_mac_and_ip_are_dropped_and_counted(self):
        self.attack("spoof_mac_ip")

    def test_3_dns_flood_stays_in_the_attackers_bucket(self):
        self.attack("dns_flood")

    def test_4_console_flood_stays_capped(self):
        self.attack("console_flood")

    def test_5_disk_fill_stays_in_the_attackers_layer(self):
        self.attack("disk_fill")

    def test_6_disk_io_is_throttled(self):
        self.attack("disk_io")

    def test_7_memory_fill_stays_in_the_guest(self):
        self.attack("memory_fill")

    def test_8_fork_bomb_stays_in_the_guest(self):
        self.attack("fork_bomb")

    def test_9_agent_channel_flood_fails_only_the_attacker(self):
        self.attack("agent_flood")


def main():
    runner = os.path.join(HERE, "..", "harness", "unittest_run.py")
    return attacks.in_namespaces([sys.executable, runner] + (sys.argv[1:] or ["test_hostile"]))


if __name__ == "__main__":
    if os.environ.get("KILN_HOSTILE_INET_NS"):
        unittest.main()
    else:
        sys.exit(main())
