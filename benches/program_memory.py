#!/usr/bin/env python3
"""The device memory of the largest module XLA dumped, as its buffer assignment sized it.

Run a program with XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" (see
benches/measure_context.sh), then: benches/program_memory.py DIR. Prints one JSON
line: the module (a captured training step over a mesh is one device's part)
and the total bytes of its buffer assignment (arguments, outputs and
intermediates, buffers reused where their lives do not overlap) from XLA's
memory-usage report. The PJRT C API's compiled memory statistics would say the
same without a dump, but the XLA:CPU plugin reports their intermediates as 0.
"""
import glob
import json
import os
import re
import sys

TOTAL = re.compile(r"^Total bytes: (\d+)", re.M)


def main():
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    reports = glob.glob(os.path.join(sys.argv[1], "*memory-usage-report.txt"))
    if not reports:
        sys.exit(f"no *memory-usage-report.txt in {sys.argv[1]}")
    best = None
    for path in reports:
        m = TOTAL.search(open(path).read())
        if m and (best is None or int(m.group(1)) > best[1]):
            best = (os.path.basename(path), int(m.group(1)))
    if best is None:
        sys.exit("no memory-usage report names its total bytes")
    print(json.dumps({"module": best[0], "total_bytes": best[1]}))


if __name__ == "__main__":
    main()
