"""Instant evaluation of the PromQL the planner's engine-gauge queries use, over scraped samples:
vector selectors (a metric name and/or ``{label op "value", ...}`` with ``=``, ``!=``, ``=~``,
``!~``, regexes fully anchored as in Prometheus), ``sum(...)``, ``vector(N)``, ``or`` and ``+``,
with parentheses. Enough to check that a query finds the series an exporter writes and adds them
up; anything else is a :class:`ValueError`, never a silent guess."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Sample = tuple[str, Mapping[str, str], float]
"""A scraped sample: metric name, labels, value."""
Vector = list[tuple[dict[str, str], float]]

_TOKEN = re.compile(
    r'\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<string>"(?:[^"\\]|\\.)*")'
    r"|(?P<op>=~|!~|!=|=|[(){},+]))"
)


@dataclass
class _Parser:
    tokens: list[tuple[str, str]]
    samples: Sequence[Sample]
    pos: int = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> str:
        token = self.peek()
        if token is None or token[0] != kind or (value is not None and token[1] != value):
            raise ValueError(f"expected {value or kind} at token {self.pos}, got {token}")
        self.pos += 1
        return token[1]

    def expression(self) -> Vector:
        left = self.term()
        while (token := self.peek()) is not None and token in (("op", "+"), ("name", "or")):
            self.pos += 1
            right = self.term()
            if token == ("name", "or"):
                left = left or right
            else:  # one-element vectors with the same (empty, after sum) labels
                left = [(labels, value + right[0][1]) for labels, value in left] if left and right else []
        return left

    def term(self) -> Vector:
        token = self.peek()
        if token == ("op", "("):
            self.take("op", "(")
            inner = self.expression()
            self.take("op", ")")
            return inner
        if token == ("name", "sum"):
            self.pos += 1
            self.take("op", "(")
            inner = self.expression()
            self.take("op", ")")
            return [({}, sum(value for _, value in inner))] if inner else []
        if token == ("name", "vector"):
            self.pos += 1
            self.take("op", "(")
            number = float(self.take("number"))
            self.take("op", ")")
            return [({}, number)]
        return self.selector()

    def selector(self) -> Vector:
        matchers: list[tuple[str, str, str]] = []
        if (token := self.peek()) is not None and token[0] == "name":
            matchers.append(("__name__", "=", self.take("name")))
        self.take("op", "{")
        while self.peek() != ("op", "}"):
            label = self.take("name")
            op = self.take("op")
            if op not in {"=", "!=", "=~", "!~"}:
                raise ValueError(f"unsupported matcher {op!r}")
            value = self.take("string")[1:-1].encode().decode("unicode_escape")
            matchers.append((label, op, value))
            if self.peek() == ("op", ","):
                self.take("op", ",")
        self.take("op", "}")
        return [
            (dict(labels), value)
            for name, labels, value in self.samples
            if all(
                _matches({**labels, "__name__": name}.get(label, ""), op, want)
                for label, op, want in matchers
            )
        ]


def _matches(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    hit = re.fullmatch(want, value) is not None
    return hit if op == "=~" else not hit


def evaluate(query: str, samples: Sequence[Sample]) -> float | None:
    """The query's single value over ``samples``; ``None`` when it selects nothing."""
    tokens: list[tuple[str, str]] = []
    pos = 0
    while pos < len(query.rstrip()):
        match = _TOKEN.match(query, pos)
        if match is None or match.end() == pos:
            raise ValueError(f"cannot read {query[pos:]!r}")
        kind = match.lastgroup
        assert kind is not None
        tokens.append((kind, match.group(kind)))
        pos = match.end()
    parser = _Parser(tokens, samples)
    result = parser.expression()
    if parser.peek() is not None:
        raise ValueError(f"unread tokens from {parser.pos}: {tokens[parser.pos :]}")
    if len(result) > 1:
        raise ValueError(f"{query!r} gives {len(result)} series, not one")
    return result[0][1] if result else None
