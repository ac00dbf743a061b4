"""`free_port`: a port nothing the OS numbers itself can take before the caller binds it."""

import socket

from megarl.utils import distributed
from megarl.utils.distributed import free_port


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def test_free_port_is_below_the_ephemeral_range_and_free():
    first, _ = distributed._ephemeral_range()
    ports = {free_port() for _ in range(20)}
    assert all(distributed._LOW_PORT <= p < first for p in ports)
    assert all(_bindable(p) for p in ports)
    assert len(ports) > 1  # drawn at random: two callers do not race for one port


def test_ports_the_os_hands_out_never_collide_with_a_drawn_port():
    port = free_port()
    socks = []
    try:
        for _ in range(200):  # what gloo's pairs and outgoing connections get
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
            socks.append(sock)
        assert port not in {s.getsockname()[1] for s in socks}
        assert _bindable(port)
    finally:
        for sock in socks:
            sock.close()


def test_a_taken_port_is_never_returned(monkeypatch):
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        busy = taken.getsockname()[1]
        monkeypatch.setattr(distributed, "_LOW_PORT", busy)
        monkeypatch.setattr(distributed, "_ephemeral_range", lambda: (busy + 1, 65535))  # the one candidate is taken
        port = free_port()
        assert port != busy and _bindable(port)


def test_without_a_known_range_the_os_picks(monkeypatch):
    monkeypatch.setattr(distributed, "_ephemeral_range", lambda: (distributed._LOW_PORT, 65535))
    assert _bindable(free_port())


def test_a_port_handed_out_is_not_handed_out_again_before_it_is_bound(monkeypatch):
    # weight_sync.py drew its weight group's port, then run_distributed its ranks' store port: the same one
    # came back (nothing had bound the first yet) and rank 0 failed with EADDRINUSE
    class SameDraws(distributed.random.Random):
        def sample(self, population, k):
            return list(population)[:k]  # every call the same candidates in the same order

    monkeypatch.setattr(distributed.random, "SystemRandom", SameDraws)
    ports = [free_port() for _ in range(3)]
    assert len(set(ports)) == 3 and all(_bindable(p) for p in ports), ports
