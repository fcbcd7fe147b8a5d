"""How much RAM this process may still take: the kernel's MemAvailable, within the memory limit of
the container it runs in (Docker's `--memory`: cgroup v2 `memory.max`, or v1 `memory.limit_in_bytes`),
whichever is smaller. None where neither can be read (not Linux)."""

from __future__ import annotations

from pathlib import Path

MEMINFO = Path("/proc/meminfo")
CGROUP = Path("/sys/fs/cgroup")
_NO_LIMIT = 2**60  # cgroup v1 writes a huge number for "unlimited"


def available_ram_bytes(meminfo: Path = MEMINFO, cgroup: Path = CGROUP) -> int | None:
    known = [n for n in (_mem_available(meminfo), _cgroup_room(cgroup)) if n is not None]
    return min(known) if known else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cgroup_room(cgroup: Path) -> int | None:
    """The container's limit less what it uses now; None without a limit."""
    for limit_file, usage_file in (("memory.max", "memory.current"),  # v2
                                   ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes")):  # v1
        try:
            text = (cgroup / limit_file).read_text().strip()
            limit = _NO_LIMIT if text == "max" else int(text)
            usage = int((cgroup / usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        return None if limit >= _NO_LIMIT else max(0, limit - usage)
    return None
