"""Migrations: a fresh database, a re-run, a tampered checksum, a newer database, two starts at once."""
import os
import subprocess
import unittest

import kiln

MIGRATE = os.path.join(kiln.BUILD, "migrations", "kiln-migrate")


def migrate(db_url):
    env = dict(os.environ, KILN_DATABASE_URL=db_url)
    return subprocess.run([MIGRATE], env=env, capture_output=True, text=True, timeout=60)


class MigrationTests(unittest.TestCase):
    def setUp(self):
        self.db = kiln.fresh_database()
        self.addCleanup(self.db.drop)

    def test_fresh_database_gets_every_migration_once(self):
        r = migrate(self.db.url)
        self.assertEqual(r.returncode, 0, r.stderr)
        files = sorted(f for f in os.listdir(os.path.join(kiln.ROOT, "migrations")) if f.endswith(".sql"))
        self.assertEqual(self.db.sql("SELECT string_agg(name, ',' ORDER BY name) FROM schema_migrations"),
                         ",".join(files))
        self.assertEqual(self.db.sql("SELECT count(*) FROM ledger_accounts WHERE kind='system'"), "3")

    def test_rerun_applies_nothing_and_changes_nothing(self):
        self.assertEqual(migrate(self.db.url).returncode, 0)
        before = self.db.sql("SELECT name || sha256 || applied_at FROM schema_migrations ORDER BY name")
        r = migrate(self.db.url)
        self.assertEqual(r.returncode, 0, r.stderr)
        self.assertIn("0 applied", r.stdout)
        self.assertEqual(self.db.sql("SELECT name || sha256 || applied_at FROM schema_migrations ORDER BY name"),
                         before)

    def test_tampered_checksum_is_refused_with_the_file_named(self):
        self.assertEqual(migrate(self.db.url).returncode, 0)
        self.db.sql("UPDATE schema_migrations SET sha256 = repeat('0', 64) WHERE name = '0001_init.sql'")
        r = migrate(self.db.url)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("0001_init.sql", r.stderr)
        self.assertIn("changed", r.stderr)

    def test_database_newer_than_the_code_is_refused(self):
        self.assertEqual(migrate(self.db.url).returncode, 0)
        self.db.sql("INSERT INTO schema_migrations (name, sha256) VALUES ('9999_future.sql', 'x')")
        r = migrate(self.db.url)
        self.assertNotEqual(r.returncode, 0)
        self.assertIn("newer than the code", r.stderr)

    def test_concurrent_starts_apply_each_file_once(self):
        env = dict(os.environ, KILN_DATABASE_URL=self.db.url)
        procs = [subprocess.Popen([MIGRATE], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True) for _ in range(4)]
        outs = [p.communicate(timeout=60) for p in procs]
        for p, (out, err) in zip(procs, outs):
            self.assertEqual(p.returncode, 0, err)
        applied = [int(out.split(":")[1].split()[0]) for out, _ in outs]
        self.assertEqual(sum(applied), int(self.db.sql("SELECT count(*) FROM schema_migrations")))
        self.assertEqual(self.db.sql("SELECT count(*) FROM ledger_accounts WHERE kind='system'"), "3")

    def test_ledger_is_append_only(self):
        self.assertEqual(migrate(self.db.url).returncode, 0)
        self.db.sql("INSERT INTO tenants (id, name) VALUES ('tn_x', 'x')")
        self.db.sql("INSERT INTO ledger_accounts (id, tenant_id, kind) VALUES ('grant:tx_1', 'tn_x', 'grant')")
        self.db.sql("INSERT INTO ledger_transfers (id, idem_key, kind, debit_account, credit_account, amount_ucr)"
                    " VALUES ('tx_1', 'k1', 'grant', 'system:issuance', 'grant:tx_1', 5)")
        with self.assertRaises(Exception):
            self.db.sql("UPDATE ledger_transfers SET amount_ucr = 6")
        with self.assertRaises(Exception):
            self.db.sql("DELETE FROM ledger_transfers")
        self.assertEqual(self.db.sql("SELECT amount_ucr FROM ledger_transfers"), "5")


if __name__ == "__main__":
    unittest.main()
