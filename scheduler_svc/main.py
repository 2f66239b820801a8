"""Entry point of a scheduler replica: python -m scheduler_svc.main --member-id s0 ...

Parses the flags and the environment (services.settings) and runs the
replica (scheduler_svc/server.py) until SIGTERM or SIGINT.
"""

import sys

from scheduler_svc.config import SchedulerConfig
from scheduler_svc.server import ROLE, serve
from services import process


def main(argv: list[str] | None = None) -> None:
    process.run_role(ROLE, SchedulerConfig, serve, argv, prog="python -m scheduler_svc.main")


if __name__ == "__main__":
    main(sys.argv[1:])
