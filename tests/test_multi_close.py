"""Closing several cards when some fail (issue 34, bad conditions): a card that died may refuse its own close; the
other cards' buffers and file readers must still be freed, and a build's error must not be hidden by a close's."""

import pytest

from hybridinfer.backends.gpu.multi_gpu import close_cards, closing_on_error


class Card:
    def __init__(self, name, fail=None):
        self.name, self.fail, self.closed = name, fail, False

    def close(self):
        self.closed = True
        if self.fail:
            raise self.fail


def test_every_card_is_closed_and_the_first_failure_raised():
    bad0, bad2 = RuntimeError("card 0 lost"), RuntimeError("card 2 lost")
    cards = [Card(0, bad0), Card(1), Card(2, bad2), Card(3)]
    with pytest.raises(RuntimeError) as ei:
        close_cards(cards, lambda c: c.close())
    assert ei.value is bad0
    assert all(c.closed for c in cards)


def test_no_failure_raises_nothing():
    cards = [Card(0), Card(1)]
    close_cards(cards, lambda c: c.close())
    assert all(c.closed for c in cards)


class Model:
    def __init__(self, cards):
        self.cards = cards

    def close(self):
        close_cards(self.cards, lambda c: c.close())


def test_a_build_error_survives_a_failing_close():
    cards = [Card(0, OSError("context of card 0 is gone")), Card(1)]
    build = ValueError("card 1: vram budget 1 B cannot hold its pass")
    with pytest.raises(ValueError) as ei:
        with closing_on_error(Model(cards)):
            raise build
    assert ei.value is build
    assert any("context of card 0 is gone" in n for n in getattr(ei.value, "__notes__", []))
    assert all(c.closed for c in cards)


def test_a_build_error_with_a_clean_close_has_no_note():
    cards = [Card(0), Card(1)]
    with pytest.raises(KeyError) as ei:
        with closing_on_error(Model(cards)):
            raise KeyError("x")
    assert not getattr(ei.value, "__notes__", None)
    assert all(c.closed for c in cards)
