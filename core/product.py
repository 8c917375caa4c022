"""A product, as liverl sees it: the one interface where everything product-specific plugs in.

liverl's core knows nothing about what a product does. A product tells it three things, through one
object named in config (``product = "my_package.liverl_product:PRODUCT"``):

- ``reward(kind, segment)``: how a feedback kind maps to a training reward, per segment if wished
  (the default reads ``[ingest.rewards]``: Cursor Tab's +0.75 accept / -0.25 reject, 0 edit);
- ``eval_suite()``: an optional evaluation suite for the release gate: prompts plus a grader that scores a
  completion in [0, 1], like the product's own benchmark. There is no answer key beyond what a product's test
  suite knows; the live signal is the feedback;
- ``simulated_users()``: for a demo only, a coroutine that plays users against the gateway and the SDK.

The model itself is ``model.path`` (any Hugging Face causal-LM directory). This module is torch-free;
the demo's product (``liverl.demo.product``) is written against it like any customer's, and nothing in
``ingest/``, ``learner/``, ``serving/`` or ``deploy/`` imports a product module: processes load the one the
config names with ``load_product``.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from core.config import LiverlConfig, RewardConfig
from core.schemas import FeedbackKind


@dataclass(frozen=True)
class EvalCase:
    """One prompt of an evaluation suite: plain text (``prompt``) or chat ``messages``, rendered with the
    model's chat template. ``data`` carries whatever the grader needs (an expected answer, a test id)."""

    prompt: str | None = None
    messages: tuple[dict[str, str], ...] | None = None
    max_tokens: int = 64
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("an EvalCase needs exactly one of prompt or messages")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class EvalSuite:
    """Prompts and a grader: ``grade(case, completion) -> score in [0, 1]``.

    The gate decodes each case with the candidate and with the stable version (``temperature`` 0 is greedy,
    the default: no sampling noise between the two; ``samples`` completions per case when sampling, with a
    fixed seed) and compares the mean grade.
    """

    name: str
    cases: Sequence[EvalCase]
    grade: Callable[[EvalCase, str], float]
    temperature: float = 0.0
    samples: int = 1

    def __post_init__(self):
        if not self.cases:
            raise ValueError(f"evaluation suite {self.name!r} has no cases")
        if self.temperature < 0 or self.samples < 1:
            raise ValueError("temperature must be >= 0 and samples >= 1")


UsersFn = Callable[..., Awaitable[Any]]

DEMO_PRODUCT = "liverl.demo.product:PRODUCT"
"""The product the demo and ``liverl chaos`` run when config names none (an import path: the core never imports it)."""


class Product:
    """The default product: rewards from ``[ingest.rewards]``, no evaluation suite, no simulated users.

    Subclass it and override what your product needs; name an instance (or a class, or a zero-argument
    factory) in config as ``product = "module:attr"``.
    """

    name = "generic"

    def __init__(self, rewards: RewardConfig | None = None):
        self.rewards = rewards or RewardConfig()

    def reward(self, kind: FeedbackKind, segment: str | None) -> float:
        """The training reward of a judgement ``kind`` by a user in ``segment`` (may be None)."""
        return float(getattr(self.rewards, kind))

    def eval_suite(self) -> EvalSuite | None:
        return None

    def simulated_users(self) -> UsersFn | None:
        """Demo only: ``async fn(gateway_url, sdk, n_users, stop_event, stats, seed)`` playing users."""
        return None

    def simulated_stats(self) -> Any:
        """Demo only: a fresh counters object for ``simulated_users`` to fill (its ``stats`` argument)."""
        return None

    def describe(self) -> str:
        suite = self.eval_suite()
        return f"{self.name} (evaluation suite: {suite.name + f', {len(suite.cases)} cases' if suite else 'none'})"


def load_product(cfg: LiverlConfig) -> Product:
    """The product ``cfg.product`` names (``module:attr``), else the default ``Product``.

    ``attr`` may be a ``Product`` instance, a ``Product`` subclass or a zero-argument factory returning one.
    A product built here gets ``cfg.ingest.rewards`` unless it sets its own.
    """
    spec = cfg.product
    if not spec:
        return Product(cfg.ingest.rewards)
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"product must be 'module:attr', got {spec!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"product {spec!r}: cannot import {module_name!r}: {e}") from e
    try:
        obj = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"product {spec!r}: module {module_name!r} has no attribute {attr!r}") from None
    if isinstance(obj, type) and issubclass(obj, Product):
        obj = obj(cfg.ingest.rewards)
    elif not isinstance(obj, Product) and callable(obj):
        obj = obj()
    if not isinstance(obj, Product):
        raise ValueError(f"product {spec!r} is a {type(obj).__name__}, not a core.product.Product")
    return obj
