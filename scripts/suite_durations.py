"""Where the test suite's time goes: reads the JUnit XML of a run (`python -m pytest --junitxml=run.xml`) and prints
the test time per folder, per file and the slowest tests, and the failures. Test time is each testcase's `time`,
summed (with two xdist workers the wall time is about half the total).

    python scripts/suite_durations.py run.xml [number of slowest tests to list, default 60]
"""

import collections
import sys
import xml.etree.ElementTree as ET


def main(path: str, slowest: int = 60) -> None:
    files, folders, tests, failures = collections.Counter(), collections.Counter(), [], []
    for case in ET.parse(path).getroot().iter("testcase"):
        seconds, module = float(case.get("time", 0)), case.get("classname", "").replace(".", "/")
        files[module] += seconds
        folders[module.split("/")[1] if module.count("/") > 1 else "top"] += seconds
        tests.append((seconds, f"{module}::{case.get('name')}"))
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        if bad is not None:
            failures.append((f"{module}::{case.get('name')}", (bad.get("message") or "")[:200]))
    print("TOTAL", round(sum(files.values())), "s of test time,", len(tests), "tests")
    for name, seconds in folders.most_common():
        print(f"{seconds:8.0f}  {name}")
    print()
    for name, seconds in files.most_common(40):
        print(f"{seconds:8.0f}  {name}")
    print()
    for seconds, name in sorted(tests, reverse=True)[:slowest]:
        print(f"{seconds:7.1f}  {name}")
    print("\nFAILURES", len(failures))
    for name, message in failures:
        print(name, "|", message.replace("\n", " "))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)
