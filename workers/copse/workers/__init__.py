"""Workers: the wire protocol of a serving engine, the shared perf model, and the GPU-free engine mocker.

Nothing here imports another copse package; the router and the planner import
``copse.workers.protocol``, ``copse.workers.perf`` and ``copse.workers.traces`` (the request-trace reader).
"""
