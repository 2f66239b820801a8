"""The gateway's live requests by request id: what the Abort call finds.

Request ids are the clients' (or generated, gateway/validation.py) and need
not be unique: clients reuse them, and refusing a second live request with
the same id would break those that do. So an id maps to every live request
that has it, and `abort` ends them all. An entry lives from the submit to the
end of its Generate call (the servicer adds and removes it); a request that
has already finished is not live, even while its stream is still being read.
Each request is kept with the engine it was submitted to: `Engine.abort`
follows it to the engine of a re-formed group that adopted it.

With API keys, each request also keeps its owner, the name of the key that sent
it, and Abort from a key ends only that key's requests: another client's id is
"not found", so ids cannot be probed or another client's work ended. Without
keys every owner is None and Abort ends any request with the id, as before.
"""

from gateway.engine import Engine
from gateway.requests import RequestHandle


class LiveRequests:
    """request_id -> the (engine, handle) of every live request with that id."""

    def __init__(self) -> None:
        self._by_id: dict[str, list[tuple[Engine, RequestHandle, str | None]]] = {}

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._by_id.values())

    def add(self, request_id: str, engine: Engine, handle: RequestHandle, owner: str | None = None) -> None:
        """Registers a request just submitted to engine by owner (a key's name; None without keys)."""
        self._by_id.setdefault(request_id, []).append((engine, handle, owner))

    def remove(self, request_id: str, handle: RequestHandle) -> None:
        """Forgets a request (its Generate call ended); a no-op for one not registered."""
        entries = [e for e in self._by_id.get(request_id, ()) if e[1] is not handle]
        if entries:
            self._by_id[request_id] = entries
        else:
            self._by_id.pop(request_id, None)

    def abort(self, request_id: str, owner: str | None = None) -> int:
        """Aborts every live request with the id that owner sent; returns how many there were
        (0: none). Each ends with an ABORT output, and its blocks are freed at its engine's next step."""
        live = [(engine, handle) for engine, handle, sender in self._by_id.get(request_id, ())
                if not handle.is_done and sender == owner]
        for engine, handle in live:
            engine.abort(handle)
        return len(live)
