"""``trainer.files``: the lock file of a :class:`FileLock` is a plain file, never a link followed
or a folder locked."""

from __future__ import annotations

import os

import pytest

from trainer.files import FileLock, LockFileError, lock_path


def _tree(root):
    """Every path under ``root`` (links not followed) with what it is and holds."""
    found = {}
    for folder, names, files in os.walk(root):
        for name in names + files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                found[path] = ("link", os.readlink(path))
            elif os.path.isfile(path):
                with open(path, "rb") as handle:
                    found[path] = ("file", handle.read())
            else:
                found[path] = ("other", None)
    return found


def test_a_lock_file_is_created_beside_its_target_and_kept(tmp_path):
    path = lock_path(tmp_path / "state")
    with FileLock(path) as lock:
        assert lock.held and os.path.isfile(path)
    assert not lock.held and os.path.isfile(path)
    with (
        FileLock(path, shared=True),
        FileLock(path, shared=True, timeout=0),
        pytest.raises(TimeoutError, match="another process holds it"),
    ):
        FileLock(path, timeout=0).acquire()


@pytest.mark.hostile
@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize("kind", ["dangling link", "link to a file", "folder", "fifo"])
def test_anything_but_a_plain_file_at_the_lock_path_is_refused(tmp_path, kind, shared):
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    outside.mkdir()
    path = lock_path(inside / "state")
    if kind == "dangling link":  # followed, it would create a file outside the folder
        os.symlink(outside / "created", path)
    elif kind == "link to a file":
        (outside / "theirs").write_bytes(b"not a lock file")
        os.symlink(outside / "theirs", path)
    elif kind == "folder":
        os.mkdir(path)
    else:  # opened without O_NONBLOCK, a FIFO would block the reader forever
        os.mkfifo(path)
    before = _tree(tmp_path)
    lock = FileLock(path, shared=shared, timeout=0)
    with pytest.raises(LockFileError, match=f"the lock file {path} is .*remove it") as raised:
        lock.acquire()
    assert isinstance(raised.value, OSError) and len(str(raised.value).splitlines()) == 1
    assert not lock.held
    assert _tree(tmp_path) == before  # nothing created, nothing changed
