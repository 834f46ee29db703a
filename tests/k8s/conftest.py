"""Every `kmock` fixture in tests/k8s is `apiserver.ApiServer`: resource versions, PUT, preconditions."""

from __future__ import annotations

from typing import Any

import pytest
from apiserver import ApiServer


@pytest.fixture()
def kmock_options(kmock_options: dict[str, Any]) -> dict[str, Any]:
    return {**kmock_options, "cls": ApiServer}
