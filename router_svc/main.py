"""Entry point of the router service: python -m router_svc.main --member-id r0 ...

Parses the flags and the environment (services.settings) and runs the
router (router_svc/server.py) until SIGTERM or SIGINT.
"""

import sys

from router_svc.config import RouterConfig
from router_svc.server import ROLE, serve
from services import process


def main(argv: list[str] | None = None) -> None:
    process.run_role(ROLE, RouterConfig, serve, argv, prog="python -m router_svc.main")


if __name__ == "__main__":
    main(sys.argv[1:])
