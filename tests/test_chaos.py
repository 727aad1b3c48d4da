"""The chaos run's parts that decide: the seeded fault schedule and request mix, the client's
reading of answers (against a scripted edge), and the checks over the records. The whole run
(real edges, replicas, nginx) runs from .ci/run: `spade-bench chaos --minutes 3`."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from spade_bench.chaos import checks, run
from spade_bench.chaos.checks import FaultRecord, Sample
from spade_bench.chaos.load import Client, RequestRecord, is_openai_error, request_body
from spade_bench.chaos.monitor import connection_roles
from spade_bench.chaos.plan import (
    FAULT_KINDS,
    LINK_FAULTS,
    ChaosConfig,
    FaultPlan,
    RequestMix,
    RequestPlan,
    fault_schedule,
    load_running,
    prompt_text,
)

CONFIG = ChaosConfig(duration_s=600, num_edges=6, num_linked_edges=2, fault_interval_s=30, seed=3)


# --- the plan ------------------------------------------------------------------------------


def test_the_schedule_is_seeded_cycles_through_every_kind_first_and_ends_quiet():
    schedule = fault_schedule(CONFIG)
    assert schedule == fault_schedule(CONFIG)
    assert schedule != fault_schedule(replace(CONFIG, seed=4))
    scheduled = [plan for plan in schedule if plan.scheduled]
    assert [plan.kind for plan in scheduled[: len(FAULT_KINDS)]] == list(FAULT_KINDS)
    assert all(CONFIG.warmup_s <= plan.start_s <= CONFIG.duration_s - CONFIG.fault_interval_s * 0.3 for plan in schedule)
    assert [plan.start_s for plan in schedule] == sorted(plan.start_s for plan in schedule)


def test_a_run_too_short_for_every_kind_still_plans_each_once_and_the_load_waits_for_them():
    short = ChaosConfig(duration_s=180, num_edges=16, num_linked_edges=4, fault_interval_s=15)  # CI's 3-minute mode
    schedule = fault_schedule(short)
    assert [plan.kind for plan in schedule] == list(FAULT_KINDS)  # each once, no random ones between
    assert all(plan.scheduled for plan in schedule)
    assert schedule[-1].start_s > short.duration_s - short.fault_interval_s  # past the window a long run keeps quiet
    assert load_running(170.0, short, faults_finished_at_s=None)
    assert load_running(250.0, short, faults_finished_at_s=None)  # past the duration while a fault remains
    assert load_running(250.0, short, faults_finished_at_s=240.0)  # the quiet interval after the last one
    assert not load_running(255.0, short, faults_finished_at_s=240.0)
    assert load_running(170.0, short, faults_finished_at_s=100.0) and not load_running(180.0, short, faults_finished_at_s=100.0)


def test_each_fault_is_aimed_at_something_that_exists():
    for plan in fault_schedule(replace(CONFIG, duration_s=3600)):
        if plan.kind in LINK_FAULTS:
            assert 0 <= plan.target < CONFIG.num_linked_edges
        elif plan.kind == "replica_kill":
            assert plan.target in (0, 1)
        else:
            assert 0 <= plan.target < CONFIG.num_edges


def test_a_config_without_a_plain_or_a_linked_edge_is_refused():
    with pytest.raises(ValueError):
        ChaosConfig(num_edges=4, num_linked_edges=4)
    with pytest.raises(ValueError):
        ChaosConfig(num_edges=4, num_linked_edges=0)


def test_the_mix_is_seeded_and_draws_every_kind_of_request():
    first, second = RequestMix(CONFIG, seed=7), RequestMix(CONFIG, seed=7)
    plans = [first.next(edge=1) for _ in range(2000)]
    assert plans == [second.next(edge=1) for _ in range(2000)]
    assert {plan.endpoint for plan in plans} == {"chat", "completions"}
    assert {plan.behaviour for plan in plans} == {"normal", "disconnect", "slow"}
    assert {plan.greedy for plan in plans} == {True, False}
    assert any(plan.long_prompt for plan in plans) and any(plan.n == 2 for plan in plans) and any(plan.logprobs for plan in plans)
    assert all(plan.stream for plan in plans if plan.behaviour != "normal")  # hanging up or reading slowly needs a stream
    assert len({plan.index for plan in plans}) == len(plans)


def test_request_bodies_carry_what_the_plan_asks():
    plan = RequestPlan(1, 0, "chat", True, 0.8, 42, 16, 3, True, False, True, 2, "normal")
    body = request_body(plan, "tiny", long_words=10)
    assert body["messages"][0]["role"] == "system" and body["messages"][1]["content"] == prompt_text(3, False, 10)
    assert body["seed"] == 42 and body["n"] == 2 and body["top_logprobs"] == 2 and body["stream_options"] == {"include_usage": True}
    greedy = request_body(replace(plan, endpoint="completions", temperature=0.0, stream=False, n=1, logprobs=False), "tiny", 10)
    assert "seed" not in greedy and "n" not in greedy and greedy["prompt"].endswith(prompt_text(3, False, 10))
    assert len(prompt_text(3, True, 50).split()) > 50


# --- the client, against a scripted edge -----------------------------------------------------


def scripted_edge() -> FastAPI:
    """Answers by the model named: "stream" streams three pieces, "error" streams one then an
    error event, "raw" sends a 500 that is not JSON; n > 1 is refused as the edge does."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        body = await request.json()
        text = body["model"]
        if body.get("n", 1) > 1:
            error = {"message": "only n=1 is supported", "type": "invalid_request_error", "param": "n", "code": None}
            return JSONResponse({"error": error}, status_code=400)
        if "raw" in text:
            return JSONResponse("boom", status_code=500)
        if not body["stream"]:
            return {"choices": [{"message": {"content": "whole"}, "finish_reason": "stop"}], "usage": {"completion_tokens": 1}}

        async def events():
            yield 'data: {"choices": [{"delta": {"content": "a"}, "finish_reason": null}]}\n\n'
            if "error" in text:
                error = {"message": "the verifier is unavailable (ConnectError)", "type": "server_error", "param": None, "code": "x"}
                yield f"data: {json.dumps({'error': error})}\n\n"
            else:
                yield 'data: {"choices": [{"delta": {"content": "b"}, "finish_reason": null}]}\n\n'
                yield 'data: {"choices": [{"delta": {"content": "c"}, "finish_reason": "stop"}]}\n\n'
                yield 'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    return app


def send(plan: RequestPlan, script: str) -> RequestRecord:
    """``plan`` sent to the scripted edge, which reads its script from the model name."""

    async def go() -> RequestRecord:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(scripted_edge())) as http:
            return await Client(http, script, 0, hung_deadline_s=30, clock=lambda: 0.0).send(plan, "http://edge")

    return asyncio.run(go())


STREAM = RequestPlan(1, 0, "chat", True, 0.0, 0, 16, 0, False, False, False, 1, "normal")


def test_a_complete_stream_is_ok_with_its_text_and_tokens():
    record = send(STREAM, "stream")
    assert (record.outcome, record.text, record.finish_reason, record.completion_tokens, record.done) == ("ok", "abc", "stop", 3, True)
    assert record.first_byte_s is not None


def test_a_stream_that_ends_in_an_error_event_failed_shaped_with_its_done():
    record = send(STREAM, "error")
    assert (record.outcome, record.text, record.done, record.error_shaped) == ("failed", "a", True, True)


def test_a_client_that_hangs_up_abandoned_its_request():
    record = send(replace(STREAM, behaviour="disconnect"), "stream")
    assert record.outcome == "abandoned"


def test_a_refusal_the_request_asked_for_is_refused_and_a_500_is_failed_unshaped():
    refused = send(replace(STREAM, stream=False, n=2), "whole")
    assert (refused.outcome, refused.status, refused.error_shaped) == ("refused", 400, True)
    broken = send(replace(STREAM, stream=False), "raw")
    assert (broken.outcome, broken.status, broken.error_shaped) == ("failed", 500, False)
    assert checks.check_no_server_errors([broken]).passed is False
    assert checks.check_errors_shaped([broken]).passed is False


def test_a_request_the_api_refuses_must_not_be_answered():
    answered = record(replace(STREAM, n=2))
    assert not checks.check_errors_shaped([answered]).passed


def test_openai_error_shape():
    assert is_openai_error({"error": {"message": "m", "type": "t", "param": None, "code": None}})
    assert not is_openai_error({"error": {"message": "", "type": "t", "param": None, "code": None}})
    assert not is_openai_error({"detail": "Not Found"})


# --- the checks ----------------------------------------------------------------------------


def record(plan: RequestPlan, outcome="ok", text="abc", started=10.0, ended=11.0, status=200) -> RequestRecord:
    return RequestRecord(plan, started, ended, 0.1, outcome, status, text, "stop", 3, None, True, True)


def test_greedy_text_must_equal_the_reference_and_an_early_end_must_be_a_prefix():
    references = {STREAM.reference_key(): "abcdef"}
    assert checks.check_greedy_exact([record(STREAM, text="abcdef"), record(STREAM, "failed", "abc")], references).passed
    assert not checks.check_greedy_exact([record(STREAM, text="abcdeX")], references).passed
    assert not checks.check_greedy_exact([record(STREAM, "failed", "abX")], references).passed
    sampled = replace(STREAM, temperature=0.8)
    assert checks.check_greedy_exact([record(sampled, text="anything")], references).passed


def test_a_failure_passes_only_inside_a_window_on_an_edge_the_fault_reached():
    link_fault = FaultRecord("link_drop", 100.0, 105.0, (2,))
    on_edge_2 = record(replace(STREAM, edge=2), "failed", started=104.0, ended=104.5, status=503)
    on_edge_3 = record(replace(STREAM, edge=3), "failed", started=104.0, ended=104.5, status=503)
    long_after = record(replace(STREAM, edge=2), "failed", started=140.0, ended=141.0, status=503)
    assert checks.check_failures_in_windows([on_edge_2], [link_fault], recovery_bound_s=20).passed
    assert not checks.check_failures_in_windows([on_edge_3], [link_fault], recovery_bound_s=20).passed
    assert not checks.check_failures_in_windows([long_after], [link_fault], recovery_bound_s=20).passed
    pool_fault = FaultRecord("verifier_kill", 100.0, 110.0, None)
    assert checks.check_failures_in_windows([on_edge_3], [pool_fault], recovery_bound_s=20).passed


def test_hung_requests_and_unrecovered_faults_fail():
    assert not checks.check_not_hung([record(STREAM, "hung")], 60).passed
    assert checks.check_not_hung([record(STREAM)], 60).passed
    kill, mismatch = FaultPlan("replica_kill", 1, 8.0), FaultPlan("wire_mismatch_edge", 1, 0.0)
    assert not checks.check_fault_expectations([FaultRecord("replica_kill", 1, 2, None, recovered_s=None)], [kill]).passed
    assert not checks.check_fault_expectations([FaultRecord("wire_mismatch_edge", 1, 2, (), "exited 0", 0.0, False)], [mismatch]).passed
    assert checks.check_fault_expectations([FaultRecord("replica_kill", 1, 2, None, recovered_s=0.4)], [kill]).passed


def test_a_planned_fault_that_never_ran_fails_the_run():
    ran = FaultRecord("replica_kill", 30, 45, None, recovered_s=0.4)
    result = checks.check_fault_expectations([ran], [FaultPlan("replica_kill", 30, 8.0), FaultPlan("nginx_restart", 45, 1.0)])
    assert not result.passed
    assert result.violations == ("nginx_restart planned at 45 s: never ran",)


def series(process: str, pid: int, rss_mib: list[float], fds: list[int], start=20.0, step=10.0) -> list[Sample]:
    return [Sample(start + i * step, process, pid, int(r * 2**20), f, 0) for i, (r, f) in enumerate(zip(rss_mib, fds, strict=True))]


def test_memory_must_stay_flat_after_warm_up_per_incarnation():
    flat = series("edge-00", 10, [300, 302, 299, 301, 303, 300, 302, 301], [40] * 8)
    assert checks.check_flat(flat, warm_s=20, load_end_s=90).passed
    leaking = series("edge-00", 10, [300, 310, 320, 330, 340, 350, 360, 370], [40] * 8)
    assert not checks.check_flat(leaking, warm_s=20, load_end_s=90).passed
    fd_leak = series("verifier-a", 11, [300] * 8, [40, 45, 50, 55, 60, 65, 70, 75])
    assert not checks.check_flat(fd_leak, warm_s=20, load_end_s=90).passed
    # A restart is a new incarnation: its fresh RSS is not compared with the old one's.
    restarted = series("edge-00", 10, [500] * 4, [40] * 4) + series("edge-00", 12, [300] * 8, [40] * 8, start=20)
    assert checks.check_flat(restarted, warm_s=20, load_end_s=90).passed


def restart(process: str, pid: int, first_s: float, serving_s: float, rss_serving: list[float], step=5.0) -> list[Sample]:
    """An incarnation a fault starts at ``first_s``: loading (RSS climbing, no /metrics) until
    ``serving_s``, then one sample per ``rss_serving`` value with its metrics."""
    loading = [
        Sample(t, process, pid, int((100 + 10 * i) * 2**20), 3 + i, 1) for i, t in enumerate(range(int(first_s), int(serving_s), int(step)))
    ]
    metrics = {"spade_verifier_sessions": 1.0}
    serving = [Sample(serving_s + i * step, process, pid, int(r * 2**20), 12, 2, metrics) for i, r in enumerate(rss_serving)]
    return loading + serving


def test_a_process_a_fault_starts_is_judged_after_its_own_warm_up():
    # What CI saw: the stack from 0 s; a verifier restarted at 38 s loads until 61 s, then serves
    # flat; an edge restarted at 87 s serves from 124 s. Their climb while loading is a start.
    stack = series("verifier-a", 10, [500] * 38, [12] * 38, start=0.0, step=5.0)
    stack += series("verifier-b", 8, [500] * 7, [12] * 7, start=0.1, step=5.0)  # killed at 30 s
    stack += series("edge-11", 9, [330] * 18, [12] * 18, start=0.2, step=5.0)  # terminated at 86 s
    verifier_b = restart("verifier-b", 11, 38.0, 61.0, [515] * 26)
    edge_11 = restart("edge-11", 12, 87.0, 124.0, [529] * 13)
    result = checks.check_flat(stack + verifier_b + edge_11, warm_s=30, load_end_s=188)
    assert result.passed, result.violations
    assert result.summary.endswith("restarted too late to judge: edge-11 (pid 12, judged from 154 s)")
    assert result.summary.startswith("2 processes judged")  # verifier-a, and verifier-b from 91 s; the stopped ones ran too short
    # After its own warm-up a restarted process that grows is still a leak.
    leaking_b = restart("verifier-b", 11, 38.0, 61.0, [515 + 8 * i for i in range(26)])
    result = checks.check_flat(stack + leaking_b, warm_s=30, load_end_s=188)
    assert not result.passed
    assert any(v.startswith("verifier-b (pid 11): RSS 571 -> ") for v in result.violations)


def test_a_small_process_may_grow_by_a_few_mebibytes_but_not_by_a_leak():
    nginx = series("nginx", 13, [7.0, 7.0, 7.1, 7.6, 8.1, 8.2, 8.3, 8.3], [5] * 8)  # +18 %: one burst's buffers
    assert checks.check_flat(nginx, warm_s=20, load_end_s=90).passed
    leaking = series("nginx", 13, [7, 9, 11, 13, 15, 17, 19, 21], [5] * 8)
    assert not checks.check_flat(leaking, warm_s=20, load_end_s=90).passed


def edge_sample(at_s: float, opened: int, accepted: int, process: str = "edge-01") -> Sample:
    return Sample(at_s, process, 1, 0, 11 + opened + accepted, 1 + opened + accepted, {}, opened, accepted)


def test_a_pool_s_idle_connections_are_not_a_leak_but_more_than_its_bound_are():
    before = [edge_sample(0, opened=2, accepted=1)]
    pooled = edge_sample(99, opened=2 + 12, accepted=1 + 30)  # a burst left keep-alive connections each way
    assert checks.check_back_to_idle(before, [pooled], server_bound=64).passed
    assert not checks.check_back_to_idle(before, [edge_sample(99, opened=2 + 25, accepted=1)], server_bound=64).passed
    assert not checks.check_back_to_idle(before, [edge_sample(99, opened=2, accepted=1 + 70)], server_bound=64).passed
    harness = edge_sample(99, opened=400, accepted=0, process="runner")  # the run's own clients are never judged
    assert checks.check_back_to_idle([edge_sample(0, 10, 0, "runner")], [harness]).passed


def test_connections_are_told_apart_by_whether_the_process_listens_on_their_port():
    table = {"1": (8000, "0A"), "2": (8000, "01"), "3": (8000, "01"), "4": (51234, "01"), "5": (51235, "08")}
    links = ["socket:[1]", "socket:[2]", "socket:[3]", "socket:[4]", "socket:[5]", "socket:[99]", "pipe:[7]", "/dev/null"]
    assert connection_roles(links, table) == (2, 2)  # 51234 and 51235 opened (one half-closed), two accepted on 8000


def test_back_to_idle_wants_no_session_held_and_the_descriptors_of_before():
    before = [Sample(0, "verifier-a", 1, 0, 30, 5)]
    assert checks.check_back_to_idle(before, [Sample(99, "verifier-a", 2, 0, 33, 5, {"spade_verifier_sessions": 0})]).passed
    assert not checks.check_back_to_idle(before, [Sample(99, "verifier-a", 2, 0, 33, 5, {"spade_verifier_sessions": 2})]).passed
    assert not checks.check_back_to_idle(before, [Sample(99, "verifier-a", 2, 0, 90, 5)]).passed
    # An edge whose draft sessions outlive their requests leaks a draft KV cache each; retained
    # prefixes are a bounded cache and may stay.
    idle_edge = {"spade_edge_draft_sessions": 0, "spade_edge_draft_retained_sessions": 3}
    edge_before = [Sample(0, "edge-00", 3, 0, 30, 5)]
    assert checks.check_back_to_idle(edge_before, [Sample(99, "edge-00", 3, 0, 30, 5, idle_edge)]).passed
    leaking = checks.check_back_to_idle(edge_before, [Sample(99, "edge-00", 3, 0, 30, 5, idle_edge | {"spade_edge_draft_sessions": 2})])
    assert leaking.violations == ("edge-00: 2 draft sessions still live (each holds a draft KV cache)",)


def test_per_minute_latency_and_rate():
    records = [record(STREAM, started=s, ended=s + 1) for s in (1, 2, 3, 61, 62)]
    minutes = checks.per_minute(records)
    assert [(m.minute, m.num_requests) for m in minutes] == [(0, 3), (1, 2)]
    assert minutes[0].tokens_per_s == pytest.approx(9 / 60)
    assert checks.percentile([1.0, 2.0, 3.0], 50) == 2.0 and checks.percentile([], 50) is None


def run_checks(records, samples, references) -> list[checks.Check]:
    """The checks the run makes of what it saw, in its order (``run.run_started``)."""
    return [
        checks.check_greedy_exact(records, references),
        checks.check_no_server_errors(records),
        checks.check_errors_shaped(records),
        checks.check_not_hung(records, 60),
        checks.check_failures_in_windows(records, [], recovery_bound_s=30),
        checks.check_fault_expectations([], []),
        checks.check_flat(samples, warm_s=20, load_end_s=90),
    ]


PLANTED = {  # what is planted, and the checks it must break
    "a wrong token": ([record(STREAM, text="abcdeX")], ["greedy text is target-only's"]),
    # a 500 with no fault running is also a failure outside every fault's window
    "an HTTP 500": ([record(STREAM, "failed", status=500)], ["no HTTP 500", "failures only inside fault windows"]),
    "a hang": ([record(STREAM, "hung")], ["no hung request"]),
    "a leak": ([], ["memory and descriptors flat after warm-up"]),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_the_run_exits_non_zero_naming_what_was_planted(planted, tmp_path):
    """One planted fault in an otherwise clean run: the exit status CI reads is 1 and the last
    lines name the checks it broke (and no other)."""
    references = {STREAM.reference_key(): "abcdef"}
    clean = [record(STREAM, text="abcdef")]
    flat = series("edge-00", 10, [300] * 8, [40] * 8)
    leaking = series("edge-00", 10, [300, 310, 320, 330, 340, 350, 360, 370], [40] * 8)
    assert run.verdict(run_checks(clean, flat, references), tmp_path / "report.md")[0] == 0
    extra, broken = PLANTED[planted]
    results = run_checks(clean + extra, leaking if planted == "a leak" else flat, references)
    status, lines = run.verdict(results, tmp_path / "report.md")
    assert status == 1
    assert lines[0].startswith(f"chaos: FAILED: {', '.join(broken)} (report: ")
    assert [line.split(":")[1].strip() for line in lines[1:]] == broken


def test_faults_delayed_by_the_ones_before_them_still_run_in_order_and_the_runner_says_when_it_is_done():
    import concurrent.futures
    import time

    from spade_bench.chaos.faults import FaultRunner, LoadHooks

    origin = time.monotonic()
    bursts: list[int] = []

    def burst(edge: int) -> concurrent.futures.Future:  # each burst outlasts the interval between the plans
        time.sleep(0.15)
        bursts.append(edge)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_result(None)
        return future

    plans = [FaultPlan("rate_burst", 0.05 * i, 0.0, target=i) for i in range(4)]
    hooks = LoadHooks(burst, lambda: None, lambda edge: True)
    runner = FaultRunner(None, plans, lambda: time.monotonic() - origin, hooks, recovery_bound_s=5, start_bound_s=5)
    assert runner.finished_at_s is None
    runner.start()
    deadline = time.monotonic() + 10
    while runner.finished_at_s is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert bursts == [0, 1, 2, 3]
    assert [record.kind for record in runner.records] == ["rate_burst"] * 4
    assert runner.finished_at_s is not None and runner.finished_at_s >= 0.6
    assert all(record.recovered_s is not None for record in runner.records)
