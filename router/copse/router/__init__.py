"""The KV-aware router: block-hash indexers, in-flight load tracking, latency-minimising selection
and the OpenAI frontend. Its simulations (trace replay, live replay) live in ``copse.sim``.

Pure logic (``slots``, ``indexer``, ``approx``, ``sequences``, ``policies``, ``core``) has no I/O;
``frontend``, ``discovery``, ``kv_sync`` and ``replica_sync`` are the edges.
"""
