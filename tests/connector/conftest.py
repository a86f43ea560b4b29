"""Fixtures the connector tests share: a P and D engine pair, closed after the test."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.connector.pd_pair import Pair


@pytest.fixture
def pair() -> Iterator[Pair]:
    pd = Pair()
    try:
        yield pd
    finally:
        pd.close()
