"""The KV-aware router: block-hash indexers, in-flight load tracking, latency-minimising selection,
the OpenAI frontend, and the trace-replay simulator that compares routing policies.

Pure logic (``slots``, ``indexer``, ``approx``, ``sequences``, ``policies``, ``core``) has no I/O;
``frontend``, ``discovery``, ``kv_sync`` and ``replica_sync`` are the edges.
"""
