"""The gateway process: `python -m gateway.main --member-id gw0 --model DIR --etcd HOST:PORT`.

Flags and env (MOEMESH_*) only; see gateway/config.py for every field and
gateway/server.py for what the process does until SIGTERM or SIGINT drains it.
"""

import sys

from gateway.config import GatewayConfig
from gateway.server import ROLE, serve
from services import process


def main(argv: list[str] | None = None) -> None:
    """Runs the gateway until SIGTERM or SIGINT."""
    process.run_role(ROLE, GatewayConfig, serve, argv, prog="python -m gateway.main")


if __name__ == "__main__":
    main(sys.argv[1:])
