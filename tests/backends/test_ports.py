"""Rendezvous ports: free, distinct, and outside the range outgoing connections take theirs from."""

from __future__ import annotations

import socket

import pytest

from kvflow.backends import ports


def _listens(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", port))
        s.listen()
        return True


def test_ports_come_from_below_the_ephemeral_range_and_are_never_given_twice() -> None:
    """Where the kernel names its ephemeral range, ports are picked below it (an outgoing
    connection cannot take one before its listener binds it); a listener can bind each; 200
    calls give 200 different ports."""
    low = ports._ephemeral_low()
    got = [ports.free_port() for _ in range(200)]
    assert len(set(got)) == len(got)
    if low is not None:
        assert all(10_000 <= p < low for p in got)
    assert all(_listens(p) for p in got[:5])


def test_without_a_known_range_the_kernel_picks_and_ports_stay_distinct(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the ephemeral range is unknown, the kernel's free port (port 0) is used, still
    never one handed out lately."""
    monkeypatch.setattr(ports, "_ephemeral_low", lambda: None)
    got = [ports.free_port() for _ in range(50)]
    assert len(set(got)) == len(got)
    assert all(_listens(p) for p in got[:5])
