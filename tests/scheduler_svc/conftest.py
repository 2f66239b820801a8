"""A real etcd per test module, on free loopback ports in a temporary dir."""

import pytest

from moemesh.etcd import start_etcd


@pytest.fixture(scope="module")
def etcd(tmp_path_factory):
    with start_etcd(tmp_path_factory.mktemp("etcd")) as running:
        yield running


@pytest.fixture
def key_prefix(request) -> str:
    """A key prefix of its own per test, so tests sharing one etcd do not meet."""
    return f"/test/{request.node.name.replace('[', '_').replace(']', '')}"
