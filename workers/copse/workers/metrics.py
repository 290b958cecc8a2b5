"""Prometheus metric names of the workers component, in one place.

Mocked engines export TensorRT-LLM's own names (``tensorrt_llm/metrics/collector.py``), so that
dashboards and the planner read a mocked fleet exactly as they read a real one. The KV relay's
metrics carry copse's prefix.
"""

# trtllm-serve names ----------------------------------------------------------------------------
TTFT_SECONDS = "trtllm_time_to_first_token_seconds"
"""Histogram: request arrival to first token."""
ITL_SECONDS = "trtllm_time_per_output_token_seconds"
"""Histogram: gap between consecutive output tokens of a request."""
E2E_SECONDS = "trtllm_e2e_request_latency_seconds"
"""Histogram: request arrival to last token."""
QUEUE_SECONDS = "trtllm_request_queue_time_seconds"
"""Histogram: request arrival to its first scheduled step."""
PROMPT_TOKENS = "trtllm_prompt_tokens"
"""Counter (exposed with ``_total``): prompt tokens received."""
GENERATION_TOKENS = "trtllm_generation_tokens"
"""Counter (exposed with ``_total``): tokens generated."""
REQUEST_SUCCESS = "trtllm_request_success"
"""Counter (exposed with ``_total``) by ``finished_reason``: requests completed."""
KV_CACHE_UTILIZATION = "trtllm_kv_cache_utilization"
"""Gauge 0..1: fraction of KV blocks referenced by running requests."""
KV_CACHE_HIT_RATE = "trtllm_kv_cache_hit_rate"
"""Gauge 0..1: prompt tokens served from the prefix cache / prompt tokens admitted."""
NUM_REQUESTS_RUNNING = "trtllm_num_requests_running"
"""Gauge: requests in the running batch."""
NUM_REQUESTS_WAITING = "trtllm_num_requests_waiting"
"""Gauge: requests queued (including KV transfers in flight)."""

# copse's mocked engines only ------------------------------------------------------------------
MOCK_STEP_LAG_SECONDS = "copse_mock_step_lag_seconds"
"""Histogram: how long after a step's end (on the engine's own timeline) the mocker's process
delivered its output: the host's lag behind the engines it simulates (0 when it keeps up; tokens
reach clients this much late, the engine itself is not slowed)."""
MOCK_LORA_LOADED = "copse_mock_lora_loaded"
"""Gauge by ``lora_name``: 1 for each LoRA adapter the mocked engine holds (bounded by its
``max_loras``)."""
MOCK_LORA_LOADS = "copse_mock_lora_loads"
"""Counter (``_total``): LoRA adapters the mocked engine loaded (first loads and reloads after an
eviction: what adapter-aware routing saves)."""

# copse KV relay --------------------------------------------------------------------------------
RELAY_EVENTS = "copse_kv_relay_events"
"""Counter (``_total``) by ``type``: copse KV events published by the relay."""
RELAY_ENGINE_EVENTS = "copse_kv_relay_engine_events"
"""Counter (``_total``) by ``type``: TensorRT-LLM events drained (``unknown``: a type the relay does
not know, skipped; ``malformed``: unreadable, counted as lost)."""
RELAY_RESETS = "copse_kv_relay_resets"
"""Counter (``_total``) by ``reason``: times engine events were lost and a reset published (``gap`` in
the event ids, relay ``start`` after the engine, ``restart`` of the engine without its ``created``
event, ``malformed`` event, ``unknown_parent``)."""
RELAY_EXACT = "copse_kv_relay_exact"
"""Gauge: 1 while the relay knows every block the engine holds, 0 after a reset until it proves so."""
RELAY_DROPPED_BLOCKS = "copse_kv_relay_dropped_blocks"
"""Counter (``_total``) by ``reason``: engine blocks the relay could not translate (unknown parent, size)."""
RELAY_POLL_ERRORS = "copse_kv_relay_poll_errors"
"""Counter (``_total``): failed polls of the engine's ``/kv_cache_events``."""

REQUEST_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
"""Buckets (seconds) of the end-to-end and queue-time histograms (``collector.py``'s defaults)."""
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
"""Buckets (seconds) of the time-to-first-token histogram (``collector.py``'s defaults)."""
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
    40.0, 80.0,
)  # fmt: skip
"""Buckets (seconds) of the time-per-output-token histogram (``collector.py``'s defaults)."""
LABELS = ("model_name", "engine_type")
"""Labels of every engine metric (TensorRT-LLM's)."""
