"""The router's calls to the scheduler leader over gRPC: placement proposals.

The one place the router speaks SchedulerService: it implements the
autoscaler's `PlacementProposer` with domain objects in and out, on one
channel that it keeps while the leader's address stays the same.
"""

import grpc

from moe.scheduler.v1 import scheduler_pb2, scheduler_pb2_grpc
from router_svc.autoscaler import Committed, Proposal, ProposalError
from services import grpc_util


class SchedulerClient:
    """Proposes placements to the scheduler leader; each call bounded by deadline_s."""

    def __init__(self, deadline_s: float):
        if deadline_s <= 0:
            raise ValueError(f"deadline_s must be positive, got {deadline_s}")
        self._deadline_s = deadline_s
        self._stubs = grpc_util.LastAddressStub(scheduler_pb2_grpc.SchedulerServiceStub, "scheduler")

    async def propose(self, address: str, proposal: Proposal) -> Committed:
        """ProposePlacement to the leader at address; ProposalError if it did not commit."""
        stub = await self._stubs.to(address)
        placement = proposal.placement
        request = scheduler_pb2.ProposePlacementRequest(
            group_id=proposal.group_id, expected_epoch=proposal.expected_epoch, term=proposal.term,
            num_experts=placement.num_experts, num_ranks=placement.num_ranks,
            num_spare_slots=placement.num_spare_slots,
            layers=[scheduler_pb2.LayerPlacement(layer=layer, spare_experts=spares)
                    for layer, spares in sorted(placement.layers.items())])
        try:
            response = await stub.ProposePlacement(request, timeout=self._deadline_s)
        except grpc.aio.AioRpcError as error:
            raise ProposalError(f"{error.code().name}: {error.details()}") from error
        return Committed(epoch=response.epoch, term=response.term)

    async def close(self) -> None:
        """Closes the channel (a later proposal opens a new one)."""
        await self._stubs.close()
