#!/usr/bin/python3
"""
check_layout.py - the repository's dependency rule and self-containment, as a test.

    check_layout.py SOURCE_DIR              exit 0 when the tree keeps the rules
    check_layout.py --self-test SOURCE_DIR  plant faults in a copy of the tree; each must be reported

1. Includes. Every .c and .h under the source folders (SOURCES) is read for `#include "x/..."`
   and for includes without a folder (resolved to the file they name: same folder first, then any
   source file of that name). Each edge from one module to another must be in ALLOWED; an edge
   that is not is reported as file:line. vmm/guest is part of vmm. metering/ is two modules: the
   library the gateway links (prices, balances, ledger, plans) and kiln-meter, the daemon
   (METER_DAEMON). tests/ and bench/ may include anything, and nothing may include them.
   libbpf's headers (`#include <bpf/...>`) are allowed only where LIBBPF says (kiln-gateway never
   links libbpf).
2. The single record. No .c or .h under the source folders but the record module (record/) may
   hold an SQL statement that writes the `sandboxes` table (INSERT INTO / UPDATE / DELETE FROM /
   MERGE INTO / TRUNCATE sandboxes): a sandbox's state has one writer, fenced (record/record.h).
   Comments are ignored and adjacent string literals joined first, so a statement split over
   lines is still seen. tests/ and bench/ set up their fixtures with such statements and are not
   checked.
3. Self-containment. No file of the repository (CMake, scripts, tests, docs, code) may refer to
   the design notes and reference files that lived beside the checkout (OUTSIDE): a build, test or
   script reads only the repository.

Exit status: 0 the tree keeps the rules; 1 it does not (one line per problem); 2 bad usage.
Needs only Python 3.
"""
import os
import re
import shutil
import sys
import tempfile

# The folders whose C is checked, and what each module may include besides itself.
SOURCES = ("common", "auth", "vmm", "netpolicy", "bpf", "metering", "record", "node", "api", "cli",
           "migrations")
FREE = ("tests", "bench")  # may include anything; not checked
METER_DAEMON = {"metering/meter.c", "metering/meter.h", "metering/main.c", "metering/pause.c",
                "metering/pause.h"}
ALLOWED = {
    "common": set(),
    "auth": {"common"},
    "vmm": {"common", "auth"},
    "netpolicy": {"common", "bpf"},
    "bpf": {"common", "netpolicy"},
    "migrations": {"common"},
    "metering": {"common", "auth"},
    "record": {"common"},
    "kiln-meter": {"common", "auth", "metering", "vmm", "netpolicy", "migrations"},
    "node": {"common", "auth", "vmm", "netpolicy", "bpf", "metering", "kiln-meter", "record",
             "migrations"},
    "api": {"common", "auth", "metering", "record", "migrations"},
    "cli": {"common"},
}
LIBBPF = {"netpolicy", "bpf", "node", "kiln-meter"}

# Written in pieces so that this file does not name them itself.
OUTSIDE = re.compile("|".join([r"\.\./" + "shared\\b", "shared/" + "design", "shared/" + "reference",
                               "/work/" + "shared"]))
SKIP_DIRS = {".git", "var", "node_modules", "__pycache__"}
MAX_BYTES = 8 << 20

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^">]+)[">]')


def skip_dir(name):
    return name in SKIP_DIRS or name.startswith("build")


def module_of(rel):
    """The module of a repository path, or None when it is in no source folder."""
    top = rel.split("/", 1)[0]
    if top == "metering" and rel in METER_DAEMON:
        return "kiln-meter"
    if top in SOURCES:
        return top
    if top in FREE:
        return top
    return None


def source_files(root):
    out = []
    for top in SOURCES:
        for d, dirs, files in os.walk(os.path.join(root, top)):
            dirs[:] = sorted(x for x in dirs if not skip_dir(x))
            for f in sorted(files):
                if f.endswith((".c", ".h")):
                    out.append(os.path.relpath(os.path.join(d, f), root).replace(os.sep, "/"))
    return out


def check_includes(root):
    errors = []
    files = source_files(root)
    if not files:
        return ["%s: no C sources under %s" % (root, ", ".join(SOURCES))]
    by_name = {}
    for rel in files:
        by_name.setdefault(os.path.basename(rel), []).append(rel)
    for rel in files:
        mod = module_of(rel)
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                lines = f.read().splitlines()
        except OSError as e:
            errors.append("%s: cannot read: %s" % (rel, e.strerror))
            continue
        for n, line in enumerate(lines, 1):
            m = INCLUDE.match(line)
            if not m:
                continue
            kind, inc = m.groups()
            if kind == "<":
                if inc.startswith("bpf/") and mod not in LIBBPF:
                    errors.append("%s:%d: %s includes libbpf's <%s>; only %s may"
                                  % (rel, n, mod, inc, ", ".join(sorted(LIBBPF))))
                continue
            target = resolve(root, rel, inc, by_name)
            if target is None:
                continue  # a generated or system header
            tmod = module_of(target)
            if tmod is None or tmod == mod:
                continue
            if tmod in FREE or tmod not in ALLOWED[mod]:
                errors.append('%s:%d: %s includes "%s" (%s); %s may include only %s'
                              % (rel, n, mod, inc, tmod, mod,
                                 ", ".join(sorted(ALLOWED[mod])) or "libc and libraries"))
    return errors


def resolve(root, rel, inc, by_name):
    """The repository path an include names, or None for one outside the source folders."""
    top = inc.split("/", 1)[0]
    if "/" in inc and not inc.startswith("."):
        if top in SOURCES or top in FREE:
            return inc
    here = os.path.normpath(os.path.join(os.path.dirname(rel), inc)).replace(os.sep, "/")
    if os.path.isfile(os.path.join(root, here)):
        return here
    same = [p for p in by_name.get(os.path.basename(inc), []) if p.endswith("/" + inc)]
    if not same:
        return None
    mod = module_of(rel)
    own = [p for p in same if module_of(p) == mod]
    return own[0] if own else same[0]


# The one module that may write the `sandboxes` table.
RECORD = "record"
COMMENT = re.compile(r"/\*.*?\*/|//[^\n]*", re.S)
ADJACENT = re.compile(r'"[ \t]*\n[ \t]*"')
SANDBOX_WRITE = re.compile(r'\b(INSERT\s+INTO|UPDATE|DELETE\s+FROM|MERGE\s+INTO|TRUNCATE(\s+TABLE)?)'
                           r'\s+(ONLY\s+)?("?public"?\.)?"?sandboxes"?(?![\w"])', re.I)


def check_sandbox_writers(root):
    """Each statement writing `sandboxes` outside the record module, as file:line."""
    errors = []
    for rel in source_files(root):
        if module_of(rel) == RECORD:
            continue
        try:
            with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
                text = f.read()
        except OSError as e:
            errors.append("%s: cannot read: %s" % (rel, e.strerror))
            continue
        # Comments become blanks of as many lines; adjacent literals are joined, each join
        # remembered so that a hit is reported on the line where its statement starts.
        text = COMMENT.sub(lambda m: "\n" * m.group(0).count("\n"), text)
        line_of = []
        out = []
        pos = 0
        line = 1
        for m in ADJACENT.finditer(text):
            chunk = text[pos:m.start()]
            for ch in chunk:
                line_of.append(line)
                if ch == "\n":
                    line += 1
            out.append(chunk)
            line += m.group(0).count("\n")
            pos = m.end()
        for ch in text[pos:]:
            line_of.append(line)
            if ch == "\n":
                line += 1
        out.append(text[pos:])
        joined = "".join(out)
        for m in SANDBOX_WRITE.finditer(joined):
            errors.append("%s:%d: writes the sandboxes table (%s); only %s/ may (record/record.h)"
                          % (rel, line_of[m.start()], " ".join(m.group(0).split()), RECORD))
    return errors


def check_outside(root):
    errors = []
    for d, dirs, files in os.walk(root):
        dirs[:] = sorted(x for x in dirs if not skip_dir(x))
        for f in sorted(files):
            path = os.path.join(d, f)
            rel = os.path.relpath(path, root).replace(os.sep, "/")
            try:
                if os.path.islink(path) or os.path.getsize(path) > MAX_BYTES:
                    continue
                with open(path, "rb") as fh:
                    data = fh.read()
            except OSError:
                continue
            if b"\0" in data[:8192]:
                continue
            for n, line in enumerate(data.decode("utf-8", "replace").splitlines(), 1):
                m = OUTSIDE.search(line)
                if m:
                    errors.append("%s:%d: refers to %s, outside the repository" % (rel, n, m.group(0)))
    return errors


def check(root):
    return check_includes(root) + check_sandbox_writers(root) + check_outside(root)


# ------------------------------------------------------------------------------------------------
# Self-test: each fault planted in a copy of the tree must be reported.


def self_test(root):
    failures = []
    count = 0
    tmp = tempfile.mkdtemp(prefix="kiln-layout-")
    try:
        copy = os.path.join(tmp, "tree")
        shutil.copytree(root, copy, symlinks=True,
                        ignore=lambda d, names: [x for x in names
                                                  if skip_dir(x) and os.path.isdir(os.path.join(d, x))])

        def plant(rel, text, needle, label):
            """Appends `text` to a file of the copy, checks, and puts the file back."""
            nonlocal count
            count += 1
            path = os.path.join(copy, rel)
            with open(path, encoding="utf-8") as f:
                saved = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(saved + text)
            try:
                errs = check(copy)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(saved)
            if not any(needle in e for e in errs):
                failures.append("%s: not caught (wanted %r; got %s)" % (label, needle, errs[:3]))

        count += 1
        base = check(copy)
        if base:
            failures.append("the unchanged copy does not pass: %s" % base[:3])

        def line_after(rel):
            with open(os.path.join(copy, rel), encoding="utf-8") as f:
                return len(f.read().splitlines()) + 1

        plant("common/buf.c", '#include "node/node.h"\n',
              "common/buf.c:%d: common includes \"node/node.h\" (node)" % line_after("common/buf.c"),
              "common includes node")
        plant("api/gateway.c", '#include "vmm/hv.h"\n', 'api includes "vmm/hv.h" (vmm)', "the gateway includes vmm")
        plant("api/gateway.c", '#include "metering/meter.h"\n', 'api includes "metering/meter.h" (kiln-meter)',
              "the gateway includes kiln-meter's tick")
        plant("api/gateway.c", '#include "lifecycle.h"\n', 'api includes "lifecycle.h" (node)',
              "an include without a folder into another module")
        plant("api/gateway.c", "#include <bpf/libbpf.h>\n", "api includes libbpf's <bpf/libbpf.h>",
              "the gateway includes libbpf")
        plant("metering/price.c", '#include "vmm/cgroup.h"\n', 'metering includes "vmm/cgroup.h" (vmm)',
              "the metering library includes vmm")
        plant("auth/scopes.c", '#include "tests/unit/test.h"\n', 'auth includes "tests/unit/test.h" (tests)',
              "a source includes tests/")
        plant("vmm/guest/agent_proto.c", '#include "netpolicy/policy.h"\n',
              'vmm includes "netpolicy/policy.h" (netpolicy)', "the guest part of vmm includes netpolicy")
        plant("record/record.c", '#include "node/node.h"\n', 'record includes "node/node.h" (node)',
              "the record module includes node")
        plant("record/record.c", '#include "metering/plan.h"\n', 'record includes "metering/plan.h" (metering)',
              "the record module includes more than common")
        plant("api/routes_sandboxes.c",
              'static const char *q = "UPDATE sandboxes SET state = \'running\' WHERE id = $1";\n',
              "api/routes_sandboxes.c:%d: writes the sandboxes table (UPDATE sandboxes)"
              % line_after("api/routes_sandboxes.c"), "the gateway updates a sandbox itself")
        plant("node/pause.c", 'static const char *q = "INSERT INTO\tsandboxes (id) VALUES ($1)";\n',
              "writes the sandboxes table (INSERT INTO sandboxes)", "the node inserts a sandbox itself")
        plant("metering/ledger.c", 'static const char *q = "DELETE FROM "\n\t"sandboxes WHERE id = $1";\n',
              "metering/ledger.c:%d: writes the sandboxes table (DELETE FROM sandboxes)"
              % line_after("metering/ledger.c"), "a delete split over two literals")
        plant("node/recovery.c", 'static const char *q = "update public.sandboxes set x = 1";\n',
              "node/recovery.c:%d: writes the sandboxes table" % line_after("node/recovery.c"),
              "lower case, schema-qualified")
        plant("node/main.c", 'static const char *q = "TRUNCATE sandboxes";\n',
              "node/main.c:%d: writes the sandboxes table" % line_after("node/main.c"), "a truncate")
        # what is not a write of the table must not be reported
        for rel, text, label in (
                ("api/routes_sandboxes.c", "/* UPDATE sandboxes SET state = 'x' */\n", "a comment"),
                ("api/routes_sandboxes.c", 'static const char *q = "UPDATE sandbox_events SET x = 1";\n',
                 "another table whose name starts alike"),
                ("api/routes_sandboxes.c", 'static const char *q = "SELECT id FROM sandboxes";\n',
                 "a read")):
            count += 1
            path = os.path.join(copy, rel)
            with open(path, encoding="utf-8") as f:
                saved = f.read()
            with open(path, "w", encoding="utf-8") as f:
                f.write(saved + text)
            try:
                errs = check_sandbox_writers(copy)
            finally:
                with open(path, "w", encoding="utf-8") as f:
                    f.write(saved)
            if errs:
                failures.append("%s: reported as a write: %s" % (label, errs[:3]))
        sh = "sha" + "red"  # (see OUTSIDE)
        plant("CMakeLists.txt", "\n# set(X ${PROJECT_SOURCE_DIR}/../%s/design/API.md)\n" % sh,
              "CMakeLists.txt:%d: refers to ../%s" % (line_after("CMakeLists.txt") + 1, sh),
              "CMake refers to the folder beside the checkout")
        plant("scripts/test.sh", "\ncat /work/%s/reference/x\n" % sh, "refers to /work/%s" % sh,
              "a script refers to it by its absolute path")
        plant("docs/vmm.md", "\nSee %s/design/ARCHITECTURE.md.\n" % sh, "docs/vmm.md",
              "docs cite the design notes' folder")
        count += 1
        if check(os.path.join(tmp, "absent")) == []:
            failures.append("a missing tree: not a failure")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    for f in failures:
        print("FAIL " + f)
    print("%d passed, %d failed" % (count - len(failures), len(failures)))
    return 1 if failures else 0


def main(argv):
    if len(argv) == 3 and argv[1] == "--self-test":
        return self_test(argv[2])
    if len(argv) != 2:
        sys.stderr.write(__doc__)
        return 2
    errors = check(argv[1])
    for e in errors:
        print("FAIL " + e)
    if errors:
        print("%s: %d problem(s)" % (argv[1], len(errors)))
        return 1
    print("%s: every include keeps the dependency table; nothing refers outside the repository" % argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
