"""Writes tests/durations.json (seconds per test file, and per test of those taking MIN_TEST_SECONDS or more) from
the JUnit XML of a full run, for the order in which tests/conftest.py hands files (and the tests of the files it
hands out test by test) to pytest-xdist's workers, the longest first:

    bash dev.sh test --junitxml=/tmp/run.xml && python .ci/durations.py /tmp/run.xml
"""

import json
import os
import sys
import xml.etree.ElementTree as ET

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MIN_TEST_SECONDS = 5.0


def main(paths: list[str]) -> None:
    if not paths:
        raise SystemExit(__doc__)
    seconds: dict[str, float] = {}
    tests: dict[str, float] = {}
    for path in paths:
        for case in ET.parse(path).getroot().iter("testcase"):
            # classname "tests.test_x" or "tests.test_x.TestClass": the file is tests/test_x.py
            parts = case.get("classname", "").split(".")
            name = next((i for i, p in enumerate(parts) if p.startswith("test_")), None)
            if name is None:
                continue
            file = "/".join(parts[:name + 1]) + ".py"
            t = float(case.get("time", 0) or 0)
            seconds[file] = seconds.get(file, 0.0) + t
            nodeid = "::".join([file, *parts[name + 1:], case.get("name", "")])
            tests[nodeid] = tests.get(nodeid, 0.0) + t
    n_files = len(seconds)
    total = sum(seconds.values())
    seconds.update({k: v for k, v in tests.items() if v >= MIN_TEST_SECONDS})
    out = os.path.join(ROOT, "tests", "durations.json")
    with open(out, "w") as f:
        json.dump({k: round(v, 1) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1])}, f, indent=0)
        f.write("\n")
    print(f"{out}: {n_files} files, {total:.0f} s in all")


if __name__ == "__main__":
    main(sys.argv[1:])
