import pytest

from tests import report_sections


@pytest.fixture
def history() -> list[dict]:
    return report_sections.history()


@pytest.fixture
def cpu_probe() -> dict:
    return report_sections.cpu_probe()


@pytest.fixture
def gpu_probe() -> dict:
    return report_sections.gpu_probe()
