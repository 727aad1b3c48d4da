"""The verdict audit (``--audit-log``) and its offline re-check: every verify call's verdict is
recorded with its inputs, and recomputing the target's distributions and the acceptance rule
from them gives the same verdicts, greedy and sampled, through a real edge; a verdict changed in
the file is caught."""

from __future__ import annotations

import httpx

from edge_support import edge_app, verifier_app
from servers import serve
from spade_bench.chaos.audit import load_target, recheck, sampled_audits
from verifier_service.audit import read_audit


def _chat(edge_url: str, temperature: float, seed: int) -> None:
    body = {
        "model": "any",
        "messages": [{"role": "user", "content": f"tell me about rivers number {seed}"}],
        "max_tokens": 24,
        "temperature": temperature,
        "seed": seed,
    }
    model = httpx.get(edge_url + "/v1/models", timeout=30).json()["data"][0]["id"]
    assert httpx.post(edge_url + "/v1/chat/completions", json=body | {"model": model}, timeout=120).status_code == 200


def test_every_verdict_is_the_rule_s_on_its_recorded_inputs_and_a_changed_one_is_caught(tiny_pair, tmp_path):
    audit_path = tmp_path / "audit.jsonl"
    with serve(verifier_app(tiny_pair, audit_log=str(audit_path))) as verifier_url, serve(edge_app(tiny_pair, verifier_url)) as edge_url:
        for seed in range(3):
            _chat(edge_url, 0.0, seed)
            _chat(edge_url, 0.9, seed)
    audits = list(read_audit(audit_path))
    assert len(audits) >= 6 and any(a.sampling.temperature > 0 and a.draft_probs for a in audits)
    assert any(a.num_accepted < len(a.draft_tokens) for a in audits if a.sampling.temperature > 0)  # rejections too
    model = load_target(str(tiny_pair.target_dir))
    result = recheck(model, audits)
    assert (result.num_checked, result.mismatches) == (len(audits), ())
    assert result.num_sampled > 0

    changed = audits[-1].model_copy(update={"next_token": audits[-1].next_token ^ 1})
    assert len(recheck(model, [changed]).mismatches) == 1
    with audit_path.open("a") as file:  # a verifier killed mid-line leaves half a record
        file.write('{"context": [1, 2')
    assert len(sampled_audits([str(audit_path)], None)) == len(audits)
