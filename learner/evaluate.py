"""What the release gate asks of a policy, answered with the learner's model code (torch, transformers).

The gate (``deploy/gate/gate.py``) never imports this module: the command that starts the gate builds a
``PolicyEvaluator`` and hands it in, so the release tier stays free of the learner and of any product.
It answers with evidence a real product has, never with an answer key:

- **drift**: the mean per-token KL(candidate || stable) over probe sequences (recent logged generations:
  real prompts and the completions the served policy sampled, teacher-forced through both models), at every
  completion position, exact over the vocabulary;
- **collapse**: the candidate's mean per-token entropy at the same positions (a near-deterministic policy
  has stopped exploring and cannot recover from a bad reward signal);
- **suite**: the product's own evaluation suite, if it has one: each case decoded by both versions (greedy by
  default) and graded in [0, 1] by the product's grader.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from core.product import EvalCase, EvalSuite
from learner.model import load_model, load_tokenizer


@dataclass(frozen=True)
class Probe:
    """One logged generation: the prompt the model read and the completion it sampled (token ids)."""

    prompt_ids: tuple[int, ...]
    completion_ids: tuple[int, ...]


@contextlib.contextmanager
def _threads(n: int) -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class PolicyEvaluator:
    """Drift, collapse and suite figures for weights under the model dir's file names.

    ``probes`` returns the current probe sequences (the gate tails the generations topic); the suite is
    optional. ``threads`` bounds torch's CPU threads while evaluating (the gate shares the machine).
    """

    def __init__(
        self,
        model_dir: Path,
        suite: EvalSuite | None,
        probes: Callable[[], Sequence[Probe]],
        max_probes: int = 256,
        threads: int = 1,
        batch_size: int = 64,
    ):
        self.model_dir = Path(model_dir)
        self.suite = suite
        self.probes = probes
        self.max_probes = max_probes
        self.threads = threads
        self.batch_size = batch_size
        self._tokenizer = None

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = load_tokenizer(self.model_dir)
        return self._tokenizer

    def _model(self, weights: Mapping[str, torch.Tensor]):
        return load_model(self.model_dir, dict(weights), dtype=torch.float32)

    def warm_up(self, weights: Mapping[str, torch.Tensor]) -> None:
        """Build the model once and run one forward (the first one pays for imports, kernels and allocations) and load
        the tokenizer, so that the gate's first candidate is judged as fast as the later ones."""
        with _threads(self.threads), torch.no_grad():
            pad = self._pad_id()
            self._model(weights)(input_ids=torch.full((1, 8), pad), attention_mask=torch.ones((1, 8), dtype=torch.long))

    # ------------------------------------------------------------------------------------- drift + collapse
    def drift(self, candidate: Mapping[str, torch.Tensor], stable: Mapping[str, torch.Tensor]) -> dict | None:
        """``{"kl", "entropy", "stable_entropy", "tokens", "probes"}`` over the current probes; None without probes."""
        probes = list(self.probes())[-self.max_probes :]
        probes = [p for p in probes if p.prompt_ids and p.completion_ids]
        if not probes:
            return None
        with _threads(self.threads), torch.no_grad():
            cand, ref = self._model(candidate), self._model(stable)
            kl_sum = ent_sum = ref_ent_sum = 0.0
            tokens = 0
            for i in range(0, len(probes), self.batch_size):
                batch = probes[i : i + self.batch_size]
                ids_BT, mask_BT, on_BT = _teacher_forcing(batch, pad_id=self._pad_id())
                logp_c_BTV = torch.log_softmax(cand(input_ids=ids_BT, attention_mask=mask_BT).logits.float(), -1)
                logp_s_BTV = torch.log_softmax(ref(input_ids=ids_BT, attention_mask=mask_BT).logits.float(), -1)
                p_c_BTV = logp_c_BTV.exp()
                kl_BT = (p_c_BTV * (logp_c_BTV - logp_s_BTV)).sum(-1)
                ent_BT = -(p_c_BTV * logp_c_BTV).sum(-1)
                ref_ent_BT = -(logp_s_BTV.exp() * logp_s_BTV).sum(-1)
                kl_sum += float((kl_BT * on_BT).sum())
                ent_sum += float((ent_BT * on_BT).sum())
                ref_ent_sum += float((ref_ent_BT * on_BT).sum())
                tokens += int(on_BT.sum())
        return {
            "kl": kl_sum / tokens,
            "entropy": ent_sum / tokens,
            "stable_entropy": ref_ent_sum / tokens,
            "tokens": tokens,
            "probes": len(probes),
        }

    def sequence_logprobs(self, weights: Mapping[str, torch.Tensor], probes: Sequence[Probe]) -> list[float]:
        """log pi(completion | prompt) of each probe under ``weights``: the sum over its completion tokens."""
        out: list[float] = []
        if not probes:
            return out
        with _threads(self.threads), torch.no_grad():
            model = self._model(weights)
            for i in range(0, len(probes), self.batch_size):
                batch = probes[i : i + self.batch_size]
                ids_BT, mask_BT, on_BT = _teacher_forcing(batch, pad_id=self._pad_id())
                logp_BTV = torch.log_softmax(model(input_ids=ids_BT, attention_mask=mask_BT).logits.float(), -1)
                next_BT = torch.roll(ids_BT, -1, dims=1)  # the token each position predicts
                tok_BT = logp_BTV.gather(-1, next_BT.unsqueeze(-1)).squeeze(-1)
                out += [float(x) for x in (tok_BT * on_BT).sum(-1)]
        return out

    def _pad_id(self) -> int:
        tok = self.tokenizer
        for cand in (tok.pad_token_id, tok.eos_token_id, 0):
            if cand is not None:
                return int(cand)
        return 0

    # ------------------------------------------------------------------------------------------- suite
    def suite_score(self, weights: Mapping[str, torch.Tensor]) -> dict | None:
        """``{"name", "score", "cases", "completions", "grades"}``: the mean grade of the suite's completions, and each
        completion's grade in case order (the gate pairs them with the stable version's); None without a suite."""
        if self.suite is None:
            return None
        suite = self.suite
        with _threads(self.threads), torch.no_grad():
            model = self._model(weights)
            grades = []
            gen = torch.Generator().manual_seed(0)
            for case, completion in zip(
                _repeat(suite.cases, suite.samples), self._decode(model, suite, gen), strict=True
            ):
                g = float(suite.grade(case, completion))
                if not 0.0 <= g <= 1.0:
                    raise ValueError(f"suite {suite.name!r}: the grader returned {g}, outside [0, 1]")
                grades.append(g)
        return {
            "name": suite.name,
            "score": sum(grades) / len(grades),
            "cases": len(suite.cases),
            "completions": len(grades),
            "grades": grades,
        }

    def _prompt_ids(self, case: EvalCase) -> list[int]:
        tok = self.tokenizer
        if case.messages is not None:
            if not getattr(tok, "chat_template", None):
                raise ValueError(f"evaluation case uses chat messages but {self.model_dir} has no chat template")
            return list(tok.apply_chat_template(list(case.messages), add_generation_prompt=True, tokenize=True))
        return list(tok(case.prompt)["input_ids"])

    def _decode(self, model, suite: EvalSuite, gen: torch.Generator) -> list[str]:
        """Completions in case order (each case ``suite.samples`` times), batched by prompt length."""
        tok = self.tokenizer
        cases = list(_repeat(suite.cases, suite.samples))
        prompts = [self._prompt_ids(c) for c in cases]
        eos = tok.eos_token_id
        out: list[str | None] = [None] * len(cases)
        by_len: dict[tuple[int, int], list[int]] = {}
        for i, (p, c) in enumerate(zip(prompts, cases, strict=True)):
            by_len.setdefault((len(p), c.max_tokens), []).append(i)
        for (_, max_tokens), idx in sorted(by_len.items()):
            for j in range(0, len(idx), self.batch_size):
                rows = idx[j : j + self.batch_size]
                ids_BT = torch.tensor([prompts[i] for i in rows])
                done_B = torch.zeros(len(rows), dtype=torch.bool)
                new: list[torch.Tensor] = []
                for _ in range(max_tokens):
                    logits_BV = model(input_ids=ids_BT).logits[:, -1].float()
                    if suite.temperature == 0.0:
                        nxt_B = logits_BV.argmax(-1)
                    else:
                        probs_BV = torch.softmax(logits_BV / suite.temperature, -1)
                        nxt_B = torch.multinomial(probs_BV, 1, generator=gen)[:, 0]
                    if eos is not None:
                        nxt_B = torch.where(done_B, torch.full_like(nxt_B, eos), nxt_B)
                        done_B |= nxt_B == eos
                    new.append(nxt_B)
                    ids_BT = torch.cat([ids_BT, nxt_B[:, None]], dim=1)
                    if bool(done_B.all()):
                        break
                for b, i in enumerate(rows):
                    toks = [int(t[b]) for t in new]
                    if eos is not None and eos in toks:
                        toks = toks[: toks.index(eos)]
                    out[i] = tok.decode(toks, skip_special_tokens=True)
        return [s or "" for s in out]


def _repeat(cases: Sequence[EvalCase], n: int) -> Iterator[EvalCase]:
    for c in cases:
        for _ in range(n):
            yield c


def _teacher_forcing(batch: Sequence[Probe], pad_id: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids_BT, attention_mask_BT, on_BT): right-padded prompt+completion; ``on`` marks the positions whose
    next-token distribution samples a completion token (the last prompt position through the second-to-last
    completion position)."""
    T = max(len(p.prompt_ids) + len(p.completion_ids) for p in batch)
    ids_BT = torch.full((len(batch), T), pad_id, dtype=torch.long)
    mask_BT = torch.zeros((len(batch), T), dtype=torch.long)
    on_BT = torch.zeros((len(batch), T), dtype=torch.float32)
    for b, p in enumerate(batch):
        seq = list(p.prompt_ids) + list(p.completion_ids)
        ids_BT[b, : len(seq)] = torch.tensor(seq)
        mask_BT[b, : len(seq)] = 1
        on_BT[b, len(p.prompt_ids) - 1 : len(seq) - 1] = 1.0
    return ids_BT, mask_BT, on_BT
