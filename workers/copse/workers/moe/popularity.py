"""Which experts a request's tokens activate: a skewed model-wide popularity, and a preference of
its own per prompt (requests sharing a first block, such as a system prompt, share it).

The mocked model routes tokens by content, as a real one does: a request's expert distribution is
a deterministic function of its first KV block's hash, so the same prefix always prefers the same
experts and nothing outside the engine has to tell it which "class" a request is.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import numpy.typing as npt

FloatArray = npt.NDArray[np.float64]

#: DeepSeek-V3 on a coding workload, activations per 1,000 tokens by popularity rank (the design
#: documents' figures): 1st 82, 5th 71, 23rd 58, median 31, 200th 12, least popular 3.
_DEEPSEEK_V3_RANKS = (1.0, 5.0, 23.0, 128.5, 200.0, 256.0)
_DEEPSEEK_V3_PER_1000 = (82.0, 71.0, 58.0, 31.0, 12.0, 3.0)


def skewed_popularity(experts: int, *, skew: float = 2.0) -> FloatArray:
    """Share of activations per popularity rank (descending, sums to 1): the DeepSeek-V3 curve,
    log-linear between its published points, stretched to ``experts`` experts, raised to ``skew``.

    The published points alone (``skew`` 1) give the top 32 of 256 experts 26 % of activations;
    the same source says about 40 %, which ``skew`` 2 gives (39 %): the default.
    """
    if experts < 1:
        raise ValueError(f"experts must be >= 1, got {experts}")
    if not skew >= 0:
        raise ValueError(f"skew must be >= 0, got {skew}")
    ranks = 1.0 + np.arange(experts) * (255.0 / max(experts - 1, 1))
    curve = np.exp(skew * np.interp(ranks, _DEEPSEEK_V3_RANKS, np.log(_DEEPSEEK_V3_PER_1000)))
    shares: FloatArray = curve / curve.sum()
    return shares


def _permutation(experts: int, *, seed: int, key: int | None) -> npt.NDArray[np.intp]:
    digest = hashlib.blake2b(f"{seed}/{key}".encode(), digest_size=8).digest()
    return np.random.default_rng(int.from_bytes(digest, "little")).permutation(experts)


@dataclasses.dataclass(slots=True)
class ExpertPopularity:
    """Expert shares per prompt: ``(1 - prompt_weight)`` of the model-wide popularity plus
    ``prompt_weight`` of the same skewed curve over the prompt's own ordering of the experts."""

    experts: int
    seed: int = 0
    """Seeds the model: which experts are popular overall and per prompt."""
    prompt_weight: float = 0.5
    """How much a prompt's own preference outweighs the model-wide popularity (0: none)."""
    skew: float = 2.0
    """Exponent of the popularity curve (see :func:`skewed_popularity`)."""
    _curve: FloatArray = dataclasses.field(init=False, repr=False)
    _global: FloatArray = dataclasses.field(init=False, repr=False)
    _cache: dict[int, FloatArray] = dataclasses.field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        if not 0.0 <= self.prompt_weight <= 1.0:
            raise ValueError(f"prompt_weight must lie in [0, 1], got {self.prompt_weight}")
        self._curve = skewed_popularity(self.experts, skew=self.skew)
        shares = np.empty(self.experts)
        shares[_permutation(self.experts, seed=self.seed, key=None)] = self._curve
        self._global = shares

    @property
    def model_wide(self) -> FloatArray:
        """The model-wide share of each expert (what a prompt without a full block gets)."""
        return self._global

    def of(self, key: int | None) -> FloatArray:
        """The expert shares of a request whose first block hashes to ``key`` (sums to 1)."""
        if key is None or self.prompt_weight == 0.0:
            return self._global
        shares = self._cache.get(key)
        if shares is None:
            own = np.empty(self.experts)
            own[_permutation(self.experts, seed=self.seed, key=key)] = self._curve
            shares = (1.0 - self.prompt_weight) * self._global + self.prompt_weight * own
            self._cache[key] = shares
        return shares
