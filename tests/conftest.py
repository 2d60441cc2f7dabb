import pytest


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    """One tokenized-text cache for the session (each xdist worker has its own)."""
    return str(tmp_path_factory.mktemp("token_cache"))
