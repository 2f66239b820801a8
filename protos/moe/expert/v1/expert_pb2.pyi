from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ConstraintKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CONSTRAINT_KIND_UNSPECIFIED: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_SCHEMA: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_JSON_OBJECT: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_REGEX: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_GRAMMAR: _ClassVar[ConstraintKind]
    CONSTRAINT_KIND_CHOICE: _ClassVar[ConstraintKind]
CONSTRAINT_KIND_UNSPECIFIED: ConstraintKind
CONSTRAINT_KIND_JSON_SCHEMA: ConstraintKind
CONSTRAINT_KIND_JSON_OBJECT: ConstraintKind
CONSTRAINT_KIND_REGEX: ConstraintKind
CONSTRAINT_KIND_GRAMMAR: ConstraintKind
CONSTRAINT_KIND_CHOICE: ConstraintKind

class SequenceSampling(_message.Message):
    __slots__ = ("temperature", "top_p", "top_k", "seed")
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    temperature: float
    top_p: float
    top_k: int
    seed: int
    def __init__(self, temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., seed: _Optional[int] = ...) -> None: ...

class SequenceConstraint(_message.Message):
    __slots__ = ("kind", "text", "options")
    KIND_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    OPTIONS_FIELD_NUMBER: _ClassVar[int]
    kind: ConstraintKind
    text: str
    options: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[_Union[ConstraintKind, str]] = ..., text: _Optional[str] = ..., options: _Optional[_Iterable[str]] = ...) -> None: ...

class NewSequence(_message.Message):
    __slots__ = ("seq_id", "sampling", "block_ids", "num_cached_tokens", "traceparent", "constraint", "constraint_output_ids", "logprobs", "top_logprobs", "prompt_logprobs", "jump_forward")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRACEPARENT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_FIELD_NUMBER: _ClassVar[int]
    CONSTRAINT_OUTPUT_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    JUMP_FORWARD_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    sampling: SequenceSampling
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_cached_tokens: int
    traceparent: str
    constraint: SequenceConstraint
    constraint_output_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: bool
    top_logprobs: int
    prompt_logprobs: bool
    jump_forward: bool
    def __init__(self, seq_id: _Optional[int] = ..., sampling: _Optional[_Union[SequenceSampling, _Mapping]] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_cached_tokens: _Optional[int] = ..., traceparent: _Optional[str] = ..., constraint: _Optional[_Union[SequenceConstraint, _Mapping]] = ..., constraint_output_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[bool] = ..., jump_forward: _Optional[bool] = ...) -> None: ...

class ScheduledSequence(_message.Message):
    __slots__ = ("seq_id", "token_ids", "new_block_ids", "is_sampled", "num_forced")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    NEW_BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    IS_SAMPLED_FIELD_NUMBER: _ClassVar[int]
    NUM_FORCED_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    new_block_ids: _containers.RepeatedScalarFieldContainer[int]
    is_sampled: bool
    num_forced: int
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., new_block_ids: _Optional[_Iterable[int]] = ..., is_sampled: _Optional[bool] = ..., num_forced: _Optional[int] = ...) -> None: ...

class StepPlan(_message.Message):
    __slots__ = ("step_id", "group_id", "placement_epoch", "new_sequences", "scheduled", "finished_seq_ids", "max_tokens_per_rank", "expert_placement_epoch", "block_copies")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    NEW_SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    SCHEDULED_FIELD_NUMBER: _ClassVar[int]
    FINISHED_SEQ_IDS_FIELD_NUMBER: _ClassVar[int]
    MAX_TOKENS_PER_RANK_FIELD_NUMBER: _ClassVar[int]
    EXPERT_PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COPIES_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    group_id: str
    placement_epoch: int
    new_sequences: _containers.RepeatedCompositeFieldContainer[NewSequence]
    scheduled: _containers.RepeatedCompositeFieldContainer[ScheduledSequence]
    finished_seq_ids: _containers.RepeatedScalarFieldContainer[int]
    max_tokens_per_rank: int
    expert_placement_epoch: int
    block_copies: _containers.RepeatedCompositeFieldContainer[BlockCopy]
    def __init__(self, step_id: _Optional[int] = ..., group_id: _Optional[str] = ..., placement_epoch: _Optional[int] = ..., new_sequences: _Optional[_Iterable[_Union[NewSequence, _Mapping]]] = ..., scheduled: _Optional[_Iterable[_Union[ScheduledSequence, _Mapping]]] = ..., finished_seq_ids: _Optional[_Iterable[int]] = ..., max_tokens_per_rank: _Optional[int] = ..., expert_placement_epoch: _Optional[int] = ..., block_copies: _Optional[_Iterable[_Union[BlockCopy, _Mapping]]] = ...) -> None: ...

class BlockCopy(_message.Message):
    __slots__ = ("source", "destination")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_FIELD_NUMBER: _ClassVar[int]
    source: int
    destination: int
    def __init__(self, source: _Optional[int] = ..., destination: _Optional[int] = ...) -> None: ...

class SampledToken(_message.Message):
    __slots__ = ("seq_id", "token_id")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_id: int
    def __init__(self, seq_id: _Optional[int] = ..., token_id: _Optional[int] = ...) -> None: ...

class StepResult(_message.Message):
    __slots__ = ("step_id", "tokens", "execute_seconds", "logprobs", "forced")
    STEP_ID_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    EXECUTE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FORCED_FIELD_NUMBER: _ClassVar[int]
    step_id: int
    tokens: _containers.RepeatedCompositeFieldContainer[SampledToken]
    execute_seconds: float
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprob]
    forced: _containers.RepeatedCompositeFieldContainer[ForcedTokens]
    def __init__(self, step_id: _Optional[int] = ..., tokens: _Optional[_Iterable[_Union[SampledToken, _Mapping]]] = ..., execute_seconds: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprob, _Mapping]]] = ..., forced: _Optional[_Iterable[_Union[ForcedTokens, _Mapping]]] = ...) -> None: ...

class PositionLogprob(_message.Message):
    __slots__ = ("seq_id", "position", "token_id", "logprob", "top_token_ids", "top_logprobs")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    POSITION_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    TOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    position: int
    token_id: int
    logprob: float
    top_token_ids: _containers.RepeatedScalarFieldContainer[int]
    top_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, seq_id: _Optional[int] = ..., position: _Optional[int] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., top_token_ids: _Optional[_Iterable[int]] = ..., top_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ForcedTokens(_message.Message):
    __slots__ = ("seq_id", "token_ids")
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    seq_id: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, seq_id: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ...) -> None: ...

class ExecuteStepsRequest(_message.Message):
    __slots__ = ("plan",)
    PLAN_FIELD_NUMBER: _ClassVar[int]
    plan: StepPlan
    def __init__(self, plan: _Optional[_Union[StepPlan, _Mapping]] = ...) -> None: ...

class ExecuteStepsResponse(_message.Message):
    __slots__ = ("result",)
    RESULT_FIELD_NUMBER: _ClassVar[int]
    result: StepResult
    def __init__(self, result: _Optional[_Union[StepResult, _Mapping]] = ...) -> None: ...

class GetRankInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetRankInfoResponse(_message.Message):
    __slots__ = ("member_id", "group_id", "rank", "world_size", "placement_epoch", "expert_ids", "num_kv_blocks", "kv_block_size", "is_ready", "model_name")
    MEMBER_ID_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    PLACEMENT_EPOCH_FIELD_NUMBER: _ClassVar[int]
    EXPERT_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_KV_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    IS_READY_FIELD_NUMBER: _ClassVar[int]
    MODEL_NAME_FIELD_NUMBER: _ClassVar[int]
    member_id: str
    group_id: str
    rank: int
    world_size: int
    placement_epoch: int
    expert_ids: _containers.RepeatedScalarFieldContainer[int]
    num_kv_blocks: int
    kv_block_size: int
    is_ready: bool
    model_name: str
    def __init__(self, member_id: _Optional[str] = ..., group_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., placement_epoch: _Optional[int] = ..., expert_ids: _Optional[_Iterable[int]] = ..., num_kv_blocks: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., is_ready: _Optional[bool] = ..., model_name: _Optional[str] = ...) -> None: ...
