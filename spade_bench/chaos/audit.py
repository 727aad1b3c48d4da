"""Re-checks a verifier's verdict audit (``--audit-log``) against the acceptance rule, offline:
for each recorded call, the target's distributions are recomputed from its context and drafted
tokens, the draws from its seed and positions, and the rule (``spade_core.acceptance``) run
again; the verdict must be the one the verifier gave.

The target runs in fp32 with stock transformers, whose probabilities agree with the verifier's
kernel to rounding: a verdict that differs offline is wrong unless the draw that decided it fell
within ``TOLERANCE`` of its boundary (counted apart as borderline, not as wrong). Greedy and
sampled calls alike.

    python -m spade_bench.chaos.audit --model DIR --audit-log audit.jsonl [--limit 5000]
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from spade_core.acceptance import accept_block, draft_row, residual_distribution
from spade_core.sampling import position_uniforms, processed_probs
from verifier_service.audit import VerdictAudit, read_audit
from verifier_service.verify_input import dense_draft_probs

TOLERANCE = 1e-4
"""How near a boundary a decision may fall and still differ offline by rounding: the verifier's
kernel and stock transformers agree to ~1e-6 on a probability; a wrong verdict is rarely this
close to its boundary."""


@dataclass(frozen=True)
class AuditResult:
    num_checked: int
    num_sampled: int
    """Of those, calls at temperature > 0."""
    mismatches: tuple[str, ...]
    """Verdicts the rule does not give, with every deciding draw clear of its boundary."""
    num_borderline: int = 0
    """Verdicts that differ offline where a draw fell within ``TOLERANCE`` of its boundary."""


@dataclass(frozen=True)
class Recomputed:
    num_accepted: int
    next_token: int
    target_probs: torch.Tensor
    logits: torch.Tensor
    draft_probs: torch.Tensor | None
    uniforms: torch.Tensor


def recompute(model, audit: VerdictAudit, vocab_size: int) -> Recomputed:
    """What the rule gives for ``audit``'s inputs with ``model``'s distributions."""
    token_ids = torch.tensor([audit.context + audit.draft_tokens], dtype=torch.long)
    with torch.inference_mode():
        logits = model(input_ids=token_ids, use_cache=False, logits_to_keep=len(audit.draft_tokens) + 1).logits[0].float()
    sampling = audit.sampling.to_config()
    target_probs = processed_probs(logits, sampling)
    uniforms = position_uniforms(sampling.seed, len(audit.context), len(audit.draft_tokens) + 1)
    draft_probs = None if audit.draft_probs is None else dense_draft_probs(audit.draft_probs, vocab_size)
    acceptance = accept_block(torch.tensor(audit.draft_tokens, dtype=torch.long), draft_probs, target_probs, uniforms)
    return Recomputed(acceptance.num_accepted, acceptance.next_token_id, target_probs, logits, draft_probs, uniforms)


def is_borderline(audit: VerdictAudit, again: Recomputed) -> bool:
    """Whether the first decision on which the recorded verdict and the recomputed one part fell
    within ``TOLERANCE`` of its boundary (the accept test u q < p, or the inverse-CDF draw; at
    temperature 0, the top two logits)."""
    position = min(audit.num_accepted, again.num_accepted)
    if audit.sampling.temperature == 0:
        top2 = again.logits[position].topk(2).values
        return float(top2[0] - top2[1]) < TOLERANCE
    drafted = torch.tensor(audit.draft_tokens, dtype=torch.long)
    if audit.num_accepted != again.num_accepted:
        target_at = float(again.target_probs[position, drafted[position]])
        draft_at = 1.0 if again.draft_probs is None else float(again.draft_probs[position, drafted[position]])
        return abs(float(again.uniforms[position, 0]) * draft_at - target_at) < TOLERANCE
    if position == len(audit.draft_tokens):
        distribution = again.target_probs[position].double()
    else:
        distribution = residual_distribution(
            again.target_probs[position], draft_row(again.draft_probs, drafted, position, again.target_probs.shape[-1])
        )
    cdf = distribution.cumsum(dim=-1)
    point = float(again.uniforms[position, 1]) * float(cdf[-1])
    edges = [float(cdf[token]) for token in (audit.next_token, again.next_token)]
    edges += [float(cdf[token - 1]) for token in (audit.next_token, again.next_token) if token > 0]
    return min(abs(point - edge) for edge in edges) < TOLERANCE


def recheck(model, audits: Iterable[VerdictAudit]) -> AuditResult:
    vocab_size = model.get_output_embeddings().weight.shape[0]
    checked = sampled = borderline = 0
    mismatches = []
    for audit in audits:
        checked += 1
        sampled += audit.sampling.temperature > 0
        again = recompute(model, audit, vocab_size)
        if (again.num_accepted, again.next_token) == (audit.num_accepted, audit.next_token):
            continue
        if is_borderline(audit, again):
            borderline += 1
            continue
        mismatches.append(
            f"context of {len(audit.context)} tokens, {len(audit.draft_tokens)} drafted, T = {audit.sampling.temperature}: "
            f"the verifier said {audit.num_accepted} accepted then {audit.next_token}, "
            f"the rule gives {again.num_accepted} then {again.next_token}"
        )
    return AuditResult(checked, sampled, tuple(mismatches), borderline)


def sampled_audits(paths: Iterable[str], limit: int | None, seed: int = 0) -> list[VerdictAudit]:
    """Every recorded verdict, or a seeded sample of ``limit`` of them (sampled calls first)."""
    audits = [audit for path in paths for audit in read_audit(path)]
    if limit is None or len(audits) <= limit:
        return audits
    rng = random.Random(seed)
    hot = [audit for audit in audits if audit.sampling.temperature > 0]
    cold = [audit for audit in audits if audit.sampling.temperature == 0]
    chosen = rng.sample(hot, min(len(hot), limit))
    return chosen + rng.sample(cold, min(len(cold), limit - len(chosen)))


def load_target(model_dir: str):
    """The target in fp32, stock transformers (a full forward over each context: the verifier's
    kernel runs its batch-invariant attention row by row, seconds per long context)."""
    from spade_models.loader import ModelSource, load_model

    return load_model(ModelSource(model_dir), "cpu", "float32").model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spade_bench.chaos.audit", description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--model", required=True, help="the target the verifier served (a directory)")
    parser.add_argument("--audit-log", action="append", required=True, help="a verifier's --audit-log file (repeatable)")
    parser.add_argument("--limit", type=int, default=None, help="re-check a seeded sample of this many verdicts")
    args = parser.parse_args(argv)
    result = recheck(load_target(args.model), sampled_audits(args.audit_log, args.limit))
    print(
        f"{result.num_checked} verdicts re-checked ({result.num_sampled} sampled), {len(result.mismatches)} not the rule's, "
        f"{result.num_borderline} borderline (a draw within {TOLERANCE} of its boundary)"
    )
    for mismatch in result.mismatches[:20]:
        print("  " + mismatch)
    return 1 if result.mismatches else 0


if __name__ == "__main__":
    raise SystemExit(main())
