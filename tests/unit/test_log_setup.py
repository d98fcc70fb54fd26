"""What the torchrun entry points do to logging (``show_logs_under_torchrun``): the
package's lines at ``$LOGLEVEL`` (default WARNING), the events at INFO while
``$LOGLEVEL`` is unset, and nothing at all when the application configured logging."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from etcd_rdzv._factory import show_logs_under_torchrun
from etcd_rdzv.rendezvous.listener import EVENTS

PACKAGE = logging.getLogger("etcd_rdzv")


@pytest.fixture(autouse=True)
def _restored(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Our loggers as a fresh process has them, and as they were afterwards; no
    $LOGLEVEL."""
    events = logging.getLogger(EVENTS)
    saved = (list(PACKAGE.handlers), PACKAGE.level, events.level)
    monkeypatch.delenv("LOGLEVEL", raising=False)
    monkeypatch.setattr(logging.getLogger(), "level", logging.getLogger().level)
    # As a fresh process has them (other tests may have configured them).
    PACKAGE.handlers = [h for h in PACKAGE.handlers if isinstance(h, logging.NullHandler)]
    PACKAGE.setLevel(logging.NOTSET)
    events.setLevel(logging.NOTSET)
    yield
    PACKAGE.handlers = saved[0]
    PACKAGE.setLevel(saved[1])
    events.setLevel(saved[2])


def _unconfigured(monkeypatch: pytest.MonkeyPatch) -> None:
    """No handler on the root for this test (pytest's own is put back afterwards)."""
    monkeypatch.setattr(logging.getLogger(), "handlers", [])


def _logged(capsys: pytest.CaptureFixture[str]) -> str:
    logging.getLogger(EVENTS).info("a round formed")
    logging.getLogger("etcd_rdzv.rendezvous.join").info("a join's detail")
    logging.getLogger("etcd_rdzv.rendezvous.join").warning("a problem")
    return capsys.readouterr().err


def test_by_default_the_events_show_and_the_details_do_not(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unconfigured(monkeypatch)
    show_logs_under_torchrun()
    err = _logged(capsys)
    assert "INFO etcd_rdzv.events: a round formed" in err
    assert "WARNING etcd_rdzv.rendezvous.join: a problem" in err
    assert "a join's detail" not in err
    assert err.count("a round formed") == 1


@pytest.mark.parametrize(
    ("level", "events", "details"),
    [
        ("WARNING", False, False),
        ("error", False, False),
        ("INFO", True, True),
        ("DEBUG", True, True),
    ],
)
def test_a_loglevel_that_is_set_applies_to_the_events_too(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    level: str,
    events: bool,
    details: bool,
) -> None:
    _unconfigured(monkeypatch)
    monkeypatch.setenv("LOGLEVEL", level)
    show_logs_under_torchrun()
    err = _logged(capsys)
    assert ("a round formed" in err) is events
    assert ("a join's detail" in err) is details
    assert err.count("a round formed") <= 1


def test_logging_the_application_configured_is_left_alone(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    _unconfigured(monkeypatch)
    logging.basicConfig(level=logging.WARNING, format="app: %(name)s: %(message)s")
    show_logs_under_torchrun()
    assert [h for h in PACKAGE.handlers if not isinstance(h, logging.NullHandler)] == []
    err = _logged(capsys)
    # The root's configuration decides: WARNING, one line each, no line of ours.
    assert err == "app: etcd_rdzv.rendezvous.join: a problem\n"
