"""The memory allocators a CPU training process can run under: the one table.

A process's allocator is fixed when it starts: glibc's malloc reads its tuning from
the environment (``MALLOC_*_``), and jemalloc or tcmalloc replace it through
``LD_PRELOAD``. So an allocator is a set of environment variables, handed to a child
process (``splitvit bench train --parts allocators``) or to the Ray Train workers
(``scaling.allocator``, through ``RunConfig.worker_runtime_env``).

Why it matters: a SPLIT step's tensors change size with every batch's token counts, and
glibc returns large freed blocks to the system and maps them afresh, faulting their
pages in again, where an allocator that keeps them reuses them
(docs/measurements/cpu-2026-12-05-seg-speed). No torch here: the command line and the
config checks use the table before torch loads.
"""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

#: glibc's default: the allocator a process gets with nothing set
DEFAULT_ALLOCATOR = "glibc"

#: environment variables that choose or tune an allocator, removed from a child's
#: inherited environment so that it runs under exactly the one it was given
ALLOCATOR_ENV_PREFIXES = ("MALLOC_", "LD_PRELOAD", "JE_MALLOC_CONF", "MALLOC_CONF", "TCMALLOC_")

#: glibc's thresholds far above any tensor: freed memory stays in the heap for reuse
#: (no mmap per large block, no trim back to the system); the footprint is the peak's
_KEEP = "1000000000"


@dataclass(frozen=True)
class Allocator:
    """One allocator: its name, the environment that selects it, and for a replacement
    allocator the shared library ``LD_PRELOAD`` loads (its file names, tried in order)
    and the Debian/Ubuntu package that installs it (the Docker image installs those)."""

    name: str
    description: str
    env: dict[str, str] = field(default_factory=dict)
    libraries: tuple[str, ...] = ()
    package: str | None = None

    @property
    def preloads(self) -> bool:
        """Whether the allocator is a library ``LD_PRELOAD`` loads (not glibc's own)."""
        return bool(self.libraries)


ALLOCATORS: dict[str, Allocator] = {
    a.name: a
    for a in (
        Allocator(DEFAULT_ALLOCATOR, "glibc malloc as the process starts (nothing set)"),
        Allocator(
            "glibc-keep",
            "glibc malloc keeping freed memory (mmap and trim thresholds at 1e9 bytes)",
            env={"MALLOC_MMAP_THRESHOLD_": _KEEP, "MALLOC_TRIM_THRESHOLD_": _KEEP},
        ),
        Allocator(
            "jemalloc",
            "jemalloc through LD_PRELOAD",
            libraries=("libjemalloc.so.2", "libjemalloc.so"),
            package="libjemalloc2",
        ),
        Allocator(
            "tcmalloc",
            "gperftools' tcmalloc (minimal) through LD_PRELOAD",
            libraries=("libtcmalloc_minimal.so.4", "libtcmalloc.so.4", "libtcmalloc_minimal.so"),
            package="libtcmalloc-minimal4",
        ),
    )
}


class AllocatorError(ValueError):
    """An unknown allocator name, or one whose library is not installed."""


def library_dirs() -> tuple[str, ...]:
    """Where an allocator's library is looked for: the dynamic linker's standard
    directories, the multiarch ones (Debian, Ubuntu) first, and this Python's prefix's
    ``lib`` (a conda environment's own packages)."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [
        *(f"{root}/{multiarch}" for root in ("/usr/lib", "/lib", "/usr/local/lib") if multiarch),
        "/usr/lib64",
        "/lib64",
        "/usr/lib",
        "/lib",
        "/usr/local/lib",
        str(Path(sysconfig.get_config_var("prefix") or "/usr") / "lib"),
    ]
    return tuple(dict.fromkeys(dirs))


def get_allocator(name: str) -> Allocator:
    """The allocator called ``name``; :class:`AllocatorError` naming the known ones otherwise."""
    try:
        return ALLOCATORS[name]
    except KeyError:
        raise AllocatorError(f"unknown allocator {name!r}; expected one of {', '.join(ALLOCATORS)}") from None


def find_library(allocator: Allocator, search_dirs: tuple[str, ...] | None = None) -> str | None:
    """The path of ``allocator``'s library in ``search_dirs`` (default
    :func:`library_dirs`), the first of its file names found; None for glibc's own
    allocators and for a library that is not there."""
    for directory in library_dirs() if search_dirs is None else search_dirs:
        for filename in allocator.libraries:
            path = Path(directory) / filename
            if path.is_file():
                return str(path)
    return None


def resolve_allocator_env(name: str, search_dirs: tuple[str, ...] | None = None) -> dict[str, str]:
    """The environment variables that start a process under allocator ``name`` on this
    machine: glibc's tuning as is, a replacement's ``LD_PRELOAD`` as its library's full
    path. :class:`AllocatorError` naming the allocator, its package and the directories
    searched when its library is not installed."""
    allocator = get_allocator(name)
    if not allocator.preloads:
        return dict(allocator.env)
    dirs = library_dirs() if search_dirs is None else search_dirs
    path = find_library(allocator, dirs)
    if path is None:
        raise AllocatorError(
            f"allocator {name!r} is not installed: none of {', '.join(allocator.libraries)} in "
            f"{', '.join(dirs)} (Debian/Ubuntu: apt-get install {allocator.package})"
        )
    return {**allocator.env, "LD_PRELOAD": path}


def worker_env_vars(name: str) -> dict[str, str]:
    """The environment variables for Ray Train workers under allocator ``name``
    (``scaling.allocator``): empty for the default, so nothing changes. A replacement
    allocator is preloaded by its library's file name, which the dynamic linker finds
    in its standard directories on each node: the node, not the driver, must have it
    (the Docker image does); where it is missing the linker says so on the worker's
    stderr and the worker runs on glibc (:func:`loaded_library` tells)."""
    allocator = get_allocator(name)
    env = dict(allocator.env)
    if allocator.preloads:
        env["LD_PRELOAD"] = allocator.libraries[0]
    return env


def loaded_library(name: str, maps: str = "/proc/self/maps") -> str | None:
    """The path of allocator ``name``'s library if this process has it mapped (it was
    preloaded), else None; None for glibc's own allocators and where ``maps`` cannot be read."""
    allocator = get_allocator(name)
    if not allocator.preloads:
        return None
    try:
        text = Path(maps).read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)  # address, perms, offset, device, inode, path (if any)
        path = fields[5].strip() if len(fields) == 6 else ""
        # the maps name the file behind the symlink (libtcmalloc_minimal.so.4.5.10 for .so.4)
        if os.path.basename(path).startswith(allocator.libraries):
            return path
    return None


def strip_allocator_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` without the variables that choose or tune an allocator
    (:data:`ALLOCATOR_ENV_PREFIXES`)."""
    return {k: v for k, v in env.items() if not k.startswith(ALLOCATOR_ENV_PREFIXES)}


def allocator_env_seen(env: dict[str, str] | None = None) -> dict[str, str]:
    """The allocator variables set in ``env`` (default this process's): what a process
    reports to show the allocator it started under."""
    env = dict(os.environ) if env is None else env
    return {k: v for k, v in sorted(env.items()) if k.startswith(ALLOCATOR_ENV_PREFIXES)}
