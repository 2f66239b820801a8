"""The mesh's control-plane state in etcd, as one client per process.

Modules, each layer built on the one before:
- records: the records (members, groups, leader) and the key layout;
- connection: bounded etcd calls, retries and change-only watches;
- session: registration under a lease kept alive, lost and resumed;
- leadership: `/leader`: campaign, fence, one-transaction handover, depose;
- groups: worker group records, ready keys and failure reports;
- client: ClusterClient, all of the above plus snapshots and the member list.
"""

from services.cluster.client import ClusterClient, registered
from services.cluster.connection import ClusterUnavailableError, cancel_and_wait
from services.cluster.records import ROLES, ClusterSnapshot, GroupAssignment, Keys, LeaderInfo, Member, RankInfo
from services.cluster.session import Session

__all__ = ["ROLES", "ClusterClient", "ClusterSnapshot", "ClusterUnavailableError", "GroupAssignment", "Keys",
           "LeaderInfo", "Member", "RankInfo", "Session", "cancel_and_wait", "registered"]
