"""Measurements made a few cases at a time, on first use: the cases a session selected, each batch by one
``verify.measure.measure_many`` call (its processes forked from one forkserver that imported torch and the models
once), few enough that the test paying for a batch stays well inside pytest's timeout."""

from __future__ import annotations

from collections.abc import Callable


class Batched:
    """``self[case]``: ``measure(cases)``'s result for ``case``, measured with up to ``size - 1`` other cases of
    ``cases`` not measured yet."""

    def __init__(self, cases: list, measure: Callable[[list], dict], size: int = 4):
        self.cases, self.measure, self.size, self.got = cases, measure, size, {}

    def __getitem__(self, case):
        if case not in self.got:
            others = [c for c in self.cases if c not in self.got and c != case]
            self.got.update(self.measure([case, *others[:self.size - 1]]))
        return self.got[case]


def selected(request, test) -> list:
    """The ``callspec.params`` of each of ``test``'s items this session runs (its selected parametrized cases)."""
    return [item.callspec.params for item in request.session.items
            if getattr(item, "originalname", None) == test.__name__ and item.module.__name__ == test.__module__]
