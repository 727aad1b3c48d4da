"""``spade-bench chaos``: many edges for a long time while things break underneath them.

Real edges (subprocesses, their OpenAI APIs) in front of a two-replica verifier pool behind the
shipped nginx config, all on loopback, the tiny pair; some edges reach the pool through a fault
proxy and a delay proxy (their link can be delayed, cut and rewritten). A seeded mix of requests
runs for a set time while faults fire on a seeded schedule; a monitor samples every process from
outside (RSS, file descriptors, sockets) and the services' /metrics. The report checks that
nothing was lost or wrong: greedy text equal to target-only's (or a prefix of it, ended by a clear
error), no HTTP 500, no hung request, every failure inside a fault's window, memory and
descriptors flat after warm-up and back to idle after the load.

    spade-bench chaos --minutes 30 --output chaos_results        # 16 edges, the default
    spade-bench chaos --minutes 3 --output chaos_results         # CI: every kind once, the load on until they are over

Modules: ``plan`` (the configuration, the fault schedule and the request mix: pure), ``stack``
(the processes), ``faults`` (carrying faults out), ``load`` (the clients), ``monitor`` (samples),
``checks`` (pure verdicts over the records), ``report`` (markdown, JSON, plots), ``run`` (the CLI).
"""
