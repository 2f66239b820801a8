from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LayerHits(_message.Message):
    __slots__ = ("layer", "counts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ...) -> None: ...

class ReportExpertHitsRequest(_message.Message):
    __slots__ = ("group_id", "rank", "first_step_id", "last_step_id", "layers")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    rank: int
    first_step_id: int
    last_step_id: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerHits]
    def __init__(self, group_id: _Optional[str] = ..., rank: _Optional[int] = ..., first_step_id: _Optional[int] = ..., last_step_id: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerHits, _Mapping]]] = ...) -> None: ...

class ReportExpertHitsResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetExpertStatsRequest(_message.Message):
    __slots__ = ("group_id", "window_s")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WINDOW_S_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    window_s: float
    def __init__(self, group_id: _Optional[str] = ..., window_s: _Optional[float] = ...) -> None: ...

class LayerStats(_message.Message):
    __slots__ = ("layer", "counts", "hit_rates", "rank_loads", "rank_load_imbalance")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    HIT_RATES_FIELD_NUMBER: _ClassVar[int]
    RANK_LOADS_FIELD_NUMBER: _ClassVar[int]
    RANK_LOAD_IMBALANCE_FIELD_NUMBER: _ClassVar[int]
    layer: int
    counts: _containers.RepeatedScalarFieldContainer[int]
    hit_rates: _containers.RepeatedScalarFieldContainer[float]
    rank_loads: _containers.RepeatedScalarFieldContainer[float]
    rank_load_imbalance: float
    def __init__(self, layer: _Optional[int] = ..., counts: _Optional[_Iterable[int]] = ..., hit_rates: _Optional[_Iterable[float]] = ..., rank_loads: _Optional[_Iterable[float]] = ..., rank_load_imbalance: _Optional[float] = ...) -> None: ...

class GetExpertStatsResponse(_message.Message):
    __slots__ = ("layers", "num_reports")
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    NUM_REPORTS_FIELD_NUMBER: _ClassVar[int]
    layers: _containers.RepeatedCompositeFieldContainer[LayerStats]
    num_reports: int
    def __init__(self, layers: _Optional[_Iterable[_Union[LayerStats, _Mapping]]] = ..., num_reports: _Optional[int] = ...) -> None: ...
