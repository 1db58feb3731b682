"""The master's checkpoints (worker/checkpoint.py): a write traced once, which must still save what each save
holds (the values of the moment, every variable that exists, the newest few listed in a state file that
TensorFlow's own readers read), with real TensorFlow and real files."""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

tf = pytest.importorskip("tensorflow")

from worker.checkpoint import Checkpointer, Counters, TracedWrite  # noqa: E402


class Stats(tf.Module):
    def __init__(self) -> None:
        super().__init__()
        self.mean = tf.Variable(np.zeros(3, np.float32), name="mean")


def saved_names(path: str) -> set[str]:
    return set(tf.train.load_checkpoint(path).get_variable_to_shape_map())


def saved_value(path: str, fragment: str) -> np.ndarray:
    reader = tf.train.load_checkpoint(path)
    (name,) = [n for n in reader.get_variable_to_shape_map() if fragment in n and "OPTIMIZER" not in n]
    return reader.get_tensor(name)


def test_each_checkpoint_holds_the_values_it_was_saved_with(tmp_path: Path) -> None:
    stats = Stats()
    ck = Checkpointer(tmp_path, {"stats": stats}, window=4)
    paths = []
    for i in range(1, 4):
        stats.mean.assign(np.full(3, float(i), np.float32))
        paths.append(ck.save(Counters(updates=i, env_steps=100 * i), [float(i)]))
    assert ck._write.traces == 1  # one trace served every save
    for i, path in enumerate(paths, start=1):
        np.testing.assert_array_equal(saved_value(path, "stats/mean"), np.full(3, float(i), np.float32))
    again = Stats()
    restored = Checkpointer(tmp_path, {"stats": again}, window=4).restore_latest()
    assert restored is not None
    counters, recent, path = restored
    assert (counters.updates, counters.env_steps, recent, path) == (3, 300, [3.0], paths[-1])
    np.testing.assert_array_equal(again.mean.numpy(), np.full(3, 3.0, np.float32))


def test_a_variable_made_after_the_first_save_is_in_the_next_checkpoint(tmp_path: Path) -> None:
    """A traced write saves the objects that existed when it was traced: the object graph is checked on every
    save and the write traced again when it changed."""
    stats = Stats()
    ck = Checkpointer(tmp_path, {"stats": stats}, window=4)
    first = ck.save(Counters(updates=1), [])
    stats.count = tf.Variable(7, dtype=tf.int64, name="count")  # made later, as a learner's lazy slot would be
    second = ck.save(Counters(updates=2), [])
    assert not any("stats/count" in n for n in saved_names(first))
    assert saved_value(second, "stats/count") == 7
    stats.mean = tf.Variable(np.ones(3, np.float32), name="mean")  # replaced under the same name
    third = ck.save(Counters(updates=3), [])
    np.testing.assert_array_equal(saved_value(third, "stats/mean"), np.ones(3, np.float32))
    assert ck._write.traces == 3


def test_the_newest_are_kept_and_listed_where_tensorflow_reads_them(tmp_path: Path) -> None:
    where = tmp_path / "checkpoints"
    stats = Stats()
    ck = Checkpointer(where, {"stats": stats}, window=4, max_to_keep=3)
    for i in range(1, 6):
        ck.save(Counters(updates=10 * i), [])
    names = [str(where / f"ckpt-{n}") for n in (30, 40, 50)]
    assert ck.checkpoints == names
    on_disk = {p.name.split(".")[0] for p in where.iterdir() if p.name.startswith("ckpt-")}
    assert on_disk == {"ckpt-30", "ckpt-40", "ckpt-50"}  # the older ones' files are gone
    assert [p.name for p in where.iterdir() if "tmp" in p.name] == []
    # TensorFlow's own readers: the state file it writes, in its format
    assert tf.train.latest_checkpoint(str(where)) == names[-1]
    assert tf.train.CheckpointManager(tf.train.Checkpoint(), str(where), max_to_keep=3).checkpoints == names
    # names are relative to the directory: mounted elsewhere (the host and a container) it still reads
    moved = tmp_path / "moved"
    shutil.copytree(where, moved)
    assert tf.train.latest_checkpoint(str(moved)) == str(moved / "ckpt-50")
    assert str(where) not in (moved / "checkpoint").read_text()


def test_a_resumed_run_restores_and_keeps_rotating_what_an_earlier_launcher_wrote(tmp_path: Path) -> None:
    """A run written by ``tf.train.CheckpointManager`` (the launcher before the traced write) resumes: the
    newest is restored and later saves rotate the old ones out."""
    stats = Stats()
    ck = tf.train.Checkpoint(stats=stats, counters=tf.Variable(np.zeros(4, np.int64)),
                             recent_returns=tf.Variable(np.zeros(4)), n_recent_returns=tf.Variable(0, dtype=tf.int64))
    manager = tf.train.CheckpointManager(ck, str(tmp_path), max_to_keep=3)
    for n in (5, 6):
        stats.mean.assign(np.full(3, float(n), np.float32))
        ck.counters.assign(np.array([n * 10, n, 0, n], np.int64))
        manager.save(checkpoint_number=n)
    again = Stats()
    resumed = Checkpointer(tmp_path, {"stats": again}, window=4, max_to_keep=3)
    restored = resumed.restore_latest()
    assert restored is not None and restored[0].updates == 6 and restored[2].endswith("ckpt-6")
    np.testing.assert_array_equal(again.mean.numpy(), np.full(3, 6.0, np.float32))
    for n in (7, 8):
        resumed.save(Counters(updates=n), [])
    assert [Path(p).name for p in resumed.checkpoints] == ["ckpt-6", "ckpt-7", "ckpt-8"]
    assert not list(tmp_path.glob("ckpt-5.*"))
    assert tf.train.CheckpointManager(tf.train.Checkpoint(), str(tmp_path), max_to_keep=3).checkpoints == \
        resumed.checkpoints


class Cursor(tf.train.experimental.PythonState):
    """Python state a learner may checkpoint: serialised by Python code on every save."""

    def __init__(self) -> None:
        self.position = 0

    def serialize(self) -> str:
        return str(self.position)

    def deserialize(self, string_value: str) -> None:
        self.position = int(string_value)


def test_python_state_is_saved_as_it_is_at_each_save(tmp_path: Path) -> None:
    """A trace would run a PythonState's serialize once and freeze its value: such a graph is written eagerly."""
    cursor = Cursor()
    ck = Checkpointer(tmp_path, {"stats": Stats(), "cursor": cursor}, window=4)
    for n in (1, 2):
        cursor.position = 10 * n
        ck.save(Counters(updates=n), [])
    again = Cursor()
    Checkpointer(tmp_path, {"stats": Stats(), "cursor": again}, window=4).restore_latest()
    assert again.position == 20


def test_a_damaged_checkpoint_is_skipped_on_restore_and_no_longer_listed(tmp_path: Path) -> None:
    """A resumed run falls back past a torn checkpoint; its next save (here with the restored number again, as a
    run that is already done writes at its end) lists only checkpoints that restore. The torn files stay."""
    stats = Stats()
    ck = Checkpointer(tmp_path, {"stats": stats}, window=4, max_to_keep=3)
    for n in (1, 2, 3):
        stats.mean.assign(np.full(3, float(n), np.float32))
        ck.save(Counters(updates=n), [])
    torn = max(tmp_path.glob("ckpt-3.data-*"), key=lambda p: p.stat().st_size)
    with open(torn, "r+b") as fh:
        fh.truncate(torn.stat().st_size // 2)
    again = Stats()
    resumed = Checkpointer(tmp_path, {"stats": again}, window=4, max_to_keep=3)
    restored = resumed.restore_latest()
    assert restored is not None and restored[0].updates == 2
    np.testing.assert_array_equal(again.mean.numpy(), np.full(3, 2.0, np.float32))
    resumed.save(Counters(updates=2), [])
    listed = tf.train.CheckpointManager(tf.train.Checkpoint(), str(tmp_path), max_to_keep=3).checkpoints
    assert [Path(p).name for p in listed] == ["ckpt-1", "ckpt-2"]
    for path in listed:
        tf.train.Checkpoint(stats=Stats()).restore(path).expect_partial()
    assert torn.exists()


def test_a_failed_write_says_what_went_wrong_in_one_line(tmp_path: Path) -> None:
    """The traced write's errors carry TensorFlow's graph trace; what the run records is the cause alone, as the
    eager write said it (here: the directory replaced by a file, before the save and during it)."""
    ck = Checkpointer(tmp_path / "checkpoints", {"stats": Stats()}, window=4)
    ck.save(Counters(updates=1), [])
    shutil.rmtree(tmp_path / "checkpoints")
    (tmp_path / "checkpoints").write_text("not a directory\n")
    write = TracedWrite(tf.train.Checkpoint(stats=Stats()))
    for fail in (lambda: ck.save(Counters(updates=2), []), lambda: write(str(tmp_path / "checkpoints" / "ckpt-2"))):
        with pytest.raises(tf.errors.OpError) as info:
            fail()
        message = info.value.message
        assert "\n" not in message and "Graph execution error" not in message, message
        assert "not a directory" in message.lower(), message
