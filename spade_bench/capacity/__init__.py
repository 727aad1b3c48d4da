"""The capacity replay: how many edges one verifier serves, and what each token costs it.

``python -m spade_bench.capacity`` (or ``spade-bench capacity``) records real edge sessions once
(``record``: a recording proxy between one real edge and the verifier), traces the draft's
proposals along each session's target output (``draft_trace``), then runs N emulated edges at
once against one verifier, level by level (``levels``, ``emulated_edge``), beside target-only, and
writes the tables and plots (``report``); ``prefill_interference`` times a long prompt arriving
among verifying sessions. ``sessions`` is the recorded sessions' file format, which the recorder,
the tracer and the replay share; ``replay`` is the command.
"""
