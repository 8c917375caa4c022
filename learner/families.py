"""Architecture families: how each one names its weights in the files and in transformers' memory.

The files are the contract (vLLM, the delta codec, checksums and the registry all use their names), but
transformers 5 keeps some weights under other names in memory: it stacks a MoE layer's experts into
``experts.gate_up_proj`` [E, 2I, H] (gate rows, then up rows) and ``experts.down_proj`` [E, H, I], and
some families also rename a module (Mixtral's ``block_sparse_moe`` is ``mlp`` in memory). One small
``Family`` per ``model_type`` states that translation; ``family_for`` picks it from config.json and
refuses, naming it, a family that is not handled yet.

A family is checked against transformers itself (``tests/learner/test_families.py``): the file names
it writes are the names ``save_pretrained`` writes, and ``from_pretrained`` reads its files back to the
same model.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class Family:
    """One architecture family's translation between file names and transformers' in-memory names.

    ``renames``: ordered (file infix, memory infix) pairs applied to every name (file -> memory in order,
    memory -> file in reverse). ``experts``: the file names of one expert's (gate, up, down) projections
    when the files store experts one by one (``<layer>.experts.<e>.<name>.weight``); transformers stacks
    them into ``experts.gate_up_proj`` / ``experts.down_proj``. None for dense families and for files
    that already hold the stacked tensors (renames alone then).
    """

    model_type: str
    architecture: str
    moe: bool
    experts: tuple[str, str, str] | None = None
    renames: tuple[tuple[str, str], ...] = ()

    # -- file names -> memory ------------------------------------------------------------------------------
    def to_memory(self, files: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """File-named tensors -> the names (and stacked shapes) of the transformers model's state dict."""
        import torch  # noqa: PLC0415 torch: the CLI loads this module

        out: dict[str, torch.Tensor] = {}
        stacks: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
        expert_re = self._expert_re()
        for name, t in files.items():
            m = expert_re.match(name) if expert_re is not None else None
            if m:
                stacks.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = t
            else:
                out[self._rename(name, to_memory=True)] = t
        if stacks:
            gate, up, down = self.experts
            for prefix, by_expert in stacks.items():
                idx = sorted(by_expert)
                if idx != list(range(len(idx))):
                    raise ValueError(f"{prefix}: expert indices {idx} are not 0..{len(idx) - 1}")
                missing = [(e, p) for e in idx for p in (gate, up, down) if p not in by_expert[e]]
                if missing:
                    raise ValueError(f"{prefix}: missing expert projections (expert, name) {missing[:4]}")
                mem = self._rename(prefix, to_memory=True)
                out[f"{mem}.gate_up_proj"] = torch.stack(
                    [torch.cat([by_expert[e][gate], by_expert[e][up]], dim=0) for e in idx]
                )
                out[f"{mem}.down_proj"] = torch.stack([by_expert[e][down] for e in idx])
        return out

    # -- memory -> file names ------------------------------------------------------------------------------
    def to_files(self, memory: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A transformers state dict -> tensors under the file names (per-expert views where the files split)."""
        out: dict[str, torch.Tensor] = {}
        for name, t in memory.items():
            if self.experts is not None and name.endswith(".experts.gate_up_proj"):
                prefix = self._rename(name[: -len(".gate_up_proj")], to_memory=False)
                gate, up, _ = self.experts
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{gate}.weight"] = t[e, :inter]
                    out[f"{prefix}.{e}.{up}.weight"] = t[e, inter:]
            elif self.experts is not None and name.endswith(".experts.down_proj"):
                prefix = self._rename(name[: -len(".down_proj")], to_memory=False)
                for e in range(t.shape[0]):
                    out[f"{prefix}.{e}.{self.experts[2]}.weight"] = t[e]
            else:
                out[self._rename(name, to_memory=False)] = t
        return out

    def _rename(self, name: str, to_memory: bool) -> str:
        pairs = self.renames if to_memory else tuple((m, f) for f, m in reversed(self.renames))
        for src, dst in pairs:
            name = name.replace(src, dst)
        return name

    def _expert_re(self) -> re.Pattern | None:
        if self.experts is None:
            return None
        names = "|".join(re.escape(p) for p in self.experts)
        return re.compile(rf"^(.*\.experts)\.(\d+)\.({names})\.weight$")


_PER_EXPERT = ("gate_proj", "up_proj", "down_proj")
_MIXTRAL_EXPERT = ("w1", "w3", "w2")  # w1: gate, w3: up, w2: down

FAMILIES: dict[str, Family] = {
    f.model_type: f
    for f in (
        Family("qwen3_moe", "Qwen3MoeForCausalLM", moe=True, experts=_PER_EXPERT),
        Family("qwen2_moe", "Qwen2MoeForCausalLM", moe=True, experts=_PER_EXPERT),
        Family("olmoe", "OlmoeForCausalLM", moe=True, experts=_PER_EXPERT),
        Family(
            "mixtral",
            "MixtralForCausalLM",
            moe=True,
            experts=_MIXTRAL_EXPERT,
            renames=((".block_sparse_moe.", ".mlp."),),
        ),
        Family(
            "granitemoe",
            "GraniteMoeForCausalLM",
            moe=True,
            renames=(
                (".block_sparse_moe.input_linear.weight", ".block_sparse_moe.experts.gate_up_proj"),
                (".block_sparse_moe.output_linear.weight", ".block_sparse_moe.experts.down_proj"),
                (".block_sparse_moe.router.layer.weight", ".block_sparse_moe.router.weight"),
            ),
        ),
        Family(
            "phimoe",
            "PhiMoEForCausalLM",
            moe=True,
            experts=_MIXTRAL_EXPERT,
            renames=((".block_sparse_moe.", ".mlp."), (".mlp.gate.weight", ".mlp.router.weight")),
        ),
        Family("qwen3", "Qwen3ForCausalLM", moe=False),
        Family("llama", "LlamaForCausalLM", moe=False),
    )
}
"""The families liverl handles: each one served by vLLM on CPU and tested on the full path."""


def family_for(config: Mapping | object) -> Family:
    """The family of a model's config (config.json as a dict, or a transformers config); ValueError if unhandled."""
    get = config.get if isinstance(config, Mapping) else (lambda k, d=None: getattr(config, k, d))
    model_type = get("model_type")
    archs = list(get("architectures") or [])
    fam = FAMILIES.get(model_type)
    if fam is None:
        raise ValueError(
            f"model family {model_type!r} ({', '.join(archs) or 'no architectures listed'}) is not handled by liverl "
            f"yet; handled families: {', '.join(f'{f.model_type} ({f.architecture})' for f in FAMILIES.values())}"
        )
    if archs and archs[0].lower() != fam.architecture.lower():  # PhiMoE / Phimoe: vLLM's and transformers' spelling
        raise ValueError(
            f"config.json names architecture {archs[0]!r} for model_type {model_type!r}; liverl handles "
            f"{model_type!r} only as {fam.architecture!r} (a causal LM)"
        )
    return fam
