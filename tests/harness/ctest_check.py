"""ctest_check.py - checks that the test suite means what it says (docs/testing.md).

    ctest_check.py policy <build dir> <skip-allowed.txt>
        Every test registered in the build (ctest --show-only=json-v1) has a kind label: unit,
        integration, e2e or fuzz (fixture: only for a fixture's setup or cleanup). SKIP_RETURN_CODE
        is set on the tests of skip-allowed.txt and on no other; every test listed there is
        registered and has a reason.
    ctest_check.py skips <junit file> <skip-allowed.txt>
        After `ctest --output-junit <file>`: fails when a test that did not run to an end (skipped,
        disabled or not run) is not in skip-allowed.txt; prints those that are.
    ctest_check.py costs <build dir> <ctest-costs.txt>
        Before a parallel ctest run: gives each test listed in ctest-costs.txt that ctest has not
        measured yet in that build tree its typical seconds, in ctest's own record of test times
        (Testing/Temporary/CTestCostData.txt), so that ctest starts the longest tests first. The
        tests ctest measured keep its figures; the record's list of tests that failed last (which
        ctest starts first) is kept as it was.
    ctest_check.py self-test
        Plants faults (an unlabelled test, a skip code on an unlisted test, an unlisted skip, a
        disabled test, a listed test without a reason) and fails unless each one is reported.

Exit status 0 when all is well, 1 with one line per problem on stderr, 2 on bad usage.
"""
import json
import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

KINDS = {"unit", "integration", "e2e", "fuzz"}


def read_allowed(path):
    """{test name: reason} from skip-allowed.txt; a line without a reason is a problem."""
    allowed, problems = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            name, _, reason = line.partition(" ")
            if not reason.strip():
                problems.append(f"{path}:{n}: {name} has no reason")
            allowed[name] = reason.strip()
    return allowed, problems


def policy_problems(tests, allowed):
    """Problems of the json-v1 `tests` list against the allowed skips."""
    problems, names = [], set()
    for t in tests:
        name = t["name"]
        names.add(name)
        props = {p["name"]: p["value"] for p in t.get("properties", [])}
        labels = set(props.get("LABELS", []))
        fixture = "FIXTURES_SETUP" in props or "FIXTURES_CLEANUP" in props
        if not labels & KINDS and not (fixture and "fixture" in labels):
            problems.append(f"{name}: no kind label (unit, integration, e2e or fuzz); labels: "
                            f"{sorted(labels) or 'none'}")
        if "SKIP_RETURN_CODE" in props and name not in allowed:
            problems.append(f"{name}: sets SKIP_RETURN_CODE but is not in skip-allowed.txt")
    for name in allowed:
        if name not in names:
            problems.append(f"skip-allowed.txt: {name} is not a registered test")
    return problems


def check_policy(build, allowed_path):
    allowed, problems = read_allowed(allowed_path)
    out = subprocess.run(["ctest", "--show-only=json-v1"], cwd=build, check=True,
                         capture_output=True, text=True).stdout
    tests = json.loads(out)["tests"]
    if not tests:
        problems.append(f"{build}: no test registered")
    problems += policy_problems(tests, allowed)
    return problems, f"{len(tests)} tests labelled, skip codes only where allowed"


def skip_problems(junit_path, allowed):
    """Problems of a ctest JUnit file: tests that did not run to an end and are not allowed to."""
    problems, notes = [], []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        status = case.get("status")
        if status in ("run", "fail"):
            continue
        name = case.get("name")
        why = case.find("skipped")
        why = why.get("message", "") if why is not None else status
        if name in allowed:
            notes.append(f"{name}: skipped ({why}), allowed: {allowed[name]}")
        else:
            problems.append(f"{name}: {status} ({why}) and not in skip-allowed.txt")
    return problems, notes


def check_skips(junit_path, allowed_path):
    allowed, problems = read_allowed(allowed_path)
    more, notes = skip_problems(junit_path, allowed)
    for n in notes:
        print(n)
    return problems + more, "no test skipped that is not allowed to"


COST_DATA = os.path.join("Testing", "Temporary", "CTestCostData.txt")


def read_costs(path):
    """{test name: seconds} from ctest-costs.txt ("name seconds", # comments); bad lines are problems."""
    costs, problems = {}, []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            fields = line.split("#", 1)[0].split()
            if not fields:
                continue
            try:
                if len(fields) != 2 or float(fields[1]) < 0:
                    raise ValueError
                costs[fields[0]] = float(fields[1])
            except ValueError:
                problems.append(f"{path}:{n}: not \"<test name> <seconds>\": {line.strip()}")
    return costs, problems


def merge_cost_data(old, costs):
    """The text of a CTestCostData.txt: `old`'s (the record ctest wrote, "" if none) with a line
    "<name> 1 <seconds>" for each test of `costs` it does not have; its "---" section (the tests
    that failed last) kept."""
    measured, failed = [], ""
    lines = old.splitlines(keepends=True)
    for i, line in enumerate(lines):
        if line.strip() == "---":
            failed = "".join(lines[i:])
            break
        if len(line.split()) == 3:  # anything else is a line ctest would not read either
            measured.append(line if line.endswith("\n") else line + "\n")
    have = {line.split()[0] for line in measured}
    seeded = [f"{name} 1 {secs:g}\n" for name, secs in costs.items() if name not in have]
    return "".join(measured + seeded) + (failed or "---\n")


def write_costs(build, costs_path):
    costs, problems = read_costs(costs_path)
    if problems:
        return problems, ""
    path = os.path.join(build, COST_DATA)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    try:
        with open(path) as f:
            old = f.read()
    except FileNotFoundError:
        old = ""
    text = merge_cost_data(old, costs)
    with open(path + ".tmp", "w") as f:
        f.write(text)
    os.rename(path + ".tmp", path)
    kept = len(old.split("---", 1)[0].splitlines())
    return [], f"{len(costs)} typical test times given to ctest ({path}; {kept} lines it measured kept)"


def self_test():
    """Each planted fault must be reported; the clean inputs must pass."""
    failures = []

    def expect(what, problems, count):
        if len(problems) != count:
            failures.append(f"{what}: expected {count} problems, got {problems}")

    def test(name, labels=None, **props):
        p = [{"name": "LABELS", "value": labels}] if labels is not None else []
        p += [{"name": k, "value": v} for k, v in props.items()]
        return {"name": name, "properties": p}

    good = [test("a", ["unit"]), test("b", ["integration", "root"]),
            test("fx", ["fixture"], FIXTURES_SETUP=["services"]),
            test("kvm", ["e2e", "vm"], SKIP_RETURN_CODE="77")]
    expect("clean suite", policy_problems(good, {"kvm": "needs KVM"}), 0)
    expect("test without labels", policy_problems(good + [test("c")], {"kvm": "x"}), 1)
    expect("test with only a need label", policy_problems(good + [test("c", ["root"])],
                                                          {"kvm": "x"}), 1)
    expect("fixture label on a plain test", policy_problems(good + [test("c", ["fixture"])],
                                                            {"kvm": "x"}), 1)
    expect("skip code on an unlisted test", policy_problems(good, {}), 1)
    expect("listed test not registered", policy_problems(good, {"kvm": "x", "gone": "x"}), 1)

    with tempfile.TemporaryDirectory() as d:
        lst = os.path.join(d, "allowed.txt")
        with open(lst, "w") as f:
            f.write("# comment\nkvm needs /dev/kvm  # trailing comment\nbare\n")
        allowed, problems = read_allowed(lst)
        expect("listed test without a reason", problems, 1)
        if allowed.get("kvm") != "needs /dev/kvm":
            failures.append(f"skip-allowed parsing: {allowed}")

        junit = os.path.join(d, "junit.xml")
        with open(junit, "w") as f:
            f.write('<testsuite>'
                    '<testcase name="a" status="run"/>'
                    '<testcase name="b" status="fail"><failure message=""/></testcase>'
                    '<testcase name="kvm" status="notrun"><skipped message="SKIP_RETURN_CODE=77"/>'
                    '</testcase>'
                    '<testcase name="py" status="notrun"><skipped message="SKIP_RETURN_CODE=77"/>'
                    '</testcase>'
                    '<testcase name="off" status="disabled"/>'
                    '</testsuite>')
        problems, notes = skip_problems(junit, {"kvm": "needs KVM"})
        expect("unlisted skip and disabled test", problems, 2)
        if len(notes) != 1:
            failures.append(f"allowed skip not noted: {notes}")
        problems, _ = skip_problems(junit, {"kvm": "x", "py": "x", "off": "x"})
        expect("every skip listed", problems, 0)

        costs = os.path.join(d, "costs.txt")
        with open(costs, "w") as f:
            f.write("# comment\nlong 600  # note\nshort 5\n")
        got, problems = read_costs(costs)
        expect("clean costs", problems, 0)
        if got != {"long": 600.0, "short": 5.0}:
            failures.append(f"costs parsing: {got}")
        with open(costs, "a") as f:
            f.write("three fields 1\nnegative -1\nword ten\n")
        expect("bad cost lines", read_costs(costs)[1], 3)
        fresh = merge_cost_data("", {"long": 600.0, "short": 5.0})
        if fresh != "long 1 600\nshort 1 5\n---\n":
            failures.append(f"costs on a fresh tree: {fresh!r}")
        kept = merge_cost_data("short 3 7.5\n---\nshort\n", {"long": 600.0, "short": 5.0})
        if kept != "short 3 7.5\nlong 1 600\n---\nshort\n":
            failures.append(f"costs over ctest's record: {kept!r}")
    return failures, "every planted fault was reported"


def main(argv):
    if argv[:1] == ["policy"] and len(argv) == 3:
        problems, ok = check_policy(argv[1], argv[2])
    elif argv[:1] == ["skips"] and len(argv) == 3:
        problems, ok = check_skips(argv[1], argv[2])
    elif argv[:1] == ["costs"] and len(argv) == 3:
        problems, ok = write_costs(argv[1], argv[2])
    elif argv == ["self-test"]:
        problems, ok = self_test()
    else:
        print(__doc__, file=sys.stderr)
        return 2
    for p in problems:
        print(p, file=sys.stderr)
    if problems:
        return 1
    print(ok)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
