"""Fault tests of kiln-meter, each ending with the ledger exact.

Exact means: once the sandbox has stopped and its last window is flushed, the usage charged is
exactly the price of the time it ran and the CPU its cgroup used, to the µcr, with the sub-µcr
remainder carried in meter_sandboxes: nothing lost, nothing charged twice. Faults: kill -9 of
kiln-meter while a flush holds its transaction open, and a restart; kiln-meter down for minutes
of its (injected) clock, then back; its wall clock stepped an hour ahead and back while it runs
(ticks on the monotonic clock; only the time that passed is billed); kiln-meter killed for good
and its sandbox recovered on another node (its live field dropped after meter_live_ttl_s);
Redis restarted with its data lost; Postgres restarted while a flush holds its transaction open; a
sandbox's end whose transaction commits seconds after its time, ticks passing it meanwhile.

These tests stop servers, so they run their own Postgres and Redis pair rather than the shared
fixture's."""
import os
import re
import subprocess
import tempfile
import time
import unittest

import kiln
import metertest as mt

SERVICES = os.path.join(kiln.ROOT, "tests", "harness", "services.sh")


class FaultTests(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        mt.check_cgroups()
        fd, cls.envfile = tempfile.mkstemp(prefix="kiln-own-services-")
        os.close(fd)
        subprocess.run([SERVICES, "start", cls.envfile], check=True, capture_output=True)
        saved = os.environ["KILN_SERVICES_ENV"]
        os.environ["KILN_SERVICES_ENV"] = cls.envfile
        try:
            cls.env = kiln.services_env()
            cls.db = kiln.fresh_database()
        finally:
            os.environ["KILN_SERVICES_ENV"] = saved
        cls.redis = cls.env["KILN_REDIS_URL"]
        # The gateway migrates the database; the meter would too.
        gw = kiln.Gateway(cls.db.url, cls.redis)
        gw.cleanup()

    @classmethod
    def tearDownClass(cls):
        subprocess.run([SERVICES, "stop", cls.envfile], capture_output=True)

    def setUp(self):
        self.node = "tf" + os.urandom(4).hex()
        mt.add_node(self.db, self.node)
        self.tenant = mt.add_tenant(self.db)
        self.sb = mt.add_sandbox(self.db, self.tenant, self.node)
        self.vm = mt.FakeVM(self.node, self.sb)
        self.addCleanup(self.vm.destroy)
        self.meters = []

    def tearDown(self):
        for m in self.meters:
            m.cleanup()

    def meter(self, **kw):
        m = mt.Meter(self.db.url, self.redis, self.node, **kw)
        self.meters.append(m)
        return m

    def shell(self, script):
        lib = os.path.join(kiln.ROOT, "scripts", "lib.sh")
        subprocess.run(["bash", "-c", f". {lib}; {script}"], check=True, capture_output=True)

    def wait_log(self, m, text, timeout=30):
        self.assertTrue(mt.wait_for(lambda: text in m.output(), timeout, 0.05),
                        f"no {text!r} in:\n" + m.output()[-3000:])

    def stop_sandbox(self, at_sql="now()"):
        self.db.sql(f"UPDATE sandboxes SET state = 'stopped', state_changed_at = {at_sql}"
                    f" WHERE id = '{self.sb}'")

    def assert_ledger_exact(self, meter):
        """Waits for the sandbox's last window in the ledger, then checks the charge to the µcr."""
        done = mt.wait_for(lambda: (mt.billed(self.db, self.sb) or (0, 0, 0, ""))[3] == "none", 30)
        self.assertTrue(done, meter.output()[-3000:])
        start = mt.epoch_ns(self.db, f"(SELECT created_at FROM sandboxes WHERE id = '{self.sb}')")
        end = mt.epoch_ns(self.db, f"(SELECT state_changed_at FROM sandboxes WHERE id = '{self.sb}')")
        last_t, cpu_ns, rem, _ = mt.billed(self.db, self.sb)
        self.assertEqual(last_t, end)
        self.assertEqual(cpu_ns, self.vm.cpu_ns())
        fine = mt.expected_fine(256, 1, end - start, cpu_ns)
        self.assertEqual(mt.ledger_used(self.db, self.tenant), fine // mt.UNIT)
        self.assertEqual(rem, fine % mt.UNIT)
        # Windows are contiguous and each charged once.
        rows = self.db.sql(f"SELECT extract(epoch FROM window_start)::bigint FROM usage_windows"
                           f" WHERE sandbox_id = '{self.sb}' ORDER BY 1").split()
        ws = [int(x) for x in rows]
        self.assertEqual(ws, list(range(ws[0], ws[0] + 2 * len(ws), 2)))
        self.assertEqual(int(self.db.sql(
            f"SELECT count(DISTINCT idem_key) = count(*)::int FROM ledger_transfers"
            f" WHERE sandbox_id = '{self.sb}'") == "t"), 1)
        return end - start

    def test_kill_9_mid_flush_then_restart_charges_exactly(self):
        m = self.meter(hold_ms=1500)
        self.wait_log(m, "holding its transaction")
        m.kill9()
        m2 = self.meter()
        time.sleep(3)
        self.stop_sandbox()
        ran = self.assert_ledger_exact(m2)
        self.assertGreater(ran, 3 * 10**9)

    def test_meter_down_for_minutes_catches_up_without_charging_twice(self):
        clock = tempfile.NamedTemporaryFile("w", prefix="kiln-clock-", delete=False)
        self.addCleanup(os.unlink, clock.name)
        clock.write("0\n")
        clock.close()
        m = self.meter(clock_file=clock.name)
        time.sleep(4)
        m.stop()
        with open(clock.name, "w") as f:
            f.write("180\n")  # three minutes pass for the meter while it is down
        m2 = self.meter(clock_file=clock.name)
        time.sleep(3)
        # It stops a little later by the meter's clock (which runs 180 s ahead of the host's).
        self.stop_sandbox("now() + interval '181 seconds'")
        ran = self.assert_ledger_exact(m2)
        self.assertGreater(ran, 180 * 10**9)
        # The three minutes were caught up at once, one window of 2 s after another.
        self.assertRegex(m2.output(), r"flushed (8[5-9]|9[0-9]) windows")

    def test_wall_clock_stepped_ahead_and_back_bills_only_the_time_that_passed(self):
        clock = tempfile.NamedTemporaryFile("w", prefix="kiln-clock-", delete=False)
        self.addCleanup(os.unlink, clock.name)
        clock.write("0 0\n")
        clock.close()
        m = self.meter(clock_file=clock.name)
        time.sleep(3)
        with open(clock.name, "w") as f:
            f.write("0 3600\n")  # the meter's wall clock (alone) steps an hour ahead
        # Measured as the wall clock's lead over the meter's clock, within the few µs between
        # reading the two (a ms or more on a loaded machine, so not always "3600.000").
        self.assertTrue(mt.wait_for(lambda: re.search(r"stepped (3599\.9|3600\.0)\d\d s ahead",
                                                      m.output()), 30, 0.05), m.output()[-3000:])
        time.sleep(3)
        with open(clock.name, "w") as f:
            f.write("0 0\n")  # and back
        self.wait_log(m, "s back")
        time.sleep(3)
        ticks = m.output().count("tick failed")
        self.stop_sandbox()
        done = mt.wait_for(lambda: (mt.billed(self.db, self.sb) or (0, 0, 0, ""))[3] == "none", 30)
        self.assertTrue(done, m.output()[-3000:])
        self.assertEqual(ticks, 0, m.output()[-3000:])
        start = mt.epoch_ns(self.db, f"(SELECT created_at FROM sandboxes WHERE id = '{self.sb}')")
        end = mt.epoch_ns(self.db, f"(SELECT state_changed_at FROM sandboxes WHERE id = '{self.sb}')")
        last_t, cpu_ns, _, _ = mt.billed(self.db, self.sb)
        # The meter's clock stays an hour ahead of the wall clock after the backward step; the
        # node's end time is read on it. To the µs: the two clocks are read a few ns apart.
        self.assertAlmostEqual(last_t, end + 3600 * 10**9, delta=10**6)
        self.assertEqual(cpu_ns, self.vm.cpu_ns())
        fine = mt.expected_fine(256, 1, end - start, cpu_ns)
        self.assertAlmostEqual(mt.ledger_used(self.db, self.tenant), fine // mt.UNIT, delta=1)
        self.assertGreater(end - start, 9 * 10**9)
        self.assertEqual(mt.wait_for(lambda: mt.redis_balance(self.redis, self.tenant) ==
                                     mt.ledger_balance(self.db, self.tenant), 10), True)

    def test_meter_killed_for_good_its_live_field_is_dropped_after_the_bound(self):
        env = {"KILN_METER_LIVE_TTL_S": "3", "KILN_METER_WINDOW_S": "10"}
        key, dead = "kiln:bal:" + self.tenant, "live:" + self.node
        m = self.meter(extra_env=env)
        self.wait_log(m, "flushed 1 windows")  # the ledger has a billed-up-to point
        self.assertTrue(mt.wait_for(
            lambda: int(mt.redis_cli(self.redis, "HGET", key, dead) or 0) > 0, 20))
        m.kill9()  # for good: nothing of it runs again
        self.assertGreater(int(mt.redis_cli(self.redis, "HGET", key, dead) or 0), 0)
        # Its sandbox is recovered on another node, whose meter bills it from the ledger's
        # billed-up-to point: the dead meter's unflushed charges are in its live field too.
        other = "tf" + os.urandom(4).hex()
        mt.add_node(self.db, other)
        self.db.sql(f"UPDATE sandboxes SET node_id = '{other}', generation = generation + 1,"
                    f" state_changed_at = now() WHERE id = '{self.sb}'")
        m2 = mt.Meter(self.db.url, self.redis, other, extra_env=env)
        self.meters.append(m2)
        self.wait_log(m2, "started")
        # Past the bound, the living meter's tick drops the dead field: Redis's balance is the
        # ledger's less the living meter's unflushed charges alone.
        self.assertTrue(mt.wait_for(
            lambda: mt.redis_cli(self.redis, "HEXISTS", key, dead) == "0", 10), m2.output()[-3000:])
        self.stop_sandbox()
        done = mt.wait_for(lambda: (mt.billed(self.db, self.sb) or (0, 0, 0, ""))[3] == "none", 30)
        self.assertTrue(done, m2.output()[-3000:])
        self.assertEqual(mt.wait_for(lambda: mt.redis_balance(self.redis, self.tenant) ==
                                     mt.ledger_balance(self.db, self.tenant), 10), True)
        # The ledger charged every second of the sandbox's life once (no CPU is read on the other
        # node: its cgroup is the first node's).
        start = mt.epoch_ns(self.db, f"(SELECT created_at FROM sandboxes WHERE id = '{self.sb}')")
        end = mt.epoch_ns(self.db, f"(SELECT state_changed_at FROM sandboxes WHERE id = '{self.sb}')")
        used = mt.ledger_used(self.db, self.tenant)
        self.assertGreaterEqual(used, mt.expected_fine(256, 1, end - start, 0) // mt.UNIT - 1)
        self.assertLessEqual(used, mt.expected_fine(256, 1, end - start, self.vm.cpu_ns()) // mt.UNIT + 1)
        self.assertEqual(int(self.db.sql(
            f"SELECT count(DISTINCT idem_key) = count(*)::int FROM ledger_transfers"
            f" WHERE sandbox_id = '{self.sb}'") == "t"), 1)

    def test_redis_restarted_with_its_data_lost_is_rebuilt_from_the_ledger(self):
        m = self.meter()
        time.sleep(3)
        d = self.env["KILN_TEST_DIR"]
        self.shell(f"kiln_stop_pid {self.env['KILN_TEST_REDIS_PIDFILE']} 10; rm -rf {d}/redis")
        time.sleep(2)
        self.shell(f"kiln_redis_start {d}/redis {d}/s/redis.sock {d}/redis.pid {d}/redis.log")
        self.wait_log(m, "rebuilt 1 balances in redis from the ledger")
        time.sleep(2)
        self.stop_sandbox()
        self.assert_ledger_exact(m)
        ledger = mt.ledger_balance(self.db, self.tenant)
        self.assertEqual(ledger, 500_000_000 - mt.ledger_used(self.db, self.tenant))
        self.assertEqual(mt.wait_for(lambda: mt.redis_balance(self.redis, self.tenant) == ledger, 10),
                         True)

    def test_end_committed_after_ticks_passed_its_time_is_billed_to_it(self):
        m = self.meter()
        self.wait_log(m, "started")
        time.sleep(2)
        # The end's transaction takes its time (now(), its start) and commits 3 s later, so ticks
        # read the sandbox as running past that time meanwhile: none may bill it as running.
        self.db.sql("BEGIN; UPDATE sandboxes SET state = 'stopped', state_changed_at = now()"
                    f" WHERE id = '{self.sb}'; SELECT pg_sleep(3); COMMIT")
        ran = self.assert_ledger_exact(m)
        self.assertGreater(ran, 2 * 10**9)

    def test_postgres_restarted_during_a_flush_charges_exactly(self):
        m = self.meter(hold_ms=2500)
        self.wait_log(m, "holding its transaction")
        d = self.env["KILN_TEST_DIR"]
        self.shell(f"kiln_pg_stop {d}/pg")
        time.sleep(1)
        self.shell(f"kiln_pg_start {d}/pg {d}/s {d}/pg.log")
        self.wait_log(m, "cannot flush to the ledger")
        time.sleep(3)
        self.stop_sandbox()
        self.assert_ledger_exact(m)


if __name__ == "__main__":
    unittest.main()
