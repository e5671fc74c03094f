"""Print a wheel's requirements, one a line, but those of its extras and the names given.

    python scripts/wheel-requirements.py WHEEL [NAME ...]

The engine environments (scripts/vllm-env.sh, scripts/lmcache-env.sh) install a wheel's own
requirements without the packages they install otherwise (torch's CPU build) or cannot use here
(CUDA-only ones), then the wheel with --no-deps."""

import re
import sys
import zipfile

wheel, *excluded = sys.argv[1:]
skip = {name.lower() for name in excluded}
with zipfile.ZipFile(wheel) as whl:
    meta = next(n for n in whl.namelist() if n.endswith(".dist-info/METADATA"))
    for line in whl.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: ") or "extra ==" in line:
            continue
        requirement = line.removeprefix("Requires-Dist: ")
        name = re.split(r"[ ;<>=!~\[(]", requirement, maxsplit=1)[0].lower()
        if name not in skip:
            print(requirement)
