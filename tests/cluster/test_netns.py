"""Where namespace hosts cannot be built, the cluster tests skip and say why."""

from __future__ import annotations

import pytest

from bench import hosts as netns

pytestmark = pytest.mark.timeout(10)


@pytest.mark.parametrize("caps, reason", [
    (0, "needs CAP_NET_ADMIN (run as root) to create network namespaces and veth pairs"),
    (1 << 12, "needs CAP_SYS_ADMIN (run as root) for a private hostname and /dev/shm per host"),
])
def test_without_the_capabilities_the_reason_names_the_missing_one(monkeypatch, caps, reason):
    monkeypatch.setattr(netns, "_effective_caps", lambda: caps)
    assert netns.unavailable() == reason


def test_without_the_tools_the_reason_names_them(monkeypatch):
    monkeypatch.setattr(netns, "_effective_caps", lambda: (1 << 12) | (1 << 21))
    monkeypatch.setattr(netns.shutil, "which", lambda tool: None if tool in ("nsenter", "tc") else f"/bin/{tool}")
    assert netns.unavailable() == "needs nsenter, tc (iproute2, util-linux)"
