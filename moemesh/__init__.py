"""The moemesh tooling on top of the mesh: the Python client, the `moemesh` command, the launcher, etcd, stubs.

It may import the library (`services`), the protos and start the roles as
processes; no role and no library module imports it.

The Python client (`moemesh.Client`, `moemesh.AsyncClient`, their values and
errors) and the LLM programs (`moemesh.function`, `gen`, `select`, `bind`,
the chat roles, `Runtime`; moemesh/program/) are exported here, loaded on first use: `import moemesh` alone loads
nothing, so the launcher and stub generation (which must run while the
generated stubs are stale) do not depend on the stubs, and the client itself
pulls in gRPC, protobuf and OpenTelemetry's API, never torch.
"""

import importlib
from typing import TYPE_CHECKING

# Exported name -> the module that defines it.
_EXPORTS = {
    "Client": "moemesh.client",
    "AsyncClient": "moemesh.async_client",
    "RetryPolicy": "moemesh.client_retry",
    **{name: "moemesh.client_types" for name in (
        "Chunk", "GenerateResult", "ModelInfo", "Sample", "TokenLogprob", "TopLogprob", "Usage")},
    **{name: "moemesh.client_errors" for name in (
        "MoemeshError", "InvalidArgumentError", "NotFoundError", "UnavailableError", "DeadlineExceededError",
        "ResourceExhaustedError", "CancelledError")},
    # LLM programs (moemesh/program/).
    **{name: "moemesh.program.lang" for name in (
        "function", "gen", "select", "bind", "system", "user", "assistant", "Program", "ProgramError")},
    **{name: "moemesh.program.state" for name in ("State", "Ref", "NodeOutput")},
    "Runtime": "moemesh.program.runtime",
}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:
    from moemesh.async_client import AsyncClient
    from moemesh.client import Client
    from moemesh.client_errors import (CancelledError, DeadlineExceededError, InvalidArgumentError, MoemeshError,
                                       NotFoundError, ResourceExhaustedError, UnavailableError)
    from moemesh.client_retry import RetryPolicy
    from moemesh.client_types import Chunk, GenerateResult, ModelInfo, Sample, TokenLogprob, TopLogprob, Usage
    from moemesh.program.lang import (Program, ProgramError, assistant, bind, function, gen, select, system,
                                      user)
    from moemesh.program.runtime import Runtime
    from moemesh.program.state import NodeOutput, Ref, State


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'moemesh' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
