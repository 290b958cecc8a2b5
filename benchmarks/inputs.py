"""Where the benchmarks find their inputs.

The repository ships slices and small derived files (``examples/traces/``); the benchmarks that
replay whole public traces read them from ``../shared/traces/`` next to the repository (or a
``--trace FILE``), and say where to get a trace that is not there.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHIPPED = REPO / "examples" / "traces"
WHOLE = REPO.parent / "shared" / "traces"
CONVERSATION = WHOLE / "mooncake_fast25_conversation_trace.jsonl.gz"
SYNTHETIC = WHOLE / "mooncake_fast25_synthetic_trace.jsonl.gz"
AZURE_CONVERSATION = WHOLE / "azure_llm_2023_conv.csv.gz"
SLICE = SHIPPED / "mooncake-conversation-first-20min.jsonl.gz"
M_LARGE_RATES = SHIPPED / "servegen_language_m-large_aggregate_rate.csv"

#: Where each whole trace comes from (examples/traces/README.md has commits and checksums).
SOURCES = {
    CONVERSATION.name: "FAST25-release/traces/conversation_trace.jsonl of "
    "https://github.com/kvcache-ai/Mooncake (Apache-2.0)",
    SYNTHETIC.name: "FAST25-release/traces/synthetic_trace.jsonl of "
    "https://github.com/kvcache-ai/Mooncake (Apache-2.0)",
    AZURE_CONVERSATION.name: "data/AzureLLMInferenceTrace_conv.csv of "
    "https://github.com/Azure/AzurePublicDataset (CC-BY-4.0)",
}


def require(path: Path) -> Path:
    """``path`` if it is a file; else exit naming it and how to get it."""
    if path.is_file():
        return path
    source = SOURCES.get(path.name)
    how = f"it is {source}, gzipped; put it there" if source else "give an existing file"
    raise SystemExit(
        f"{path}: no such trace: {how}, or pass --trace FILE where the benchmark takes one "
        f"(the repository ships a 20-minute slice, {SLICE.relative_to(REPO)})"
    )
