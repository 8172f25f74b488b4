from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ListStepsRequest(_message.Message):
    __slots__ = ("generation", "epoch")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    generation: int
    epoch: int
    def __init__(self, generation: _Optional[int] = ..., epoch: _Optional[int] = ...) -> None: ...

class PieceInfo(_message.Message):
    __slots__ = ("name", "size", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    size: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class StepHolding(_message.Message):
    __slots__ = ("origin_node", "step", "pieces", "units", "generation", "epoch", "piece_count")
    ORIGIN_NODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    PIECES_FIELD_NUMBER: _ClassVar[int]
    UNITS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    PIECE_COUNT_FIELD_NUMBER: _ClassVar[int]
    origin_node: str
    step: int
    pieces: _containers.RepeatedCompositeFieldContainer[PieceInfo]
    units: _containers.RepeatedScalarFieldContainer[str]
    generation: int
    epoch: int
    piece_count: int
    def __init__(self, origin_node: _Optional[str] = ..., step: _Optional[int] = ..., pieces: _Optional[_Iterable[_Union[PieceInfo, _Mapping]]] = ..., units: _Optional[_Iterable[str]] = ..., generation: _Optional[int] = ..., epoch: _Optional[int] = ..., piece_count: _Optional[int] = ...) -> None: ...

class ListStepsResponse(_message.Message):
    __slots__ = ("node_id", "generation", "steps")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generation: int
    steps: _containers.RepeatedCompositeFieldContainer[StepHolding]
    def __init__(self, node_id: _Optional[str] = ..., generation: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepHolding, _Mapping]]] = ...) -> None: ...

class ListHoldingsRequest(_message.Message):
    __slots__ = ("generation", "epoch", "steps", "page_token", "page_pieces")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PAGE_PIECES_FIELD_NUMBER: _ClassVar[int]
    generation: int
    epoch: int
    steps: _containers.RepeatedScalarFieldContainer[int]
    page_token: str
    page_pieces: int
    def __init__(self, generation: _Optional[int] = ..., epoch: _Optional[int] = ..., steps: _Optional[_Iterable[int]] = ..., page_token: _Optional[str] = ..., page_pieces: _Optional[int] = ...) -> None: ...

class ListHoldingsResponse(_message.Message):
    __slots__ = ("node_id", "generation", "steps", "next_page_token")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEPS_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    generation: int
    steps: _containers.RepeatedCompositeFieldContainer[StepHolding]
    next_page_token: str
    def __init__(self, node_id: _Optional[str] = ..., generation: _Optional[int] = ..., steps: _Optional[_Iterable[_Union[StepHolding, _Mapping]]] = ..., next_page_token: _Optional[str] = ...) -> None: ...

class FetchPieceRequest(_message.Message):
    __slots__ = ("generation", "step", "name", "origin_node", "offset", "epoch", "verify")
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_NODE_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    generation: int
    step: int
    name: str
    origin_node: str
    offset: int
    epoch: int
    verify: bool
    def __init__(self, generation: _Optional[int] = ..., step: _Optional[int] = ..., name: _Optional[str] = ..., origin_node: _Optional[str] = ..., offset: _Optional[int] = ..., epoch: _Optional[int] = ..., verify: _Optional[bool] = ...) -> None: ...

class FetchPieceResponse(_message.Message):
    __slots__ = ("offset", "data", "total_size", "sha256")
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    TOTAL_SIZE_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    offset: int
    data: bytes
    total_size: int
    sha256: str
    def __init__(self, offset: _Optional[int] = ..., data: _Optional[bytes] = ..., total_size: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...
