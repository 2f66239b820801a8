"""`python -m expert_svc.main --member-id e0 --model DIR --etcd HOST:PORT [--port 0 --port-file F]`

Flags and env (MOEMESH_*) only; see expert_svc/config.py for every field.
SIGTERM or SIGINT stops gracefully: NOT_SERVING, deregister, drain, leave the
process group. Exit status: 0 after a stop, 1 if the rank could not start or
join its group (e.g. a group size that does not divide the model's experts),
3 if its group assignment was lost (restart it clean), 4 if a step failed (a
collective timed out or errored; reported under /failures/ in etcd first).
"""

import asyncio
import logging
import os
import sys

from expert_svc.config import ExpertConfig
from expert_svc.server import serve
from services import telemetry
from services.process import configure_telemetry, configure_tls, exit_unreachable
from services.settings import parse_config


def main(argv: list[str] | None = None) -> int:
    """Runs one expert service; returns its exit status."""
    config = parse_config(ExpertConfig, argv, prog="expert_svc")
    configure_telemetry("expert", config)
    configure_tls("expert", config)
    try:
        with exit_unreachable("expert"):
            code, is_clean = asyncio.run(serve(config))
    finally:
        telemetry.shutdown_tracing()
    if not is_clean:
        # The model thread is stuck in a collective: do not wait for it at exit.
        logging.shutdown()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
