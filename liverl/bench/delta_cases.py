"""The cases of ``liverl bench delta``, each a ``(name, base, target)`` triple of bf16 state dicts: the demo policy
after a few AdamW steps at RL-typical learning rates (``demo_cases``), and a >= 1 GiB synthetic model after one
Adam-like step whose learning rate is bisected to change a given share of the elements (``synthetic_cases``).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

Case = tuple[str, dict, dict]

DEMO_LRS = (1e-6, 3e-6, 1e-5)
DEMO_CADENCES = (1, 10, 50)
SYNTHETIC_FRACTIONS = (0.01, 0.02, 0.05)


def demo_cases(
    cache_dir: Path, seed: int = 0, lrs: tuple[float, ...] = DEMO_LRS, cadences: tuple[int, ...] = DEMO_CADENCES
) -> Iterator[Case]:
    """The demo policy moved by AdamW (weight_decay 0) steps; yields ``demo lr=<lr> every <n>`` = base -> step n.

    Each step is a causal-LM loss on a fresh random token batch (16 x 12, seeded), as a stand-in for a
    policy-gradient step: what matters here is an update of RL size on real weights, not what it learns.
    """
    import torch

    from liverl.demo.base_policy import ensure_base_policy, load_model, state_dict_from_model

    model_dir = ensure_base_policy(cache_dir, seed=seed)
    for lr in lrs:
        torch.manual_seed(seed)
        model = load_model(model_dir).train()
        base = state_dict_from_model(model)
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        g = torch.Generator().manual_seed(seed)
        vocab = model.config.vocab_size
        versions = {}
        for step in range(1, max(cadences) + 1):
            batch = torch.randint(vocab, (16, 12), generator=g)
            loss = model(input_ids=batch, labels=batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if step in cadences:
                versions[step] = state_dict_from_model(model)
        del model, opt
        for n in cadences:
            yield f"demo lr={lr:g} every {n}", base, versions.pop(n)


def synthetic_layout(gb: float) -> list[tuple[str, tuple[int, ...], float]]:
    """``(name, shape, sigma)`` of a model with at least ``gb`` GiB of bf16 weights.

    Eight large matrices (64 Mi elements each at 1 GiB; init scales 0.02 and 0.05 alternately), plus a few
    small ones: norm-like vectors (sigma 1.0) and a router-like matrix.
    """
    if gb <= 0:
        raise ValueError(f"--synthetic-gb must be positive, got {gb}")
    cols = 4096
    per = math.ceil(gb * (1 << 30) / 2 / 8)
    rows = max(1, math.ceil(per / cols))
    layout = [(f"model.layers.{i}.mlp.weight", (rows, cols), 0.02 if i % 2 == 0 else 0.05) for i in range(8)]
    layout += [(f"model.layers.{i}.norm.weight", (cols,), 1.0) for i in range(4)]
    layout += [("model.router.weight", (64, cols), 0.05)]
    return layout


def _changed_fraction_at(lr: float, sample: list[tuple[torch.Tensor, torch.Tensor, float]]) -> float:
    import torch

    changed = 0.0
    for master, sign, weight in sample:
        moved = (master + sign * lr).to(torch.bfloat16)
        changed += weight * float((moved.view(torch.int16) != master.to(torch.bfloat16).view(torch.int16)).sum())
    return changed


def step_lr_for(
    fraction: float, layout: list[tuple[str, tuple[int, ...], float]], seed: int = 0, sample_elements: int = 1 << 22
) -> float:
    """The Adam first-step size ``lr`` at which about ``fraction`` of the layout's bf16 elements change.

    Bisection (in log space) on a sample drawn like the model, each tensor represented by its share.
    """
    import torch

    if not 0 < fraction < 1:
        raise ValueError(f"changed fraction must be in (0, 1), got {fraction}")
    total = sum(math.prod(shape) for _, shape, _ in layout)
    g = torch.Generator().manual_seed(seed + 7919)
    sample = []
    for _, shape, sigma in layout:
        numel = math.prod(shape)
        m = max(256, round(sample_elements * numel / total))
        master = torch.randn(m, generator=g) * sigma
        sign = torch.randn(m, generator=g).sign()
        sample.append((master, sign, numel / total / m))
    lo, hi = math.log(1e-12), math.log(1.0)
    for _ in range(48):
        mid = (lo + hi) / 2
        if _changed_fraction_at(math.exp(mid), sample) < fraction:
            lo = mid
        else:
            hi = mid
    return math.exp((lo + hi) / 2)


def _synthetic_tensor(shape: tuple[int, ...], sigma: float, lr: float, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bf16(master), bf16(master + lr * sign(noise))) for one tensor; the fp32 master lives only here."""
    import torch

    g = torch.Generator().manual_seed(seed)
    master = torch.randn(shape, generator=g).mul_(sigma)
    base = master.to(torch.bfloat16)
    step = torch.randn(shape, generator=g).sign_().mul_(lr)
    target = step.add_(master).to(torch.bfloat16)
    return base, target


def synthetic_cases(
    gb: float = 1.0, fractions: tuple[float, ...] = SYNTHETIC_FRACTIONS, seed: int = 0
) -> Iterator[Case]:
    """A >= ``gb`` GiB bf16 model and, per fraction, its version after one Adam-like step changing that fraction.

    Master weights are fp32 ~ N(0, sigma) (sigma per tensor); base = bf16(master), target =
    bf16(master + lr * sign(noise)), lr bisected per fraction. Built tensor by tensor, so only base and
    target (bf16) are held, never the whole fp32 master. The same base (same seeds) for every fraction.
    """
    layout = synthetic_layout(gb)
    for fraction in fractions:
        lr = step_lr_for(fraction, layout, seed=seed)
        base, target = {}, {}
        for i, (name, shape, sigma) in enumerate(layout):
            base[name], target[name] = _synthetic_tensor(shape, sigma, lr, seed=seed * 1000 + i)
        yield f"synthetic {gb:g} GiB {fraction:.0%} changed", base, target
        del base, target
