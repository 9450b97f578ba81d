"""``launcher.stack.free_port`` hands out ports outside the kernel's ephemeral range, never twice."""
from __future__ import annotations

import socket

from launcher import stack


def test_ports_come_from_below_the_ephemeral_range_and_are_bindable():
    low = stack._ephemeral_low()
    ports = [stack.free_port() for _ in range(50)]
    assert len(set(ports)) == 50, "a port was handed out twice"
    for p in ports:
        assert stack.PORT_FLOOR <= p < low, (p, low)
    with socket.socket() as s:
        s.bind((stack.LOOPBACK, ports[0]))


def test_a_held_port_is_skipped(monkeypatch):
    with socket.socket() as held:
        held.bind((stack.LOOPBACK, 0))
        taken = held.getsockname()[1]
        draws = iter([taken, taken + 1 if taken + 1 < 65536 else taken - 1])

        class Rng:
            def randrange(self, a, b):
                return next(draws)

        monkeypatch.setattr(stack, "_ephemeral_low", lambda: 65535)
        monkeypatch.setattr(stack.random, "SystemRandom", Rng)
        monkeypatch.setattr(stack, "_handed", set())
        port = stack.free_port()
    assert port != taken


def test_falls_back_to_an_os_port_when_the_range_below_is_empty(monkeypatch):
    real_low = stack._ephemeral_low()
    monkeypatch.setattr(stack, "_ephemeral_low", lambda: stack.PORT_FLOOR + 10)
    port = stack.free_port()
    assert port >= real_low, "the OS picks from its ephemeral range"
    with socket.socket() as s:
        s.bind((stack.LOOPBACK, port))


def test_ephemeral_low_reads_the_sysctl_and_defaults(tmp_path):
    f = tmp_path / "range"
    f.write_text("40000\t60999\n")
    assert stack._ephemeral_low(str(f)) == 40000
    assert stack._ephemeral_low(str(tmp_path / "absent")) == 32768
