"""File-system helpers for durable writes: the one home of ``fsync``, file locks, temporary names.

A durable replace is: write a temporary file in the target's folder (named by
:func:`temporary_sibling`), :func:`fsync_file` it, ``os.replace`` it onto the target, then
:func:`fsync_folder` the folder so that the rename itself survives a power loss.

:class:`FileLock` is an advisory lock between processes (``fcntl.flock`` on POSIX): any number of
shared holders, or one exclusive holder. It is released by the operating system when its holder
dies, so a killed process never leaves a folder locked.

Example:
    >>> import os, tempfile
    >>> target = os.path.join(tempfile.mkdtemp(), "state")
    >>> with FileLock(lock_path(target)):
    ...     os.path.basename(lock_path(target))
    '.state.lock'
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import secrets
import socket
import stat
import time
from types import TracebackType

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None  # type: ignore[assignment]

__all__ = [
    "FileLock",
    "LockFileError",
    "creation_problem",
    "fsync_file",
    "fsync_folder",
    "host_name",
    "is_temporary_sibling",
    "lock_path",
    "remove_dead_writers_temporaries",
    "set_usual_mode",
    "sha256_of_file",
    "temporary_sibling",
    "writer_temporary_prefix",
]


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Flush a written file's data to disk."""
    with open(path, "rb") as handle:
        os.fsync(handle.fileno())


def set_usual_mode(path: str | os.PathLike[str]) -> None:
    """Give a written file the mode ``open`` gives a new file (0666 less the umask, so 0644
    usually): ``mkstemp`` and safetensors' ``save_file`` leave 0600, which another user's
    process (a model server) cannot read."""
    umask = os.umask(0)  # the only way to read the umask; set back at once
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def sha256_of_file(path: str | os.PathLike[str]) -> str:
    """The SHA-256 of a file's bytes, read in 1 MiB blocks (hex digest)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fsync_folder(folder: str | os.PathLike[str]) -> None:
    """Flush a folder's entries (renames, new files) to disk, where the platform allows it."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory file descriptors
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - file systems that refuse fsync on a folder
        pass
    finally:
        os.close(fd)


# -- temporary names -------------------------------------------------------------------------------

_SUFFIX_CHARS = 16  # hex digits of the random part


def temporary_sibling(target: str | os.PathLike[str], tag: str) -> str:
    """A fresh path beside ``target`` for work in progress: ``<folder>/.<name>.<tag>.<16 hex>``.

    The path is not created. The name is recognised by :func:`is_temporary_sibling`, so that
    leftovers of a killed writer can be told apart from anything else in the folder.

    Args:
        target: The file or folder that the temporary one will replace.
        tag: What the temporary is for (letters only), e.g. ``"staging"``.
    """
    if not tag.isalpha():
        raise ValueError(f"temporary_sibling: tag must be letters only, got {tag!r}")
    folder, name = os.path.split(os.path.abspath(os.fspath(target)))
    return os.path.join(folder, f".{name}.{tag}.{secrets.token_hex(_SUFFIX_CHARS // 2)}")


def is_temporary_sibling(entry: str, target_name: str, tag: str) -> bool:
    """Whether ``entry`` (a name in the target's folder) was made by :func:`temporary_sibling`."""
    pattern = rf"\.{re.escape(target_name)}\.{re.escape(tag)}\.[0-9a-f]{{{_SUFFIX_CHARS}}}"
    return re.fullmatch(pattern, entry) is not None


# A temporary file is named after its target, host and process: .TARGET.HOST.PID.RANDOM.tmp.
# The next save of the same target removes the ones whose process is gone (killed mid-save), and
# never those of a live writer.


def host_name() -> str:
    """This machine's name as it appears in the names of temporary files (letters, digits, -)."""
    return re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"


def writer_temporary_prefix(path: str) -> str:
    """The start of the name of a temporary file this process writes before replacing ``path``."""
    return f".{os.path.basename(path)}.{host_name()}.{os.getpid()}."


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (OverflowError, ValueError):  # not a pid this library wrote: leave the file alone
        return True
    except PermissionError:  # alive, another user's
        return True
    return True


def remove_dead_writers_temporaries(path: str) -> None:
    """Delete temporary files of earlier saves of ``path`` whose writer on this host died."""
    folder = os.path.dirname(os.path.abspath(path))
    pattern = re.compile(
        rf"^\.{re.escape(os.path.basename(path))}\.{re.escape(host_name())}\.(\d+)\.[^.]+\.tmp$"
    )
    try:
        entries = os.listdir(folder)
    except OSError:
        return  # no folder yet: nothing stale
    for entry in entries:
        match = pattern.match(entry)
        if match and not _process_alive(int(match.group(1))):
            with contextlib.suppress(OSError):  # another saver removed it first
                os.unlink(os.path.join(folder, entry))


# -- whether a path can be created ---------------------------------------------------------------

_LONGEST_TAG = "staging"  # the longest tag of a temporary_sibling made beside an output


def _limit(folder: str, name: str, default: int) -> int:
    try:
        return os.pathconf(folder, name)
    except (OSError, ValueError):  # pragma: no cover - platforms without pathconf
        return default


def creation_problem(target: str | os.PathLike[str], *, inside: str = "") -> str | None:
    """Why ``target`` (a file or folder, with any missing folders above it) cannot be written,
    or None when it can: to find out before the work whose result it is to hold.

    The nearest existing folder above ``target`` must be a folder in which an entry can be
    created: a uniquely named folder is made there and removed again, and the folder's times
    set back (permission bits say nothing to root, nor of ``/proc`` or a read-only mount). No
    name to create may be so long that its :func:`temporary_sibling` is over the file system's
    ``NAME_MAX``, and the deepest path (the target's sibling joined with ``inside``, whose names
    are the caller's own short ones) not over ``PATH_MAX``.

    Args:
        target: The file or folder to write (it may exist: it is replaced through a sibling).
        inside: The longest relative path written inside ``target`` (a folder), if any.

    Returns:
        One sentence naming the path at fault and the reason, or None.
    """
    path = os.path.abspath(os.fspath(target))
    existing = os.path.dirname(path)
    while not os.path.lexists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"{existing} is not a folder"
    created = os.path.relpath(path, existing).split(os.sep)
    deepest = temporary_sibling(path, _LONGEST_TAG)  # the name longer than the target's
    extra = len(os.fsencode(os.path.basename(deepest))) - len(os.fsencode(created[-1]))
    name_max = _limit(existing, "PC_NAME_MAX", 255)
    for name in created:  # each may be made through a temporary sibling
        if len(os.fsencode(name)) > name_max - extra:
            return (
                f"the name {_shown(name)} is {len(os.fsencode(name))} bytes long; {name_max} are "
                f"allowed, less {extra} for the temporary name made beside it"
            )
    deepest = os.path.join(deepest, inside) if inside else deepest
    path_max = _limit(existing, "PC_PATH_MAX", 4096) - 1  # PATH_MAX counts the final NUL
    if len(os.fsencode(deepest)) > path_max:
        return (
            f"the path {_shown(path)} is too long: what is written there has paths of "
            f"{len(os.fsencode(deepest))} bytes, and {path_max} are allowed"
        )
    probe = temporary_sibling(os.path.join(existing, created[0]), "probe")
    times = os.stat(existing)
    try:
        os.mkdir(probe)
    except OSError as exc:
        return f"nothing can be created in {existing}: {exc.strerror or exc}"
    os.rmdir(probe)
    with contextlib.suppress(OSError):  # the folder's times as they were: a check changes nothing
        os.utime(existing, ns=(times.st_atime_ns, times.st_mtime_ns))
    return None


def _shown(name: str) -> str:
    return name if len(name) <= 60 else f"{name[:40]}...{name[-12:]}"


# -- locks -----------------------------------------------------------------------------------------


def lock_path(target: str | os.PathLike[str]) -> str:
    """The lock file of ``target``: ``.<name>.lock`` in the same folder. It is never removed."""
    folder, name = os.path.split(os.path.abspath(os.fspath(target)))
    return os.path.join(folder, f".{name}.lock")


class LockFileError(OSError):
    """Raised when something else than a plain file is at a lock file's path (a link, a folder):
    it is never followed, created through or locked."""


class FileLock:
    """An advisory lock on a file, shared or exclusive, between processes and threads.

    The lock file is created if missing (and kept: removing a lock file while another process
    waits on it would let two holders in). Every :class:`FileLock` opens its own descriptor, so
    two of them conflict even inside one process. A link at the path is never followed (a
    dangling one would otherwise create its target, wherever that is), and only a plain file is
    locked: anything else there is a :class:`LockFileError`.

    Args:
        path: The lock file.
        shared: True for a shared (reader) lock, False for an exclusive (writer) one.
        timeout: Seconds to wait for the lock; 0 tries once.

    Raises:
        TimeoutError: From :meth:`acquire`, when the lock is still held by another after
            ``timeout`` seconds.
        LockFileError: From :meth:`acquire`, when a link, a folder or anything but a plain file
            is at ``path``.
        OSError: When the lock file cannot be created or opened.

    Example:
        >>> import os, tempfile
        >>> path = os.path.join(tempfile.mkdtemp(), ".x.lock")
        >>> with FileLock(path, shared=True), FileLock(path, shared=True):
        ...     pass  # two readers at once
    """

    def __init__(
        self, path: str | os.PathLike[str], *, shared: bool = False, timeout: float = 60.0
    ) -> None:
        if fcntl is None:  # pragma: no cover - Windows
            raise OSError(errno.ENOSYS, "file locks need fcntl.flock (a POSIX system)")
        self.path = os.fspath(path)
        self.shared = shared
        self.timeout = timeout
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock, polling until ``timeout`` runs out."""
        if self._fd is not None:
            raise RuntimeError(f"the lock on {self.path} is already held by this FileLock")
        fd = self._open()
        mode = fcntl.LOCK_SH if self.shared else fcntl.LOCK_EX
        deadline = time.monotonic() + self.timeout
        pause = 0.005
        while True:
            try:
                fcntl.flock(fd, mode | fcntl.LOCK_NB)
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    os.close(fd)
                    what = "shared" if self.shared else "exclusive"
                    raise TimeoutError(
                        f"could not take the {what} lock {self.path} within {self.timeout:g} s: "
                        "another process holds it"
                    ) from None
                time.sleep(pause)
                pause = min(pause * 2, 0.1)
            except BaseException:
                os.close(fd)
                raise
            else:
                self._fd = fd
                return

    def _open(self) -> int:
        # Never through a link; never blocking on a FIFO that someone put there.
        flags = os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
        try:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT | flags, 0o666)
            except OSError as exc:
                # A reader of a read-only folder can still lock an existing lock file.
                if not self.shared or exc.errno not in (errno.EACCES, errno.EPERM, errno.EROFS):
                    raise
                fd = os.open(self.path, os.O_RDONLY | flags)
        except OSError:
            try:
                mode = os.lstat(self.path).st_mode
            except OSError:
                mode = stat.S_IFREG  # nothing there: the open's own error says more
            if not stat.S_ISREG(mode):
                raise self._not_a_file(mode) from None
            raise
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            raise self._not_a_file(mode)
        return fd

    def _not_a_file(self, mode: int) -> LockFileError:
        kind = {stat.S_IFLNK: "a symbolic link", stat.S_IFDIR: "a folder"}.get(
            stat.S_IFMT(mode), "not a plain file"
        )
        return LockFileError(
            f"the lock file {self.path} is {kind}; a lock file is a plain file, and a link there "
            "is never followed: remove it, then try again"
        )

    def release(self) -> None:
        """Give the lock back (closing the descriptor releases it)."""
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.release()
