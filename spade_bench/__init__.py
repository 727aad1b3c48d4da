"""The benchmarks, by what a reader runs:

- the one-user benchmark, ``spade-bench`` (``cli``, ``session``, ``runner``, ``client``, ``config``,
  ``data``, ``records``, ``metrics``, ``report``, ``plots``): target-only against SPADE against
  draft-only on Spec-Bench and CNN/DailyMail, through a loopback delay proxy;
- ``capacity``: how many edges one verifier serves (``spade-bench capacity``);
- ``chaos``: many edges for a long time while things break (``spade-bench chaos``);
- ``pool``: the prefix cache behind two replicas and the shipped nginx pool;
- ``micro``: the forward, the kernels, the backends and the drafter, one question each;
- ``gpu_check``: the prepared run for a lent GPU (``scripts/gpu_check``).

Shared by them: ``services`` (starting the services pinned), ``proxy`` and ``fault_proxy`` (the
loopback link, delayed or faulty), ``loopback``, ``nginx_pool`` (the shipped pool config, rendered
and run).
"""
