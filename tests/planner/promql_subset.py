"""Evaluation of the PromQL the planner's default queries and the Grafana dashboard use, over
scraped samples: vector selectors (a metric name and/or ``{label op "value", ...}`` with ``=``,
``!=``, ``=~``, ``!~``, regexes fully anchored as in Prometheus), ``sum(...)``, ``count(...)``,
``sum|max|min|count by (labels) (...)``, ``vector(N)``, numbers, ``or``, ``+``, ``*`` and ``/``
(one-element operands, or series matched on all their labels), with parentheses;
``increase(v[d])`` and ``rate(v[d])`` over two scrapes (``earlier``, then ``samples``, ``d`` apart:
the difference per series, no extrapolation), and ``histogram_quantile(q, v)`` with Prometheus'
interpolation, per histogram (the labels other than ``le``). Enough to check that a query finds
the series an exporter writes and computes with them; anything else is a :class:`ValueError`,
never a silent guess."""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

Sample = tuple[str, Mapping[str, str], float]
"""A scraped sample: metric name, labels, value."""
Vector = list[tuple[dict[str, str], float]]

_TOKEN = re.compile(
    r'\s*(?:(?P<number>\d+(?:\.\d+)?)|(?P<name>[A-Za-z_:][A-Za-z0-9_:]*)|(?P<string>"(?:[^"\\]|\\.)*")'
    r"|(?P<op>=~|!~|!=|=|[(){},+*/\[\]]))"
)


@dataclass
class _Parser:
    tokens: list[tuple[str, str]]
    samples: Sequence[Sample]
    earlier: Sequence[Sample] | None = None
    pos: int = 0
    _selector_start: int = 0

    def peek(self) -> tuple[str, str] | None:
        return self.tokens[self.pos] if self.pos < len(self.tokens) else None

    def take(self, kind: str, value: str | None = None) -> str:
        token = self.peek()
        if token is None or token[0] != kind or (value is not None and token[1] != value):
            raise ValueError(f"expected {value or kind} at token {self.pos}, got {token}")
        self.pos += 1
        return token[1]

    def expression(self) -> Vector:
        left = self.product()
        while (token := self.peek()) is not None and token in (("op", "+"), ("name", "or")):
            self.pos += 1
            right = self.product()
            if token == ("name", "or"):
                left = left or right
            else:  # one-element vectors with the same (empty, after sum) labels
                left = [(labels, value + right[0][1]) for labels, value in left] if left and right else []
        return left

    def product(self) -> Vector:
        left = self.term()
        while (token := self.peek()) is not None and token in (("op", "*"), ("op", "/")):
            self.pos += 1
            right = self.term()
            left = _binary(left, right, divide=token == ("op", "/"))
        return left

    def term(self) -> Vector:
        token = self.peek()
        if token is not None and token[0] == "number":
            self.pos += 1
            return [({}, float(token[1]))]
        if token in (("name", "increase"), ("name", "rate")):
            self.pos += 1
            self.take("op", "(")
            now = self.selector()
            seconds = self.range_s()
            self.take("op", ")")
            if self.earlier is None:
                raise ValueError("increase/rate need the earlier scrape")
            before = _Parser(self.tokens, self.earlier, pos=self._selector_start).selector()
            old = {tuple(sorted(labels.items())): value for labels, value in before}
            changes = [(labels, value - old.get(tuple(sorted(labels.items())), 0.0)) for labels, value in now]
            if token == ("name", "rate"):
                changes = [(labels, value / seconds) for labels, value in changes]
            return [
                ({k: v for k, v in labels.items() if k != "__name__"}, value) for labels, value in changes
            ]
        if token == ("name", "histogram_quantile"):
            self.pos += 1
            self.take("op", "(")
            q = float(self.take("number"))
            self.take("op", ",")
            buckets = self.expression()
            self.take("op", ")")
            histograms: dict[tuple[tuple[str, str], ...], Vector] = {}
            for labels, value in buckets:
                key = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
                histograms.setdefault(key, []).append((labels, value))
            return [
                (dict(key), _histogram_quantile(q, histogram)[0][1]) for key, histogram in histograms.items()
            ]
        if token is not None and token[1] in _AGGREGATIONS and self.tokens[self.pos + 1] == ("name", "by"):
            aggregate = _AGGREGATIONS[token[1]]
            self.pos += 2
            self.take("op", "(")
            by: list[str] = []
            while self.peek() != ("op", ")"):
                by.append(self.take("name"))
                if self.peek() == ("op", ","):
                    self.take("op", ",")
            self.take("op", ")")
            self.take("op", "(")
            inner = self.expression()
            self.take("op", ")")
            groups: dict[tuple[str, ...], list[float]] = {}
            for labels, value in inner:
                groups.setdefault(tuple(labels.get(label, "") for label in by), []).append(value)
            return [(dict(zip(by, key, strict=True)), aggregate(values)) for key, values in groups.items()]
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
        if token == ("name", "count"):
            self.pos += 1
            self.take("op", "(")
            inner = self.expression()
            self.take("op", ")")
            return [({}, float(len(inner)))] if inner else []
        if token == ("name", "vector"):
            self.pos += 1
            self.take("op", "(")
            number = float(self.take("number"))
            self.take("op", ")")
            return [({}, number)]
        return self.selector()

    def range_s(self) -> float:
        """A range ``[<number><unit>]`` in seconds."""
        self.take("op", "[")
        number = float(self.take("number"))
        unit = self.take("name")
        self.take("op", "]")
        scale = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}.get(unit)
        if scale is None:
            raise ValueError(f"unsupported duration unit {unit!r}")
        return number * scale

    def selector(self) -> Vector:
        self._selector_start = self.pos
        matchers: list[tuple[str, str, str]] = []
        if (token := self.peek()) is not None and token[0] == "name":
            matchers.append(("__name__", "=", self.take("name")))
        if self.peek() == ("op", "{"):
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


_AGGREGATIONS: dict[str, Callable[[list[float]], float]] = {
    "sum": sum,
    "max": max,
    "min": min,
    "count": lambda values: float(len(values)),
}


def _binary(left: Vector, right: Vector, *, divide: bool) -> Vector:
    """``left * right`` or ``left / right``: one-element operands combine whatever their labels
    (after ``sum`` they have none); otherwise series with equal label sets are paired."""

    def apply(a: float, b: float) -> float:
        if not divide:
            return a * b
        return a / b if b else float("nan")

    if not left or not right:
        return []
    if len(left) == 1 and len(right) == 1:
        return [(left[0][0] or right[0][0], apply(left[0][1], right[0][1]))]
    others = {tuple(sorted(labels.items())): value for labels, value in right}
    return [
        (labels, apply(value, others[key]))
        for labels, value in left
        if (key := tuple(sorted(labels.items()))) in others
    ]


def _matches(value: str, op: str, want: str) -> bool:
    if op == "=":
        return value == want
    if op == "!=":
        return value != want
    hit = re.fullmatch(want, value) is not None
    return hit if op == "=~" else not hit


def _histogram_quantile(q: float, buckets: Vector) -> Vector:
    """Prometheus' bucketQuantile over cumulative ``le`` buckets (one histogram)."""
    ordered = sorted(buckets, key=lambda bucket: float(bucket[0]["le"]))
    if not ordered or ordered[-1][0]["le"] != "+Inf":
        raise ValueError("a histogram needs its +Inf bucket")
    bounds = [float(labels["le"]) for labels, _ in ordered]
    counts = [value for _, value in ordered]
    total = counts[-1]
    if total == 0:
        return [({}, float("nan"))]
    rank = q * total
    index = next(i for i, count in enumerate(counts) if count >= rank)
    if index == len(counts) - 1:
        return [({}, bounds[-2])]
    start = bounds[index - 1] if index > 0 else 0.0
    below = counts[index - 1] if index > 0 else 0.0
    inside = counts[index] - below
    return [({}, start + (bounds[index] - start) * (rank - below) / inside)]


def evaluate_vector(
    query: str, samples: Sequence[Sample], *, earlier: Sequence[Sample] | None = None
) -> Vector:
    """Every series the query gives over ``samples`` (and ``earlier``, the scrape one range before,
    for ``increase``/``rate``)."""
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
    parser = _Parser(tokens, samples, earlier)
    result = parser.expression()
    if parser.peek() is not None:
        raise ValueError(f"unread tokens from {parser.pos}: {tokens[parser.pos :]}")
    return result


def evaluate(
    query: str, samples: Sequence[Sample], *, earlier: Sequence[Sample] | None = None
) -> float | None:
    """The query's single value over ``samples`` (and ``earlier``, the scrape one range before, for
    ``increase``/``rate``); ``None`` when it selects nothing."""
    result = evaluate_vector(query, samples, earlier=earlier)
    if len(result) > 1:
        raise ValueError(f"{query!r} gives {len(result)} series, not one")
    return result[0][1] if result else None
