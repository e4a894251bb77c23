"""The harness's free ports (cli/harness.py): below the kernel's ephemeral range, so that no
client socket of the suite takes a test server's port between the probe and the bind (what
failed CI with "address already in use"), distinct, and free on every address asked for."""

from __future__ import annotations

import random
import socket

import pytest

from zeroserve.cli import harness

PODS = ["127.0.0.1", "127.0.0.2"]  # the whole 127/8 is loopback on Linux


def below_the_ephemeral_range(port: int) -> bool:
    low, _high = harness._ephemeral_range()
    return port < low


@pytest.fixture(autouse=True)
def _room_below_the_range():
    if harness._ephemeral_range()[0] <= 12000:
        pytest.skip("no room below this machine's ephemeral port range")


def test_free_ports_are_below_the_ephemeral_range_distinct_and_bindable():
    ports = [harness.free_port() for _ in range(20)]
    assert len(set(ports)) == len(ports)
    assert all(below_the_ephemeral_range(p) for p in ports), ports
    for port in ports:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_ports_for_pods_are_below_the_range_and_free_on_every_address():
    ports = harness.free_ports_on(PODS, 3)
    assert len(set(ports)) == 3
    assert all(below_the_ephemeral_range(p) for p in ports), ports
    for port in ports:
        for ip in PODS:
            with socket.socket() as s:
                s.bind((ip, port))
    assert not set(ports) & {harness.free_port() for _ in range(10)}  # never handed out twice


def test_a_port_taken_on_any_address_is_passed_over(monkeypatch):
    with socket.socket() as held:
        held.bind((PODS[1], 0))  # taken on the second address only
        taken = held.getsockname()[1]
        tries = iter([taken, taken])
        real = random.randint
        monkeypatch.setattr(random, "randint", lambda a, b: next(tries, None) or real(a, b))
        ports = harness.free_ports_on(PODS, 2)
    assert taken not in ports and len(set(ports)) == 2
