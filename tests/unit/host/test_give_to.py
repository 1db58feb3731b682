"""``give_to`` (root handing a run's results tree to the invoking user) changes nothing outside the tree
(issue 25, finding 8).

The tree is the user's to write while root walks it, so the user can plant a hard link to a root file, or
swap a directory for a symbolic link to another directory mid-walk. Real files, a real racing process.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launcher.backends.containers import give_to

UID = GID = 65534  # nobody; need not exist

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (CI runs as root): it changes owners")


def test_a_hard_link_and_a_symlink_in_the_tree_leave_their_targets_alone(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    secret = outside / "secret"
    secret.write_text("root's")
    tree = tmp_path / "results"
    (tree / "logs").mkdir(parents=True)
    (tree / "logs" / "master.log").write_text("x")
    os.link(secret, tree / "logs" / "linked")  # the user's hard link to a root file (same file system)
    (tree / "to-outside").symlink_to(outside)
    give_to(tree, UID, GID)
    assert (os.stat(secret).st_uid, os.stat(outside).st_uid) == (0, 0)
    assert os.stat(tree).st_uid == os.stat(tree / "logs").st_uid == os.stat(tree / "logs" / "master.log").st_uid == UID
    assert os.lstat(tree / "to-outside").st_uid == 0  # the link itself is left as well


# Swaps results/sub for a link to the outside directory and back, as fast as it can, until killed.
_RACER = """import os, sys
tree, outside = sys.argv[1], sys.argv[2]
sub, real, link = f"{tree}/sub", f"{tree}/sub.real", f"{tree}/sub.link"
os.symlink(outside, link)
print("racing", flush=True)
while True:
    os.rename(sub, real); os.rename(link, sub)  # sub is now the link
    os.rename(sub, link); os.rename(real, sub)  # and the directory again
"""


def test_a_directory_swapped_for_a_link_mid_walk_is_not_followed(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    tree = tmp_path / "results"
    (tree / "sub").mkdir(parents=True)
    names = [f"f{i:04d}" for i in range(400)]
    for n in names:  # the same names in both, so a redirected path names an outside file
        (outside / n).write_text("root's")
        (tree / "sub" / n).write_text("user's")
    racer = subprocess.Popen([sys.executable, "-c", _RACER, str(tree), str(outside)], stdout=subprocess.PIPE, text=True)
    walks = 0
    try:
        assert racer.stdout is not None and racer.stdout.readline().strip() == "racing"
        deadline = time.monotonic() + 4
        while time.monotonic() < deadline:
            try:
                give_to(tree, UID, GID)
            except OSError:  # the walk itself may trip over the swap; only what it changed matters here
                pass
            walks += 1
            if any(os.lstat(outside / n).st_uid != 0 for n in names) or os.lstat(outside).st_uid != 0:
                break
    finally:
        racer.kill()
        racer.wait()
    changed = [n for n in names if os.lstat(outside / n).st_uid != 0]
    assert changed == [] and os.lstat(outside).st_uid == 0, (
        f"root gave {len(changed)} files outside the tree away after {walks} walks")
    print("figures:", {"walks": walks})
