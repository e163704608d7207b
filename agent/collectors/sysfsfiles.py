"""Small sysfs attribute files kept open across scrapes and re-read with ``os.pread(fd, n, 0)``.

sysfs regenerates an attribute's text on every read at offset 0, so a counter file opened once can be re-read
each scrape for one syscall instead of three (open, read, close: most of a NIC scrape's cost on a host with
hundreds of InfiniBand counter files). What this has to get right is when a kept descriptor no longer stands
for the file at its path:

* real sysfs: a removed attribute (hot-unplug, driver reload) answers ENODEV (ENOENT/ESTALE/ENXIO on other
  file systems); the directory's descriptors are closed and it is opened afresh on the next read;
* a regular-file tree (tests'): a file replaced by a rename or removed keeps its old text behind an open
  descriptor, so every read first ``stat``\\ s the directory (one call per directory, not per file) and opens
  its files again when its inode or mtime changed. A directory whose mtime is within :data:`RACY_SECONDS` of
  the time it was checked may still change within the same timestamp tick (as git's "racily clean" index
  entries), so it is not trusted: its files are opened, read and closed each time, as without this module,
  until the directory has been quiet that long. A directory whose parent was checked since the last
  :meth:`SysfsFiles.sweep` is looked up by name in the parent's kept descriptor (one component instead of a
  walk of the whole path): the parent's check made sure that descriptor is the directory at its path now;
* a directory on sysfs itself (its device is one of a ``sysfs`` mount's in ``/proc/self/mountinfo``), or in a
  tree whose writer writes as sysfs does (``is_sysfs``: the simulated host's, see
  :data:`~gpufleet.vocab.sysfs.IN_PLACE_MARKER`), needs none of that: sysfs never replaces an attribute
  file while its directory exists, and a removed one answers ENODEV, so such a directory is stat'ed only when
  its entry is made, is trusted at once, and its reads are preads alone;
* every :data:`RESCAN_SECONDS` everything is opened again anyway (and a sysfs directory listed again).

:meth:`SysfsFiles.values` called again with the same names while every one of them has a kept descriptor is
one ``pread`` per file (of :data:`SMALL_READ` bytes first) and nothing else.

At most ``max_fds`` descriptors stay open (a quarter of the open-file limit, at most 2048, and leaving room
for the HTTP server's connections); past that, files are read with open/read/close (a directory's own
descriptor counts too). :meth:`SysfsFiles.close` closes them all (the collector's ``close``); a ``SysfsFiles`` that is dropped without it closes them when collected; :meth:`SysfsFiles.sweep` after each scrape
closes those of directories that were not read in it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

RESCAN_SECONDS = 300.0
RACY_SECONDS = 1.0
MAX_FDS = 2048
READ_SIZE = 4096  # the kernel's sysfs page: an attribute is never larger
#: What :meth:`SysfsFiles.values` reads first: a counter's or state's text is shorter, and a buffer of this size
#: costs a third of a 4096-byte one; a text that fills it is read again whole.
SMALL_READ = 128
_O_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
#: A descriptor that answers these no longer stands for a file: open the directory again.
_GONE = frozenset({errno.ENODEV, errno.ENOENT, errno.ESTALE, errno.ENXIO})


#: Descriptors left to others: the HTTP server's connections (512 by default) and a reserve beside them.
_OTHERS = 512 + 128


#: The file systems whose directories need no rename check (their device numbers: :func:`sysfs_devices`).
_SYSFS_TYPES = frozenset({"sysfs"})
_MOUNTINFO = "/proc/self/mountinfo"
_sysfs_devs: tuple[float, frozenset[int]] = (-float("inf"), frozenset())


def parse_mountinfo(text: str, types: frozenset[str] = _SYSFS_TYPES) -> frozenset[int]:
    """The device numbers (``st_dev``) of the mounts of the file system ``types`` in a ``mountinfo`` text
    (``36 35 0:22 / /sys rw,relatime - sysfs sysfs rw``: the third field, ``major:minor``, and the type after
    ``-``); lines it cannot parse are skipped."""
    out: set[int] = set()
    for line in text.splitlines():
        fields = line.split()
        try:
            fstype = fields[fields.index("-") + 1]
            major, minor = fields[2].split(":")
            if fstype in types:
                out.add(os.makedev(int(major), int(minor)))
        except (ValueError, IndexError):
            continue
    return frozenset(out)


def sysfs_devices(clock: Callable[[], float] = time.monotonic) -> frozenset[int]:
    """The device numbers of this process's sysfs mounts (read again every :data:`RESCAN_SECONDS`; none if
    ``/proc/self/mountinfo`` cannot be read: every directory then gets the regular-file checks)."""
    global _sysfs_devs
    now = clock()
    at, devs = _sysfs_devs
    if now - at >= RESCAN_SECONDS or now < at:
        try:
            with open(_MOUNTINFO, encoding="utf-8", errors="replace") as f:
                devs = parse_mountinfo(f.read())
        except OSError:
            devs = frozenset()
        _sysfs_devs = (now, devs)
    return devs


def default_max_fds() -> int:
    """A quarter of the soft open-file limit, at most :data:`MAX_FDS`, and never so many that the HTTP server's
    connections and a reserve would no longer fit (none at all under a very small limit)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return MAX_FDS
    return max(0, min(MAX_FDS, soft // 4, soft - _OTHERS))


@dataclass
class _Dir:
    key: tuple[int, int, int]  # (device, inode, mtime ns) when checked
    trusted: bool  # quiet long enough: descriptors are kept
    opened: float  # monotonic time the entry was made
    fds: dict[str, int] = field(default_factory=dict)
    names: list[str] | None = None  # the directory's listing (sorted), read once per entry
    missing: set[str] = field(default_factory=set)  # not there when opened (a new file changes the mtime)
    sysfs: bool = False  # on sysfs: not stat'ed again until the rescan (module docstring)
    dirfd: int = -1  # regular trees, trusted: the directory itself (O_PATH), to check its subdirectories by name
    gen: int = -1  # the sweep generation it was last checked in
    #: The names of the last :meth:`SysfsFiles.values` call whose files all have kept descriptors (these), so
    #: that the same call again is one pread each; None once any descriptor of the directory is closed.
    fast: Sequence[str] | None = None
    fast_fds: list[int] = field(default_factory=list)


_O_DIR = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | os.O_CLOEXEC


def _close_all(fds: dict[str, int]) -> None:
    for fd in fds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    fds.clear()


def _close_dir(d: _Dir) -> None:
    d.fast = None
    _close_all(d.fds)
    if d.dirfd >= 0:
        with contextlib.suppress(OSError):
            os.close(d.dirfd)
        d.dirfd = -1


def _open_dir(path: str, key: tuple[int, int, int]) -> int:
    """A descriptor of directory ``path`` if it is still the one ``key`` names (-1 if not, or not openable)."""
    try:
        fd = os.open(path, _O_DIR)
    except OSError:
        return -1
    try:
        st = os.fstat(fd)
        if (st.st_dev, st.st_ino) == key[:2]:
            return fd
    except OSError:
        pass
    os.close(fd)
    return -1


def _close_dirs(dirs: dict[str, _Dir]) -> None:
    for d in dirs.values():
        _close_dir(d)
    dirs.clear()


class SysfsFiles:
    """Reads files of sysfs directories by path, keeping descriptors open where that is safe (module docstring)."""

    def __init__(self, max_fds: int | None = None, rescan_seconds: float = RESCAN_SECONDS,
                 clock: Callable[[], float] = time.monotonic,
                 is_sysfs: Callable[[str, int], bool] | None = None) -> None:
        self.max_fds = default_max_fds() if max_fds is None else max_fds
        self.rescan_seconds = rescan_seconds
        self._clock = clock
        #: Whether a directory (its path and ``st_dev``) is read as sysfs: by default when it is on a sysfs mount
        #: (a collector may add a tree written as sysfs is, see :data:`~gpufleet.vocab.sysfs.IN_PLACE_MARKER`;
        #: tests may pretend).
        self.is_sysfs: Callable[[str, int], bool] = is_sysfs or (lambda path, dev: dev in sysfs_devices())
        self._dirs: dict[str, _Dir] = {}
        self._used: set[str] = set()
        #: Bumped by sweep(): a parent checked in the current generation vouches for its directory descriptor.
        self._gen = 0
        #: close() from another thread (shutdown) never closes a descriptor a read is about to use.
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, _close_dirs, self._dirs)

    @property
    def open_fds(self) -> int:
        return sum(len(d.fds) + (d.dirfd >= 0) for d in self._dirs.values())

    def close(self) -> None:
        """Close every kept descriptor (reads after this open them again)."""
        with self._lock:
            _close_dirs(self._dirs)

    def sweep(self) -> None:
        """Close the descriptors of directories not read since the last sweep (a device that went away); call it
        after each pass over the tree (a parent's check vouches for its subdirectories until the next sweep)."""
        with self._lock:
            for path in [p for p in self._dirs if p not in self._used]:
                self._forget(path)
            self._used.clear()
            self._gen += 1

    def check(self, path: str) -> tuple[tuple[int, int, int], bool, bool] | None:
        """``((st_dev, st_ino, st_mtime_ns), trusted, on sysfs)`` of directory ``path`` as its entry was made (the entry is
        made anew when the directory changed: see the module docstring), None if it is not there. A
        subdirectory read after its parent's check, before the next :meth:`sweep`, is checked by name in the
        parent's descriptor instead of by a walk of its whole path."""
        with self._lock:
            d = self._entry(path)
            return None if d is None else (d.key, d.trusted, d.sysfs)

    def forget(self, prefix: str) -> None:
        """Drop the entries (and close the descriptors) of ``prefix`` and the directories below it: the next
        read checks them afresh (a device that was re-created)."""
        with self._lock:
            below = prefix.rstrip("/") + "/"
            for path in [p for p in self._dirs if p == prefix or p.startswith(below)]:
                self._forget(path)

    def _entry(self, path: str) -> _Dir | None:
        """The checked entry of directory ``path`` (made anew when it changed); None if it is not there."""
        self._used.add(path)
        d = self._dirs.get(path)
        mono = self._clock()
        if d is not None and d.sysfs and mono - d.opened < self.rescan_seconds:
            return d  # sysfs: nothing to check (a removed file answers ENODEV)
        now_ns = time.time_ns()
        # The parent checked in this generation (a regular tree's): its descriptor is the directory at its
        # path now, so the name in it is this path (one lookup instead of a walk through every component).
        parent, _, leaf = path.rpartition("/")
        up = self._dirs.get(parent) if parent else None
        base = -1
        if up is not None and up.gen == self._gen and up.trusted and not up.sysfs:
            if up.dirfd < 0 and self.open_fds < self.max_fds:
                up.dirfd = _open_dir(parent, up.key)  # kept from its first child on (leaves need none)
            base = up.dirfd
        try:
            st = os.stat(leaf, dir_fd=base) if base >= 0 else os.stat(path)
        except OSError:
            self._forget(path)
            return None
        key = (st.st_dev, st.st_ino, st.st_mtime_ns)
        if d is not None and d.trusted and d.key == key and mono - d.opened < self.rescan_seconds:
            d.gen = self._gen
            return d
        if d is not None:
            _close_dir(d)
        sysfs = self.is_sysfs(path, st.st_dev)
        d = _Dir(key, sysfs or st.st_mtime_ns < now_ns - int(RACY_SECONDS * 1e9), mono, sysfs=sysfs, gen=self._gen)
        self._dirs[path] = d
        return d

    def _forget(self, path: str) -> None:
        d = self._dirs.pop(path, None)
        if d is not None:
            _close_dir(d)

    def listdir(self, path: str) -> list[str] | None:
        """The sorted names in directory ``path`` (cached while it is unchanged), None if it cannot be listed."""
        with self._lock:
            return self._listdir(path)

    def _listdir(self, path: str, d: _Dir | None = None) -> list[str] | None:
        d = d or self._entry(path)
        if d is None:
            return None
        if d.names is None:
            try:
                names = sorted(os.listdir(path))
            except OSError:
                self._forget(path)
                return None
            if not d.trusted:
                return names
            d.names = names
        return d.names

    def read(self, path: str, names: Iterable[str]) -> list[tuple[str, bytes | OSError]] | None:
        """``(name, text)`` for each file in ``names`` under directory ``path`` (its stripped contents, or the
        OSError that opening or reading it raised); None if the directory is not there."""
        with self._lock:
            return self._read(path, names)

    def values(self, path: str, names: Sequence[str]) -> list[bytes | OSError] | None:
        """What :meth:`read` reads, the texts (or errors) alone, in the order of ``names``. Called again with
        the same ``names`` object while every one of its files has a kept descriptor, it is one ``pread`` per
        file and nothing else."""
        with self._lock:
            d = self._entry(path)
            return None if d is None else self._values(path, names, d)

    def values_listed(self, path: str, select: Callable[[list[str]], Sequence[str]],
                      ) -> tuple[Sequence[str], list[bytes | OSError]] | None:
        """:meth:`listdir` and :meth:`values` of the names ``select`` picks from the listing, with one check of
        the directory: ``(picked names, values)``, or None if the directory is not there or cannot be listed."""
        with self._lock:
            d = self._entry(path)
            if d is None:
                return None
            listed = self._listdir(path, d)
            if listed is None:
                return None
            names = select(listed)
            got = self._values(path, names, d)
            return None if got is None else (names, got)

    def _values(self, path: str, names: Sequence[str], d: _Dir) -> list[bytes | OSError] | None:
        if d.fast is names:
            pread, small = os.pread, SMALL_READ
            try:
                raws = [pread(fd, small, 0) for fd in d.fast_fds]
                if raws and max(map(len, raws)) >= small:
                    raws = [pread(fd, READ_SIZE, 0) if len(raw) >= small else raw
                            for fd, raw in zip(d.fast_fds, raws, strict=True)]
                return [raw.strip() for raw in raws]
            except OSError:
                pass  # the general path below tells which file and why
        read = self._read(path, names, d)
        if read is None:
            return None
        out: list[bytes | OSError] = [raw for _, raw in read]
        fds = d.fds
        if self._dirs.get(path) is d and all(type(raw) is bytes for raw in out) and all(n in fds for n in names):
            d.fast, d.fast_fds = names, [fds[n] for n in names]
        else:
            d.fast = None
        return out

    def _read(self, path: str, names: Iterable[str], d: _Dir | None = None,
              ) -> list[tuple[str, bytes | OSError]] | None:
        d = d or self._entry(path)
        if d is None:
            return None
        out: list[tuple[str, bytes | OSError]] = []
        append = out.append
        fds = d.fds
        keep = d.trusted
        room = -1  # descriptors that may still be kept: counted when the first file is opened
        pread, open_, close, size = os.pread, os.open, os.close, READ_SIZE
        gone = False
        for name in names:
            fd = fds.get(name)
            if fd is not None:
                try:
                    append((name, pread(fd, size, 0).strip()))
                    continue
                except OSError as e:
                    if e.errno not in _GONE:
                        append((name, e))
                        continue
                    gone = True  # fall through: open it again by its path
                    d.fast = None
                    del fds[name]
                    close(fd)
            elif name in d.missing:
                append((name, FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)))
                continue
            try:
                fd = open_(os.path.join(path, name), _O_FLAGS)
            except OSError as e:
                append((name, e))
                if keep and e.errno == errno.ENOENT and not d.sysfs:  # sysfs: no mtime tells when it comes
                    d.missing.add(name)
                continue
            try:
                append((name, pread(fd, size, 0).strip()))
            except OSError as e:
                append((name, e))
                close(fd)
                continue
            if room < 0:
                room = self.max_fds - self.open_fds if keep else 0
            if room > 0:
                fds[name] = fd
                room -= 1
            else:
                close(fd)
        if gone:
            self._forget(path)  # something under it went away: check it all again next time
        return out
