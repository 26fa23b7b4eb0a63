import pytest

from adaflash.telemetry import reset_telemetry


@pytest.fixture(autouse=True)
def _clean_telemetry():
    reset_telemetry()
    yield
    reset_telemetry()
