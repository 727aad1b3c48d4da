"""The verifier's access log leaves out successful verify calls (tens a second per edge, counted
on /metrics) and keeps everything else: failed verify calls, the other routes."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time

import httpx

from deploy_support import free_port
from gateway.cli import QuietAccessLog
from verifier_support import verify_body


def _access_record(path: str, status: int) -> logging.LogRecord:
    """A record as uvicorn's access logger makes it."""
    return logging.LogRecord(
        "uvicorn.access", logging.INFO, __file__, 1, '%s - "%s %s HTTP/%s" %d', ("127.0.0.1:5", "POST", path, "1.1", status), None
    )


def test_the_filter_drops_successful_calls_to_its_paths_only():
    quiet = QuietAccessLog(("/v1/verify",))
    assert not quiet.filter(_access_record("/v1/verify", 200))
    assert not quiet.filter(_access_record("/v1/verify?trace=1", 200))
    assert quiet.filter(_access_record("/v1/verify", 409))  # failures stay in the log
    assert quiet.filter(_access_record("/v1/chat/completions", 200))
    assert quiet.filter(logging.LogRecord("uvicorn.access", logging.INFO, __file__, 1, "no args", None, None))


def test_a_path_with_a_star_matches_by_its_ending():
    quiet = QuietAccessLog(("/v1/verify", "*/proposals"))
    assert not quiet.filter(_access_record("/v1/pipeline/sessions/s-1/proposals", 204))
    assert quiet.filter(_access_record("/v1/pipeline/sessions/s-1/proposals", 404))
    assert quiet.filter(_access_record("/v1/pipeline/sessions/s-1/decided", 200))


def test_the_verifier_logs_failed_verify_calls_and_other_routes_but_not_successful_verify_calls(tiny_pair):
    port = free_port()
    command = [sys.executable, "-c", "import sys; from verifier_service.cli import main; sys.exit(main())"]
    command += ["--model", str(tiny_pair.target_dir), "--host", "127.0.0.1", "--port", str(port)]
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline and process.poll() is None, "the verifier did not start"
            time.sleep(0.2)
        ok = httpx.post(url + "/v1/verify", json=verify_body("logged-session", [], [5, 6], new_tokens=[3, 4]), timeout=30)
        assert ok.status_code == 200, ok.text
        stale = httpx.post(url + "/v1/verify", json=verify_body("logged-session", [9, 9, 9], [5]), timeout=30)
        assert stale.status_code == 409, stale.text  # the verifier does not hold that context
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=60)
    access_lines = [line for line in output.splitlines() if '"POST /v1/verify' in line or '"GET /health' in line]
    assert any('"GET /health' in line and " 200" in line for line in access_lines), output[-3000:]
    assert any('"POST /v1/verify' in line and " 409" in line for line in access_lines), output[-3000:]
    assert not any('"POST /v1/verify' in line and " 200" in line for line in access_lines), output[-3000:]
