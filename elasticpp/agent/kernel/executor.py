"""The one place an action becomes I/O: a table of handlers, one per action type, that the
parts register beside the steps that emit them (elasticpp.agent.actions is the shared
vocabulary). Actions are applied in the order a step returned them; a handler may return
more actions (a feedback step's), applied after it, depth first."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from elasticpp.errors import ElasticppError

A = TypeVar("A")
Handler = Callable[[Any], "Sequence[object] | None"]


class UnhandledActionError(ElasticppError):
    pass


class Executor:
    def __init__(self) -> None:
        self._handlers: dict[type, Handler] = {}

    def register(self, action: type[A], handler: Callable[[A], Sequence[object] | None]) -> None:
        """`handler` applies every action of type `action`; one handler a type."""
        if action in self._handlers:
            raise ElasticppError(f"action {action.__name__} has a handler already")
        self._handlers[action] = handler

    def handles(self, action: object) -> bool:
        return type(action) in self._handlers

    def run(self, actions: Sequence[object]) -> None:
        for action in actions:
            handler = self._handlers.get(type(action))
            if handler is None:
                raise UnhandledActionError(f"no handler for action {type(action).__name__}")
            more = handler(action)
            if more:
                self.run(more)
