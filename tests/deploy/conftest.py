"""The rendered kustomizations, once per session."""

import pytest

from tests.deploy.kube import DEPLOY, OVERLAYS, render


@pytest.fixture(scope="session")
def rendered() -> dict[str, list[dict]]:
    """Overlay name (and "base") -> the objects it renders."""
    result = {name: render(DEPLOY / "overlays" / name) for name in OVERLAYS}
    result["base"] = render(DEPLOY / "base")
    return result
