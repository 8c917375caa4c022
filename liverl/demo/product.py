"""The demo's product, written against ``core.product`` like any customer's.

What it gives liverl:
- rewards: the default kinds (+0.75 accept / -0.25 reject / 0 edit, from ``[ingest.rewards]``);
- an evaluation suite that grades what the product's own tests would know: is the sum right. It does not
  grade the format users of each segment prefer (``68`` or ``68!``): that hidden taste lives only in the
  simulated users (``liverl.demo.sim``) and is learned from live feedback alone;
- the simulated users, for ``liverl demo``.

Select it with ``product = "liverl.demo.product:PRODUCT"`` (``liverl demo`` does).
"""

from __future__ import annotations

import re

from core.product import EvalCase, EvalSuite, Product, UsersFn
from liverl.demo import task
from liverl.demo.sim import SimStats, run_users

SUITE_SEED = 424242
"""The suite's prompts: fixed, and drawn apart from the users' traffic generator seed."""

_NUMBER = re.compile(r"^(\d{1,3})")


def grade_sum(case: EvalCase, completion: str) -> float:
    """1.0 when the completion starts with the correct sum (whatever follows it), else 0.0."""
    m = _NUMBER.match(completion)
    return 1.0 if m and int(m.group(1)) == case.data["answer"] else 0.0


class ArithmeticProduct(Product):
    name = "demo-arithmetic"

    def __init__(self, rewards=None, suite_size: int = 256):
        super().__init__(rewards)
        self.suite_size = suite_size

    def eval_suite(self) -> EvalSuite:
        cases = [
            EvalCase(prompt=p.text, max_tokens=task.MAX_TOKENS, data={"answer": p.answer})
            for p in task.heldout_prompts(self.suite_size, seed=SUITE_SEED)
        ]
        return EvalSuite(name="sums", cases=cases, grade=grade_sum, temperature=0.0)

    def simulated_users(self) -> UsersFn:
        return run_users

    def simulated_stats(self) -> SimStats:
        return SimStats()


PRODUCT = ArithmeticProduct
"""Named in config as ``liverl.demo.product:PRODUCT`` (a class: built with the config's rewards)."""
