"""Starting a Ray head of one's own: when it counts as up, and which failures get a second
try. (Real heads are started throughout the suite: ``test_shared_machine.py``, the service's.)"""

from __future__ import annotations

import socket
from pathlib import Path
from typing import Any

import pytest

import service.head
from kaisa_train import head
from kaisa_train.head import HeadStartError, listening

NODE_INFO = (
    "RuntimeError: Timed out waiting for node info for node_id=fb7df810746e36abdd30d9df1437e9ed"
)


def test_a_port_counts_as_listening_only_while_something_listens_on_it() -> None:
    with socket.socket() as bound:
        bound.bind(("127.0.0.1", 0))
        port = bound.getsockname()[1]
        assert not listening(port)  # bound, not listening: what a port chosen free looks like
        bound.listen()
        assert listening(port)
    assert not listening(port)


def test_a_heads_ports_are_distinct_even_where_two_draws_are_the_same(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``ray start`` refuses one port for two servers ("is trying to use a port number ...
    used by other components", seen once in the suite): the draws repeat until distinct."""
    draws = iter([29683, 29683, 31598, 29683, 24001])
    monkeypatch.setattr(head, "free_port", lambda: next(draws))
    assert head.free_ports(3) == [29683, 31598, 24001]
    monkeypatch.undo()
    ports = head.free_ports(3)
    assert len(set(ports)) == 3
    assert all(head.SERVER_PORTS[0] <= port < head.SERVER_PORTS[1] for port in ports)


@pytest.mark.parametrize(
    ("first", "retried"),
    [
        (f"`ray start --head` exited with 1:\n{NODE_INFO}", True),
        ("`ray start --head` exited with 1:\n... Address already in use", True),
        ("`ray start --head` exited with 1:\nValueError: --num-cpus must be positive", False),
    ],
    ids=["client-server-timed-out", "port-taken", "bad-argument"],
)
def test_a_command_s_head_is_started_once_more_after_a_transient_failure_only(
    monkeypatch: pytest.MonkeyPatch, first: str, retried: bool
) -> None:
    tries: list[int] = []

    def once(**_: Any) -> str:
        tries.append(1)
        if len(tries) == 1:
            raise HeadStartError(first)
        return "the head"

    monkeypatch.setattr(head, "_start_once", once)
    if retried:
        assert head.start_head() == "the head"  # type: ignore[comparison-overlap]
        assert len(tries) == 2
    else:
        with pytest.raises(HeadStartError, match="must be positive"):
            head.start_head()
        assert len(tries) == 1


@pytest.mark.parametrize(("first", "retried"), [(NODE_INFO, True), ("bad flag", False)])
def test_a_service_s_embedded_head_is_started_once_more_after_a_transient_failure_only(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, first: str, retried: bool
) -> None:
    tries: list[str] = []

    def once(log_dir: Path, token: str, *_: Any) -> str:
        tries.append(token)
        if len(tries) == 1:
            raise RuntimeError(f"ray start exited with 1:\n{first}")
        return "the head"

    monkeypatch.setattr(service.head, "_start_once", once)
    if retried:
        assert service.head.start_head(tmp_path, token="t") == "the head"  # type: ignore[comparison-overlap]
        assert tries == ["t", "t"]  # the same token: what the service handed out still works
    else:
        with pytest.raises(RuntimeError, match="bad flag"):
            service.head.start_head(tmp_path, token="t")
        assert tries == ["t"]
