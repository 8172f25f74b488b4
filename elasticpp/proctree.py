"""Process trees from /proc (Linux), for killing and checking everything a process started.

Workers run in sessions of their own, so a process-group kill of their supervisor misses
them; walking parent links finds them. A leaf module: standard library only.
"""

from __future__ import annotations

from pathlib import Path


def process_tree(root_pid: int) -> dict[int, str]:
    """Live (non-zombie) descendants of `root_pid`: pid -> command name."""
    parent_of: dict[int, int] = {}
    names: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # "pid (comm) state ppid ...": comm may hold spaces, so split after the last ')'.
        fields = stat[stat.rindex(")") + 2 :].split()
        if fields[0] == "Z":
            continue
        parent_of[int(entry.name)] = int(fields[1])
        names[int(entry.name)] = stat[stat.index("(") + 1 : stat.rindex(")")]
    found: dict[int, str] = {}
    frontier = {root_pid}
    while frontier:
        children = {pid for pid, ppid in parent_of.items() if ppid in frontier} - found.keys()
        for pid in sorted(children):
            found[pid] = names[pid]
        frontier = children
    return found


def descendants(root_pid: int) -> list[int]:
    return list(process_tree(root_pid))
