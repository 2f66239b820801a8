"""`python -m expert_svc.main --member-id e0 --model DIR --etcd HOST:PORT [--port 0 --port-file F]`

Flags and env (MOEMESH_*) only; see expert_svc/config.py for every field.
SIGTERM or SIGINT stops gracefully: NOT_SERVING, deregister, drain, leave the
process group. Exit status: 0 after a stop, 1 if the rank could not start or
join its group, 3 if its group assignment was lost (restart it clean).
"""

import asyncio
import logging
import os
import sys

from expert_svc.config import ExpertConfig
from expert_svc.rank import ExpertRank
from services.settings import configure_logging, parse_config, stop_on_signals


async def _serve(config: ExpertConfig) -> tuple[int, bool]:
    stop = stop_on_signals()
    rank = ExpertRank(config)
    try:
        await rank.start()
        code = await rank.run(stop)
    finally:
        is_clean = await rank.stop()
    return code, is_clean


def main(argv: list[str] | None = None) -> int:
    """Runs one expert service; returns its exit status."""
    config = parse_config(ExpertConfig, argv, prog="expert_svc")
    configure_logging("expert", config)
    code, is_clean = asyncio.run(_serve(config))
    if not is_clean:
        # The model thread is stuck in a collective: do not wait for it at exit.
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
