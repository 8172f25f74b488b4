from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class GetStatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("rank", "local_rank", "pp", "tp", "dp", "pid", "state", "last_step")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    PP_FIELD_NUMBER: _ClassVar[int]
    TP_FIELD_NUMBER: _ClassVar[int]
    DP_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    pp: int
    tp: int
    dp: int
    pid: int
    state: str
    last_step: int
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., pp: _Optional[int] = ..., tp: _Optional[int] = ..., dp: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[str] = ..., last_step: _Optional[int] = ...) -> None: ...

class Recovery(_message.Message):
    __slots__ = ("generation", "reason", "layout_before", "layout_after", "resume_step", "steps_recomputed", "planned_s", "stopped_s", "moved_s", "resumed_s")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_AFTER_FIELD_NUMBER: _ClassVar[int]
    RESUME_STEP_FIELD_NUMBER: _ClassVar[int]
    STEPS_RECOMPUTED_FIELD_NUMBER: _ClassVar[int]
    PLANNED_S_FIELD_NUMBER: _ClassVar[int]
    STOPPED_S_FIELD_NUMBER: _ClassVar[int]
    MOVED_S_FIELD_NUMBER: _ClassVar[int]
    RESUMED_S_FIELD_NUMBER: _ClassVar[int]
    generation: int
    reason: str
    layout_before: str
    layout_after: str
    resume_step: int
    steps_recomputed: int
    planned_s: float
    stopped_s: float
    moved_s: float
    resumed_s: float
    def __init__(self, generation: _Optional[int] = ..., reason: _Optional[str] = ..., layout_before: _Optional[str] = ..., layout_after: _Optional[str] = ..., resume_step: _Optional[int] = ..., steps_recomputed: _Optional[int] = ..., planned_s: _Optional[float] = ..., stopped_s: _Optional[float] = ..., moved_s: _Optional[float] = ..., resumed_s: _Optional[float] = ...) -> None: ...

class QuarantinedNode(_message.Message):
    __slots__ = ("node_id", "reason", "until", "count")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    UNTIL_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    reason: str
    until: float
    count: int
    def __init__(self, node_id: _Optional[str] = ..., reason: _Optional[str] = ..., until: _Optional[float] = ..., count: _Optional[int] = ...) -> None: ...

class GetStatusResponse(_message.Message):
    __slots__ = ("node_id", "job", "generation", "leader", "phase", "layout", "last_step", "last_loss", "workers", "recoveries", "members", "quarantined", "ended", "waiting")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    RECOVERIES_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    WAITING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    job: str
    generation: int
    leader: str
    phase: str
    layout: str
    last_step: int
    last_loss: float
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    recoveries: _containers.RepeatedCompositeFieldContainer[Recovery]
    members: _containers.RepeatedScalarFieldContainer[str]
    quarantined: _containers.RepeatedCompositeFieldContainer[QuarantinedNode]
    ended: str
    waiting: str
    def __init__(self, node_id: _Optional[str] = ..., job: _Optional[str] = ..., generation: _Optional[int] = ..., leader: _Optional[str] = ..., phase: _Optional[str] = ..., layout: _Optional[str] = ..., last_step: _Optional[int] = ..., last_loss: _Optional[float] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., recoveries: _Optional[_Iterable[_Union[Recovery, _Mapping]]] = ..., members: _Optional[_Iterable[str]] = ..., quarantined: _Optional[_Iterable[_Union[QuarantinedNode, _Mapping]]] = ..., ended: _Optional[str] = ..., waiting: _Optional[str] = ...) -> None: ...

class LiftQuarantineRequest(_message.Message):
    __slots__ = ("node_id",)
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    def __init__(self, node_id: _Optional[str] = ...) -> None: ...

class LiftQuarantineResponse(_message.Message):
    __slots__ = ("lifted", "message")
    LIFTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    lifted: bool
    message: str
    def __init__(self, lifted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("timeout_s",)
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    timeout_s: float
    def __init__(self, timeout_s: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("accepted", "message")
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    message: str
    def __init__(self, accepted: _Optional[bool] = ..., message: _Optional[str] = ...) -> None: ...

class WatchEventsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class AgentEvent(_message.Message):
    __slots__ = ("time", "kind", "message", "generation")
    TIME_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    time: float
    kind: str
    message: str
    generation: int
    def __init__(self, time: _Optional[float] = ..., kind: _Optional[str] = ..., message: _Optional[str] = ..., generation: _Optional[int] = ...) -> None: ...
