"""Golden traces of the agent's pure steps: what each step was given and what it decided.

A trace case is one call of one pure step (`control_step`, `view_step`, `follower_step`, the
leader's feedback functions, ...): its arguments before the call, its arguments after (a step
writes only the state it is given) and what it returned (the actions). Cases are recorded from
real agents on failure walks (`record.py`) and replayed against the steps of the current tree
(`tests/unit/test_golden_steps.py`): the proof that moving a part changed no decision.

Values are written as tagged JSON: a dataclass as its class and fields, a tuple, set, frozenset
or dict with a tag (sets sorted, so two equal sets write the same text), an enum as its class
and value, a float that is not finite as its name. A value with no plain form (a future, a
thread, a lock) is written `{"__opaque": type}`; a case holding one cannot be replayed and the
replay says which. Classes are named `module:qualname`; a class that moved since a trace was
recorded is found by its qualname among elasticpp's classes (`Classes`), so a move of a class
from one module to another needs no new trace, a change of its fields does.

Decoding builds objects with `cls.__new__` and sets their fields, so a frozen dataclass or one
with `__post_init__` checks comes back as it was recorded, checks not run again.
"""

from __future__ import annotations

import collections
import dataclasses
import enum
import gzip
import importlib
import inspect
import json
import math
import pkgutil
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import elasticpp

Json = Any


def _cls_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def encode(x: Any, _path: tuple[int, ...] = ()) -> Json:
    """`x` as tagged JSON (see the module). A value that holds itself is opaque."""
    if id(x) in _path:
        return {"__opaque": "cycle"}
    if isinstance(x, enum.Enum):  # before str and int: a StrEnum is a str
        return {"__enum": _cls_name(type(x)), "v": encode(x.value)}
    if x is None or isinstance(x, (bool, str)):
        return x
    path = (*_path, id(x))

    def sub(v: Any) -> Json:
        return encode(v, path)

    if isinstance(x, int):
        return x
    if isinstance(x, float):
        return x if math.isfinite(x) else {"__float": repr(x)}
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {
            "__dc": _cls_name(type(x)),
            "f": {f.name: sub(getattr(x, f.name)) for f in dataclasses.fields(x)},
        }
    if isinstance(x, tuple) and hasattr(x, "_fields"):
        return {"__nt": _cls_name(type(x)), "v": [sub(v) for v in x]}
    if isinstance(x, tuple):
        return {"__tuple": [sub(v) for v in x]}
    if isinstance(x, list):
        return [sub(v) for v in x]
    if isinstance(x, collections.deque):
        return {"__deque": [sub(v) for v in x], "maxlen": x.maxlen}
    if isinstance(x, (set, frozenset)):
        tag = "__frozenset" if isinstance(x, frozenset) else "__set"
        return {tag: sorted((sub(v) for v in x), key=_canonical)}
    if isinstance(x, Mapping):
        pairs = [[sub(k), sub(v)] for k, v in x.items()]
        return {"__dict": sorted(pairs, key=lambda kv: _canonical(kv[0]))}
    if isinstance(x, bytes):
        return {"__bytes": x.hex()}
    if isinstance(x, Path):
        return {"__path": str(x)}
    cls = type(x)
    if cls.__module__.startswith("elasticpp.") and cls.__eq__ is not object.__eq__:
        # A value class of ours (it says when two are equal): its attributes.
        slots = [s for c in cls.__mro__ for s in getattr(c, "__slots__", ())]
        names = [*vars(x)] if hasattr(x, "__dict__") else [s for s in slots if hasattr(x, s)]
        return {"__obj": _cls_name(cls), "d": {k: sub(getattr(x, k)) for k in names}}
    return {"__opaque": f"{cls.__module__}.{cls.__qualname__}"}


def _canonical(x: Json) -> str:
    return json.dumps(x, sort_keys=True, allow_nan=False)


def has_opaque(
    x: Json, classes: Classes | None = None, read: frozenset[str] = frozenset()
) -> str | None:
    """The first opaque value's type in an encoded value, if it holds one. With `classes`,
    a field that moved out of its state since the recording (`Classes.moved_out`: a handle
    now held by the part's shell) or became another (`Classes.converted`) does not count,
    unless it is one of `read`: a field the recorded step read, whose value its replacement
    now takes as an argument."""
    if isinstance(x, dict):
        if "__opaque" in x:
            return str(x["__opaque"])
        if classes is not None and "__dc" in x and isinstance(x.get("f"), dict):
            qualname = str(x["__dc"]).partition(":")[2]
            moved = classes.moved_out.get(qualname, frozenset()) - read
            moved |= set(classes.converted.get(qualname, {})) - read
            fields = [v for k, v in x["f"].items() if k not in moved]
        else:
            fields = list(x.values())
        for v in fields:
            found = has_opaque(v, classes, read)
            if found is not None:
                return found
    elif isinstance(x, list):
        for v in x:
            found = has_opaque(v, classes, read)
            if found is not None:
                return found
    return None


# Modules that moved since a trace was recorded: a class is looked up where it lives now
# (the move changed no behaviour, which is what replaying the trace shows).
MOVED_MODULES = {
    f"elasticpp.agent.{name}": f"elasticpp.agent.{package}.{name}"
    for name, package in {
        "clock": "kernel",
        "limits": "kernel",
        "metrics": "kernel",
        "decide": "kernel",
        "inbox": "kernel",
        "pool": "kernel",
        "worklogs": "kernel",
        "gpuhealth": "supervisor",
        "latest": "durability",
        "deadlines": "leader",
    }.items()
}
# Classes renamed since a trace was recorded (private names made public), by qualname.
RENAMED = {"_GenState": "GenerationProgress", "_Worker": "Worker", "_LeaseKeeper": "LeaseKeeper"}


class Classes:
    """elasticpp's classes by `module:qualname`, and by qualname for a class that moved.
    `moved_out`: fields a state recorded that moved out of it since (into a part's shell),
    by class qualname; decoding leaves them out. `converted`: fields a state recorded that
    became another field since, by class qualname: old name -> (new name, the new value
    from the recorded one, still encoded: a handle is `{"__opaque": ...}`)."""

    def __init__(
        self,
        moved_out: Mapping[str, frozenset[str]] | None = None,
        converted: Mapping[str, Mapping[str, tuple[str, Callable[[Json], Any]]]] | None = None,
    ) -> None:
        self.moved_out = dict(moved_out or {})
        self.converted = {k: dict(v) for k, v in (converted or {}).items()}
        self._by_qualname: dict[str, list[type]] = {}
        for info in pkgutil.walk_packages(elasticpp.__path__, "elasticpp."):
            try:
                module = importlib.import_module(info.name)
            except Exception:  # a module that needs what this machine lacks (CUDA)
                continue
            for _, obj in inspect.getmembers(module, inspect.isclass):
                if obj.__module__ == info.name:
                    self._add(obj)

    def _add(self, cls: type) -> None:
        self._by_qualname.setdefault(cls.__qualname__, []).append(cls)
        for inner in vars(cls).values():
            if isinstance(inner, type) and inner.__qualname__.startswith(cls.__qualname__ + "."):
                self._add(inner)

    def find(self, name: str) -> type:
        module_name, _, qualname = name.partition(":")
        module_name = MOVED_MODULES.get(module_name, module_name)
        qualname = RENAMED.get(qualname, qualname)
        if module_name != "elasticpp" and not module_name.startswith("elasticpp."):
            # A trace names classes; it never names what to import beyond elasticpp's own.
            raise LookupError(f"class {name}: not one of elasticpp's")
        module = sys.modules.get(module_name)
        if module is None:
            try:
                module = importlib.import_module(module_name)
            except ImportError:
                module = None
        if module is not None:
            obj: Any = module
            for part in qualname.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if isinstance(obj, type):
                return obj
        found = self._by_qualname.get(qualname, [])
        if len(found) != 1:
            raise LookupError(f"class {name}: {len(found)} classes of that name in elasticpp")
        return found[0]


def _fields_today(cls: type, recorded: Mapping[str, Json], classes: Classes) -> dict[str, Json]:
    """A dataclass's recorded fields in today's shape: moved-out ones left out, converted
    ones under their new name with their new value, added ones with their default."""
    gone = classes.moved_out.get(cls.__qualname__, frozenset())
    turned = classes.converted.get(cls.__qualname__, {})
    fields: dict[str, Json] = {}
    for k, v in recorded.items():
        if k in gone:
            continue
        if k in turned:
            new, convert = turned[k]
            fields[new] = encode(convert(v))
        else:
            fields[k] = v
    for k, v in _defaults(cls).items():
        fields.setdefault(k, encode(v))  # added since the recording, with its default
    return fields


def decode(x: Json, classes: Classes) -> Any:
    """The value `encode` wrote (see the module)."""
    if isinstance(x, list):
        return [decode(v, classes) for v in x]
    if not isinstance(x, dict):
        return x
    if "__enum" in x:
        return classes.find(x["__enum"])(decode(x["v"], classes))
    if "__float" in x:
        return float(x["__float"])
    if "__dc" in x:
        cls = classes.find(x["__dc"])
        obj = cls.__new__(cls)
        names = {f.name for f in dataclasses.fields(cls)}
        fields = _fields_today(cls, x["f"], classes)
        recorded = set(fields)
        if names != recorded:
            raise LookupError(
                f"{x['__dc']}: fields {sorted(names ^ recorded)} differ from the trace's"
            )
        for k, v in fields.items():
            object.__setattr__(obj, k, decode(v, classes))
        return obj
    if "__nt" in x:
        return classes.find(x["__nt"])(*(decode(v, classes) for v in x["v"]))
    if "__tuple" in x:
        return tuple(decode(v, classes) for v in x["__tuple"])
    if "__set" in x:
        return {decode(v, classes) for v in x["__set"]}
    if "__frozenset" in x:
        return frozenset(decode(v, classes) for v in x["__frozenset"])
    if "__dict" in x:
        return {decode(k, classes): decode(v, classes) for k, v in x["__dict"]}
    if "__deque" in x:
        return collections.deque((decode(v, classes) for v in x["__deque"]), x["maxlen"])
    if "__bytes" in x:
        return bytes.fromhex(x["__bytes"])
    if "__path" in x:
        return Path(x["__path"])
    if "__obj" in x:
        cls = classes.find(x["__obj"])
        obj = cls.__new__(cls)
        for k, v in x["d"].items():
            object.__setattr__(obj, k, decode(v, classes))
        return obj
    if "__opaque" in x:
        raise LookupError(f"an opaque {x['__opaque']} cannot be replayed")
    raise LookupError(f"not a traced value: {sorted(x)}")


@dataclasses.dataclass
class Recorder:
    """Records the calls of the named pure steps (see `instrument`), at most `cap` distinct
    cases a step; a case is distinct by its arguments before the call."""

    cap: int = 400
    cases: dict[str, list[dict[str, Json]]] = dataclasses.field(default_factory=dict)
    errors: list[str] = dataclasses.field(default_factory=list)
    _seen: set[str] = dataclasses.field(default_factory=set)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def traced(*args: Any, **kwargs: Any) -> Any:
            try:
                before = encode({"args": list(args), "kwargs": kwargs})
            except Exception as exc:  # the agent goes on; the walk fails at its end
                self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
                return fn(*args, **kwargs)
            result = fn(*args, **kwargs)
            key = name + _canonical(before)
            kept = self.cases.setdefault(name, [])
            if key not in self._seen and len(kept) < self.cap:
                self._seen.add(key)
                try:
                    after = encode({"args": list(args), "kwargs": kwargs})
                    kept.append({"before": before, "after": after, "result": encode(result)})
                except Exception as exc:
                    self.errors.append(f"{name}: {type(exc).__name__}: {exc}")
            return result

        traced.__wrapped__ = fn  # type: ignore[attr-defined]
        return traced

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps(self.cases, sort_keys=True, allow_nan=False, separators=(",", ":"))
        with gzip.open(path, "wt", encoding="utf-8") as f:
            f.write(text)


def read_cases(path: Path) -> dict[str, list[dict[str, Json]]]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        cases: dict[str, list[dict[str, Json]]] = json.load(f)
    return cases


def instrument(recorder: Recorder, steps: Mapping[str, Callable[..., Any]]) -> Iterator[None]:
    """Patch every binding of each step in elasticpp's loaded modules with `recorder`'s
    wrapper (a step is called through the name it was imported under), for the duration of
    the generator; put the originals back after."""
    patched: list[tuple[Any, str, Any]] = []
    for name, fn in steps.items():
        wrapper = recorder.wrap(name, fn)
        for module in list(sys.modules.values()):
            if module is None or not getattr(module, "__name__", "").startswith("elasticpp."):
                continue
            for attr, value in list(vars(module).items()):
                if value is fn:
                    patched.append((module, attr, value))
                    setattr(module, attr, wrapper)
    try:
        yield
    finally:
        for module, attr, value in patched:
            setattr(module, attr, value)


def replay(case: Mapping[str, Json], fn: Callable[..., Any], classes: Classes) -> tuple[Json, Json]:
    """Call `fn` on a case's recorded arguments: (its arguments after, its result), encoded,
    to compare with `expected(case)`."""
    before = decode(case["before"], classes)
    result = fn(*before["args"], **before["kwargs"])
    return encode(before), encode(result)


def today(x: Json, classes: Classes) -> Json:
    """A recorded value in today's shape: classes named where they live now, and the fields
    that moved out of a state (`Classes.moved_out`) left out, as `decode` leaves them out."""
    if isinstance(x, list):
        return [today(v, classes) for v in x]
    if not isinstance(x, dict):
        return x
    out = {k: today(v, classes) for k, v in x.items()}
    for tag in ("__dc", "__enum", "__nt", "__obj"):
        if tag in x:
            out[tag] = _cls_name(classes.find(str(x[tag])))
    if "__dc" in x:
        cls = classes.find(str(x["__dc"]))
        turned = classes.converted.get(cls.__qualname__, {})
        # A converted field's recorded value (a handle, maybe) is converted as recorded.
        recorded = {k: (x["f"][k] if k in turned else v) for k, v in out["f"].items()}
        out["f"] = _fields_today(cls, recorded, classes)
    return out


def _defaults(cls: type) -> dict[str, Any]:
    """The fields of dataclass `cls` that have a default, with it: a field added after a
    trace was recorded reads as what it defaults to (what the code of the recording did)."""
    out: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            out[f.name] = f.default
        elif f.default_factory is not dataclasses.MISSING:
            out[f.name] = f.default_factory()
    return out


def expected(case: Mapping[str, Json], classes: Classes) -> tuple[Json, Json]:
    """A case's recorded (arguments after, result) in today's shape (`today`)."""
    return today(case["after"], classes), today(case["result"], classes)


def untouched(
    case: Mapping[str, Json], classes: Classes, identity: Mapping[str, str] | None = None
) -> list[str]:
    """The moved-out fields the recorded call changed: a field the step wrote cannot have
    moved out of its state (it must be empty). `identity`: by class qualname, the field
    that tells one object from another (a follower's generation state is another
    generation's when its record differs): an object the step replaced with a new one
    must hold its moved-out fields empty (null)."""
    changed: list[str] = []
    identity = identity or {}

    def walk(before: Json, after: Json) -> None:
        if isinstance(before, dict) and isinstance(after, dict):
            if "__dc" in before and before.get("__dc") == after.get("__dc"):
                qualname = str(before["__dc"]).partition(":")[2]
                key = identity.get(qualname)
                replaced = key is not None and before["f"].get(key) != after["f"].get(key)
                for k in classes.moved_out.get(qualname, frozenset()):
                    if after["f"].get(k) != (None if replaced else before["f"].get(k)):
                        changed.append(f"{qualname}.{k}")
            for k in before.keys() & after.keys():
                walk(before[k], after[k])
        elif isinstance(before, list) and isinstance(after, list):
            for b, a in zip(before, after, strict=False):
                walk(b, a)

    walk(case["before"], case["after"])
    return changed
