"""Pieces of the scripts that the rendezvous tests run as processes of their own (one gloo rank each:
the default process group is per process)."""

# A script's last lines: its link (`link`) joins epoch 2 alone at `next_port`, an all-reduce works there,
# and the script prints its `outcome` dict, with the sum, as its last line of JSON. Needs json, torch,
# torch.distributed as dist, GroupAssignment and RankInfo imported.
NEXT_EPOCH_ALONE = r"""
link.connect(GroupAssignment("g0", 2, 1, 1, f"127.0.0.1:{next_port}", [RankInfo(0, "e0", "a")], None), 0)
total = torch.ones(2)
dist.all_reduce(total)
outcome["next_epoch_sum"] = total.tolist()
link.close()
print(json.dumps(outcome), flush=True)
"""
