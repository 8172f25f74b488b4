"""Each part of the agent owns its state: one object, written by that part's code only.

Read from the source, so that a change that makes a part write another part's state fails
here, whatever the tests of behaviour cover. A part is a module of `elasticpp.agent`; its
state is one object on the agent (`self._vs` for the view, ...). Other parts read it, and
ask for changes through the owner's methods or the inboxes (`elasticpp.agent.inbox`); the
executor (`node.py`) only creates the objects.
"""

from __future__ import annotations

import ast
from pathlib import Path

import elasticpp.agent

AGENT_DIR = Path(elasticpp.agent.__file__).parent

# state object on the agent -> the modules whose code may write it
OWNERS: dict[str, frozenset[str]] = {
    "pool": frozenset({"pool"}),  # the supervisor's workers: written through its methods
    "_fs": frozenset({"follower"}),
}
# Parts that are objects now (elasticpp.agent.control, ...) own their state as fields of
# their own: no mixin reaches it, and this test has nothing to check for them.
# The executor: the agent's start-up, loop and lifecycle, and the actions' executor. It keeps
# its own fields (the server, the registration, the heartbeat) and writes no part's state.
EXECUTOR_MODULES = frozenset({"node", "startup"})
# Not state: I/O handles and inboxes, which any part may call.
HANDLES = frozenset(
    {
        "cluster",
        "store",
        "metrics",
        "cfg",
        "spec",
        "_registration",
        "_health",
        "journal",
        "errors",
        "executor",
        "control",
        "view",
        "supervisor",
        "durability",
        "liveness",
        "health",
        "leader",
        "_wake",
        "_stop",
        "_torch_ready",
        "_server",
    }
)
MUTATORS = frozenset(
    [
        "pop",
        "popitem",
        "setdefault",
        "clear",
        "update",
        "add",
        "discard",
        "append",
        "remove",
        "extend",
        "insert",
        "enter",
        "move",
    ]
)


def _root(node: ast.AST, aliases: dict[str, str]) -> tuple[str, int] | None:
    """The agent attribute `node` hangs from, and how many steps below it `node` is (0:
    `self.<root>` itself)."""
    depth = 0
    while True:
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == "self":
                return node.attr, depth
            node, depth = node.value, depth + 1
        elif isinstance(node, ast.Subscript):
            node, depth = node.value, depth + 1
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Name) and node.id in aliases:
            return aliases[node.id], depth + 1
        else:
            return None


def _writes(fn: ast.FunctionDef) -> list[tuple[int, str, int]]:
    """(line, root, depth) of every write in `fn`: depth 0 rebinds `self.<root>`, more
    writes inside it. A local bound to part of the agent's state (`gs = self._fs.gen`)
    writes that state."""
    aliases: dict[str, str] = {}
    for node in ast.walk(fn):
        if (
            isinstance(node, ast.Assign)
            and len(node.targets) == 1
            and isinstance(node.targets[0], ast.Name)
        ):
            found = _root(node.value, aliases)
            if found is not None:
                aliases[node.targets[0].id] = found[0]
    out: list[tuple[int, str, int]] = []
    for node in ast.walk(fn):
        targets: list[ast.AST] = []
        inside = 0  # a mutator changes what its receiver holds
        if isinstance(node, ast.Assign):
            targets = list(node.targets)
        elif isinstance(node, (ast.AugAssign, ast.AnnAssign)):
            targets = [node.target]
        elif isinstance(node, ast.Delete):
            targets = list(node.targets)
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in MUTATORS
        ):
            targets, inside = [node.func.value], 1
        for target in targets:
            for t in target.elts if isinstance(target, ast.Tuple) else [target]:
                if isinstance(t, ast.Name) and (inside == 0 or t.id not in aliases):
                    continue  # a local (rebound, or one that is no alias)
                found = _root(t, aliases)
                if found is not None:
                    out.append((node.lineno, found[0], found[1] + inside))
    return out


def violations() -> list[str]:
    found = []
    for path in sorted(AGENT_DIR.glob("*.py")):
        module = path.stem
        tree = ast.parse(path.read_text(encoding="utf-8"))
        executor = module in EXECUTOR_MODULES
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            if not (cls.name.endswith("Part") or cls.name == "Agent"):
                continue  # the state classes and handles write their own fields
            for fn in (n for n in cls.body if isinstance(n, ast.FunctionDef)):
                if cls.name == "Agent" and fn.name == "__init__":
                    continue  # the executor creates every part's state
                for line, root, depth in _writes(fn):
                    where = f"{module}.py:{line} ({cls.name}.{fn.name})"
                    if root in OWNERS:
                        if module not in OWNERS[root]:
                            found.append(f"{where} writes {root}, the state of {OWNERS[root]}")
                    elif root in HANDLES:
                        if depth == 0 and not executor:
                            found.append(f"{where} replaces the handle {root}")
                    elif not executor:
                        found.append(f"{where} keeps state {root!r} outside a part's object")
    return found


def test_no_part_writes_another_parts_state() -> None:
    assert violations() == []


def test_the_check_sees_writes_through_aliases_and_mutators(tmp_path: Path) -> None:
    """The check itself: each way of writing another part's state is found."""
    source = """
class LeakPart:
    def step(self):
        self._fs.detected.setdefault(3, 1.0)
        gs = self._fs.gen
        gs.enter("done")
        gs.phase = "done"
        self._vs.members["n"] = {}
        ls = self._ls.at(3, 0.0)
        ls.resume_written = True
        self._loose = 1
        self._dur = 2
        self.cluster = None
        self.cluster.arrive("x")
"""
    tree = ast.parse(source)
    fn = tree.body[0].body[0]  # type: ignore[attr-defined]
    writes = [(root, depth) for _, root, depth in _writes(fn)]
    assert [root for root, _ in writes].count("_fs") == 3  # setdefault, gs.enter, gs.phase
    assert [root for root, _ in writes].count("_vs") == 1
    assert [root for root, _ in writes].count("_ls") == 1  # through the alias `ls`
    assert "_ls" not in OWNERS  # the leader is an object: its state is its own
    assert ("_loose", 0) in writes and ("_dur", 0) in writes and ("cluster", 0) in writes
    assert all(depth > 0 for root, depth in writes if root in ("_fs", "_vs", "_ls"))
    assert len(writes) == 8  # `self.cluster.arrive(...)` is a call of a handle, no write
