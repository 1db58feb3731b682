"""``python -m bench.end_latency [N]``: how long `launcher up --backend docker` takes from the master's
summary.json (written just before the master exits) to `up` returning, with the Docker backend's ``idle()``
as it is (``docker wait`` on the master) and with the base class's 0.5 s sleep, alternating N times in one
process. Needs the image (``launcher build``). Results: bench/notes.md, "End of a Docker run"."""
import contextlib
import glob
import io
import os
import shutil
import statistics
import sys
import tempfile
import time

from launcher.backends.base import Backend
from launcher.backends.docker import DockerBackend
from launcher.cli.main import main

new_idle = DockerBackend.idle
res = {"wait": [], "sleep": []}
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 5):
    for mode in ("sleep", "wait"):
        DockerBackend.idle = new_idle if mode == "wait" else Backend.idle
        root = tempfile.mkdtemp(prefix="idle-")
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            try:
                main(["up", "--backend", "docker", "--gpus", "none", "--workers", "2", "--max-steps", "3000",
                      "--results", root, "--json", "--progress", "off"])
            except SystemExit:
                pass
        t_end = time.time()
        (summary,) = glob.glob(f"{root}/*/summary.json")
        res[mode].append(t_end - os.stat(summary).st_mtime)
        print(mode, round(res[mode][-1], 3), file=sys.stderr)
        shutil.rmtree(root, ignore_errors=True)
for mode, xs in res.items():
    print(mode, "median", round(statistics.median(xs), 3), "all", [round(x, 3) for x in xs])
