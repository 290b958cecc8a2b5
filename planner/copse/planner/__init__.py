"""The SLA planner: forecast load, size the prefill/decode pools to hold TTFT and ITL, patch the
InferenceDeployment; plus a dry run against recorded metrics or traces."""
