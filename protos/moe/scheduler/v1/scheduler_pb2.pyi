from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class MemberRole(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMBER_ROLE_UNSPECIFIED: _ClassVar[MemberRole]
    MEMBER_ROLE_SCHEDULER: _ClassVar[MemberRole]
    MEMBER_ROLE_GATEWAY: _ClassVar[MemberRole]
    MEMBER_ROLE_EXPERT: _ClassVar[MemberRole]
    MEMBER_ROLE_ROUTER: _ClassVar[MemberRole]
MEMBER_ROLE_UNSPECIFIED: MemberRole
MEMBER_ROLE_SCHEDULER: MemberRole
MEMBER_ROLE_GATEWAY: MemberRole
MEMBER_ROLE_EXPERT: MemberRole
MEMBER_ROLE_ROUTER: MemberRole

class LayerPlacement(_message.Message):
    __slots__ = ("layer", "spare_experts")
    LAYER_FIELD_NUMBER: _ClassVar[int]
    SPARE_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    layer: int
    spare_experts: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, layer: _Optional[int] = ..., spare_experts: _Optional[_Iterable[int]] = ...) -> None: ...

class ProposePlacementRequest(_message.Message):
    __slots__ = ("group_id", "expected_epoch", "term", "num_experts", "num_ranks", "num_spare_slots", "layers")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    EXPECTED_EPOCH_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    NUM_EXPERTS_FIELD_NUMBER: _ClassVar[int]
    NUM_RANKS_FIELD_NUMBER: _ClassVar[int]
    NUM_SPARE_SLOTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    expected_epoch: int
    term: int
    num_experts: int
    num_ranks: int
    num_spare_slots: int
    layers: _containers.RepeatedCompositeFieldContainer[LayerPlacement]
    def __init__(self, group_id: _Optional[str] = ..., expected_epoch: _Optional[int] = ..., term: _Optional[int] = ..., num_experts: _Optional[int] = ..., num_ranks: _Optional[int] = ..., num_spare_slots: _Optional[int] = ..., layers: _Optional[_Iterable[_Union[LayerPlacement, _Mapping]]] = ...) -> None: ...

class ProposePlacementResponse(_message.Message):
    __slots__ = ("epoch", "term")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    term: int
    def __init__(self, epoch: _Optional[int] = ..., term: _Optional[int] = ...) -> None: ...

class Member(_message.Message):
    __slots__ = ("member_id", "role", "address")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    role: MemberRole
    address: str
    def __init__(self, member_id: _Optional[str] = ..., role: _Optional[_Union[MemberRole, str]] = ..., address: _Optional[str] = ...) -> None: ...

class Leader(_message.Message):
    __slots__ = ("member_id", "address", "term", "elected_at_unix")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    ELECTED_AT_UNIX_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    address: str
    term: int
    elected_at_unix: float
    def __init__(self, member_id: _Optional[str] = ..., address: _Optional[str] = ..., term: _Optional[int] = ..., elected_at_unix: _Optional[float] = ...) -> None: ...

class RankAssignment(_message.Message):
    __slots__ = ("rank", "member_id", "address", "is_ready")
    RANK_FIELD_NUMBER: _ClassVar[int]
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    rank: int
    member_id: str
    address: str
    is_ready: bool
    def __init__(self, rank: _Optional[int] = ..., member_id: _Optional[str] = ..., address: _Optional[str] = ..., is_ready: _Optional[bool] = ...) -> None: ...

class WorkerGroup(_message.Message):
    __slots__ = ("group_id", "placement_epoch", "ranks", "rendezvous_address", "gateway_id", "term")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    RENDEZVOUS_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_ID_FIELD_NUMBER: _ClassVar[int]
    TERM_FIELD_NUMBER: _ClassVar[int]
    group_id: str
    placement_epoch: int
    ranks: _containers.RepeatedCompositeFieldContainer[RankAssignment]
    rendezvous_address: str
    gateway_id: str
    term: int
    def __init__(self, group_id: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., ranks: _Optional[_Iterable[_Union[RankAssignment, _Mapping]]] = ..., rendezvous_address: _Optional[str] = ..., gateway_id: _Optional[str] = ..., term: _Optional[int] = ...) -> None: ...

class GetClusterStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetClusterStateResponse(_message.Message):
    __slots__ = ("replica_id", "is_leader", "leader", "members", "groups")
    REPLICA_ID_FIELD_NUMBER: _ClassVar[int]
    IS_LEADER_FIELD_NUMBER: _ClassVar[int]
    LEADER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    replica_id: str
    is_leader: bool
    leader: Leader
    members: _containers.RepeatedCompositeFieldContainer[Member]
    groups: _containers.RepeatedCompositeFieldContainer[WorkerGroup]
    def __init__(self, replica_id: _Optional[str] = ..., is_leader: _Optional[bool] = ..., leader: _Optional[_Union[Leader, _Mapping]] = ..., members: _Optional[_Iterable[_Union[Member, _Mapping]]] = ..., groups: _Optional[_Iterable[_Union[WorkerGroup, _Mapping]]] = ...) -> None: ...
