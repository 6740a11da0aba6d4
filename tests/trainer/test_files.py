"""``trainer.files``: the lock file of a :class:`FileLock` is a plain file, never a link followed
or a folder locked; :func:`creation_problem` tells before the work whether an output can be
created."""

from __future__ import annotations

import os

import pytest

from trainer.files import FileLock, LockFileError, creation_problem, lock_path


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


def test_creation_problem_names_what_would_fail_and_leaves_nothing(tmp_path):
    name_max = os.pathconf(tmp_path, "PC_NAME_MAX")
    (tmp_path / "afile").write_text("mine")
    os.utime(tmp_path, ns=(10**18, 10**18))
    assert creation_problem(tmp_path / "new" / "deeper" / "out", inside="state/x") is None
    assert os.stat(tmp_path).st_mtime_ns == 10**18  # the probe's folder's times set back
    assert creation_problem(tmp_path / "afile") is None  # replaced through a sibling
    assert creation_problem(tmp_path / "afile" / "out") == f"{tmp_path / 'afile'} is not a folder"
    too_long = creation_problem(tmp_path / ("n" * (name_max + 1)))
    assert too_long.startswith("the name nnnn") and f"{name_max + 1} bytes long" in too_long
    no_room = creation_problem(tmp_path / ("n" * name_max) / "out")  # a folder above, too
    assert f"{name_max} are allowed, less 26 for the temporary name" in no_room
    deep = tmp_path / os.path.join(*["p" * 200] * 25)
    assert "is too long" in creation_problem(deep)
    inside = "x/" * 2100  # short names, but the deepest path written is over PATH_MAX
    assert "is too long" in creation_problem(tmp_path / "out", inside=inside)
    if os.path.isdir("/proc"):  # nothing can be created there, also by root
        assert creation_problem("/proc/forbidden/out").startswith("nothing can be created in /proc")
    assert sorted(os.listdir(tmp_path)) == ["afile"]  # no probe left, no folder created
