"""Test-wide settings: learned state goes to a temporary folder, never the user's."""

import pytest


@pytest.fixture(autouse=True, scope="session")
def isolated_state_dir(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("MOE_SERVE_STATE_DIR", str(tmp_path_factory.mktemp("state")))
        yield
