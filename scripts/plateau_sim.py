"""The demo's learning loop in one process, fast: what the learner's candidates are worth at the plateau.

    python scripts/plateau_sim.py --updates 3000 --seeds 0 1 [--variant main|ema|...] [--csv out.csv]

An hour of ``liverl demo`` costs an hour of the machine and gives one noisy reading of the refusal runs.
This loop keeps the demo's learner and its users and replaces everything between them with their simplest faithful
stand-ins, so that a change to the learner can be compared over several seeds in minutes:

- users: the demo's task and judgement (``liverl.demo.task``: segments, the trap's bait, 5% misclicks, edits in
  segment ``b``, reverts of the trap's accepts after ~30 s, trained as the ingest's correction sample with
  ``rewards.revert``);
- serving: completions sampled from the served weights (bf16, as vLLM serves them) at the product's temperature,
  their behaviour log-probs computed by the same weights; half the traffic on the canary while one runs;
- the learner: ``learner.policy_trainer.PolicyTrainer`` with the demo's config (lr 3e-4, batch 64, KL to stable),
  a candidate every 10 updates, the rebase after 2 refusals in a row, the learning-rate back-off and its recovery.
  ``--variants`` names settings joined by ``+``: ``emaD`` (``learner.candidate_ema`` = D, the candidates are its
  weights' average), ``lift`` (``learner.floor_for_candidate``: the entropy floor held for the averaged
  candidate); ``main`` is none of them;
- the gate: the collapse floor (``gate.min_entropy``: the candidate's mean per-token entropy on the last 256
  generations, teacher-forced, as ``learner.evaluate`` measures it), the product's suite (greedy sums on 256
  prompts, McNemar's one-sided at 0.05: ``deploy.gate.gate``'s rule) and a canary whose estimate is the candidate's
  exact expected acceptance difference plus the noise of a user-clustered sequential test at the demo's traffic (design
  effect 1.5, a 3-s.e. always-valid bound, non-inferiority within 3 points, the 6,000-event budget), looked at every 10
  updates after the revert horizon.

Time is counted in updates; the demo makes about 0.8 a second (64 samples at ~50 judged events a second), which is
how the table converts to seconds. This is a model of the demo, not the demo: it is for ranking learner variants,
and the one that wins still has to hold in the hour (BENCHMARKS.md).
"""

from __future__ import annotations

import argparse
import csv
import math
import random
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.config import GateConfig, LearnerConfig  # noqa: E402
from core.product import EvalCase  # noqa: E402
from deploy.gate.evidence import paired_sign_test  # noqa: E402
from learner.model import load_model  # noqa: E402
from learner.policy_trainer import PolicyTrainer  # noqa: E402
from liverl.demo import task  # noqa: E402
from liverl.demo.base_policy import ensure_base_policy  # noqa: E402
from liverl.demo.product import grade_sum  # noqa: E402
from liverl.demo.score import sample_completions, score_model  # noqa: E402
from liverl.demo.vocab import VOCAB, encode_text  # noqa: E402

UPDATES_PER_S = 0.8
BATCH = 64
CANDIDATE_EVERY = 10
REVERT_DELAY_UPDATES = 30.0 * UPDATES_PER_S
HORIZON_UPDATES = int(90 * UPDATES_PER_S)  # the first canary evidence: a bucket read after the 75-s horizon
BUDGET_UPDATES = int(6000 / (BATCH / 2))  # 6,000 events on the canary arm at half the traffic
MARGIN = 0.03
DEFF = 1.5
MIN_ENTROPY = GateConfig().min_entropy


@dataclass
class Sample:
    prompt_token_ids: list[int]
    completion_token_ids: list[int]
    behaviour_logprobs: list[float]
    reward: float
    segment: str


def served(model_dir: Path, weights: dict) -> torch.nn.Module:
    m = load_model(model_dir, state_dict=weights, dtype=torch.float32)
    m.eval()
    return m


def suite_grades(model, prompts) -> list[float]:
    """The product's suite grades (``liverl.demo.product.grade_sum``) of the greedy completions, 3 tokens each."""
    ids = torch.tensor([encode_text(p.text) for p in prompts])
    out = []
    with torch.no_grad():
        for _ in range(3):
            nxt = model(input_ids=ids).logits[:, -1].argmax(-1)
            out.append(nxt)
            ids = torch.cat([ids, nxt[:, None]], 1)
    return [
        grade_sum(EvalCase(prompt=p.text, data={"answer": p.answer}), "".join(VOCAB[int(t[i])] for t in out))
        for i, p in enumerate(prompts)
    ]


def suite_refuses(cand: list[float], stable: list[float], alpha: float = 0.05) -> bool:
    """The gate's suite rule: worse on more cases than better, and the paired sign test shows it at ``alpha``."""
    worse, better, p = paired_sign_test(cand, stable)
    return worse > better and p < alpha


def collapse_entropy(tr: PolicyTrainer, model, probes: list[Sample]) -> float:
    """The gate's collapse measure (``learner.evaluate.PolicyEvaluator.drift``): the candidate's mean per-token
    entropy at the completion positions of the recent generations, teacher-forced."""
    x = tr._collate(probes)
    return tr._entropy_part(x, int(x["mask_BT"].sum()), 1.0, model=model)


def run(args, variant: str, seed: int, model_dir: Path, writer) -> dict:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    parts = {re.match(r"[a-z]+", p).group(0): p for p in variant.split("+")}  # e.g. ema0.97+lift
    ema_decay = float(parts["ema"][3:] or 0.9) if "ema" in parts else 0.0
    lcfg = LearnerConfig(
        lr=args.lr,
        batch_size=BATCH,
        max_staleness=40,
        rebase_after_refusals=2,
        candidate_ema=ema_decay,
        floor_for_candidate="lift" in parts,
    )
    tr = PolicyTrainer(model_dir, lcfg)
    eval_prompts = task.heldout_prompts(512, seed=999)
    suite_prompts = task.heldout_prompts(256, seed=424242)

    def true_acc(model) -> float:
        return score_model(model, eval_prompts)["expected_acceptance"]

    stable_w = tr.weights()
    stable_m = served(model_dir, stable_w)
    stable_acc = true_acc(stable_m)
    stable_suite = suite_grades(stable_m, suite_prompts)
    tr.set_reference(stable_w)
    pending: list[tuple[float, Sample]] = []  # (due update, correction sample)
    probes: list[Sample] = []  # the gate's drift and collapse probes: the last 256 generations
    canary = None  # dict(w, model, acc, start, walk)
    newest = None  # (weights, update)
    refused_in_row = 0
    lr_scale = 1.0
    runs, run_start = [], None
    promotions = collapses = 0
    t0 = time.time()
    for u in range(args.updates):
        # -- traffic: 64 judged generations, half on the canary while one runs
        prompts = [task.sample_prompt(rng) for _ in range(BATCH)]
        on_canary = [canary is not None and rng.random() < 0.5 for _ in prompts]
        batch: list[Sample] = []
        for arm in (False, True):
            idx = [i for i, c in enumerate(on_canary) if c == arm]
            if not idx:
                continue
            model = canary["model"] if arm else stable_m
            ps = [prompts[i] for i in idx]
            comps = sample_completions(model, ps, seed=rng.randrange(1 << 30))
            raw = [
                Sample(encode_text(p.text), ids, [0.0] * len(ids), 0.0, p.segment)
                for p, (ids, _) in zip(ps, comps, strict=True)
            ]
            lps = tr.token_logprobs(raw, model=model)
            for p, (_ids, text), s, lp in zip(ps, comps, raw, lps, strict=True):
                s.behaviour_logprobs = [min(0.0, x) for x in lp]
                truth = text is not None and task.user_accepts(p, text)
                bait = text is not None and task.tempting(p, text)
                tempted = bait and rng.random() < 0.7
                accepted = truth or tempted
                judged = accepted if rng.random() >= 0.05 else not accepted
                if judged:
                    s.reward = 0.75
                    if tempted and rng.random() < 0.9:
                        due = u + rng.expovariate(1.0 / REVERT_DELAY_UPDATES)
                        pending.append(
                            (
                                due,
                                Sample(
                                    s.prompt_token_ids, s.completion_token_ids, s.behaviour_logprobs, -1.0, s.segment
                                ),
                            )
                        )
                elif p.segment == "b" and rng.random() < 0.3:
                    s.reward = 0.0
                else:
                    s.reward = -0.25
                batch.append(s)
        due = [s for d, s in pending if d <= u]
        pending = [(d, s) for d, s in pending if d > u]
        probes = (probes + batch)[-256:]
        tr.train_step(batch + due)
        if (u + 1) % CANDIDATE_EVERY == 0:  # the learner's candidate: its weights' average when candidate_ema > 0
            tr.measure_candidate_entropy()  # as the learner does at each candidate (``lift``: and raises its floor)
            newest = (tr.candidate_weights(), u)
        # -- the gate: a canary looked at every 10 updates; otherwise judge the newest candidate
        if canary is not None and (u - canary["start"]) % 10 == 0 and u - canary["start"] >= HORIZON_UPDATES:
            t = u - canary["start"]
            n_arm = max(1, t * BATCH / 2 - HORIZON_UPDATES * BATCH / 2)
            p = max(0.05, min(0.95, stable_acc))
            se = math.sqrt(2 * p * (1 - p) / n_arm * DEFF)
            # the estimate's noise as a Brownian path in information time: consistent across looks
            step_n = n_arm - canary["n"]
            canary["sum"] += rng.gauss(0.0, math.sqrt(2 * p * (1 - p) * DEFF * step_n)) if step_n > 0 else 0.0
            canary["n"] = n_arm
            est = canary["diff"] + canary["sum"] / n_arm
            verdict = None
            if est - 3 * se > -MARGIN:
                verdict = "promote"
            elif est + 3 * se < -MARGIN:
                verdict = "worse"
            elif t >= BUDGET_UPDATES + HORIZON_UPDATES:
                verdict = "futile"
            if verdict == "promote":
                stable_w, stable_m, stable_acc = canary["w"], canary["model"], canary["acc"]
                stable_suite = suite_grades(stable_m, suite_prompts)
                tr.set_reference(stable_w)
                promotions += 1
                refused_in_row = 0
                if run_start is not None:
                    runs.append((run_start, u))
                    run_start = None
                if args.recover and lr_scale < 1.0:
                    lr_scale = min(1.0, lr_scale * 2)
                    tr.set_lr_scale(lr_scale)
                writer.writerow([variant, seed, u, "promote", f"{canary['diff']:+.4f}", f"{stable_acc:.4f}", lr_scale])
                canary = None
            elif verdict is not None:
                writer.writerow([variant, seed, u, verdict, f"{canary['diff']:+.4f}", f"{stable_acc:.4f}", lr_scale])
                canary = None
                refused_in_row += 1
                run_start = u if run_start is None else run_start
        if canary is None and newest is not None and newest[1] < u + 1:
            cw, _cu = newest
            newest = None
            cm = served(model_dir, cw)
            acc = true_acc(cm)
            entropy = collapse_entropy(tr, cm, probes)
            if entropy < MIN_ENTROPY:  # the gate's collapse floor (gate.min_entropy), checked before the suite
                writer.writerow([variant, seed, u, "collapse", f"{entropy:.4f}", f"{stable_acc:.4f}", lr_scale])
                collapses += 1
                refused_in_row += 1
                run_start = u if run_start is None else run_start
            elif suite_refuses(suite_grades(cm, suite_prompts), stable_suite):
                writer.writerow([variant, seed, u, "suite", f"{acc - stable_acc:+.4f}", f"{stable_acc:.4f}", lr_scale])
                refused_in_row += 1
                run_start = u if run_start is None else run_start
            else:
                canary = {"w": cw, "model": cm, "acc": acc, "diff": acc - stable_acc, "start": u, "n": 0.0, "sum": 0.0}
        if refused_in_row >= 2:  # the learner's rebase after 2 refusals, with the back-off
            lr_scale = max(0.125, lr_scale * 0.5)
            tr.load_weights(stable_w, reset_optimizer=True)
            tr.set_lr_scale(lr_scale)
            refused_in_row = 0
            writer.writerow([variant, seed, u, "rebase", "", f"{stable_acc:.4f}", lr_scale])
        if (u + 1) % 250 == 0:
            print(
                f"  {variant} seed {seed}: update {u + 1}, stable acc {stable_acc:.3f}, {promotions} promotions, "
                f"{time.time() - t0:.0f} s",
                flush=True,
            )
    if run_start is not None:
        runs.append((run_start, args.updates))
    return {
        "variant": variant,
        "seed": seed,
        "promotions": promotions,
        "collapses": collapses,
        "final": stable_acc,
        "runs": runs,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--updates", type=int, default=2900)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--variants", nargs="+", default=["main"])
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--no-recover", dest="recover", action="store_false")
    ap.add_argument("--plateau-from", type=int, default=1400, help="runs of refusals counted from this update")
    ap.add_argument("--csv", type=Path, default=Path("plateau_sim.csv"))
    args = ap.parse_args()
    torch.set_num_threads(1)
    model_dir = ensure_base_policy(Path.home() / ".cache" / "liverl" / "models")
    results = []
    with args.csv.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["variant", "seed", "update", "event", "diff", "stable_acc", "lr_scale"])
        for variant in args.variants:
            for seed in args.seeds:
                results.append(run(args, variant, seed, model_dir, writer))
                f.flush()
    print(
        "\n| variant | seed | promotions | collapse refusals | final stable acc | longest run after plateau-from (s) "
        "| runs > 300 s |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in results:
        late = [(a, b) for a, b in r["runs"] if b > args.plateau_from]
        longest = max(((b - max(a, args.plateau_from)) / UPDATES_PER_S for a, b in late), default=0.0)
        over = sum(1 for a, b in r["runs"] if (b - a) / UPDATES_PER_S > 300)
        print(
            f"| {r['variant']} | {r['seed']} | {r['promotions']} | {r['collapses']} | {r['final']:.3f} "
            f"| {longest:.0f} | {over} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
