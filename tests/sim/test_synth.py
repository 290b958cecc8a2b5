"""The workload synthesizer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from copse.sim.cli import synth
from copse.sim.synth import ROOT, PrefixModel, SynthKnobs
from copse.sim.trace import TraceRequest


def _request(t: float, ids: tuple[int, ...], length: int, output: int = 10) -> TraceRequest:
    return TraceRequest(timestamp_ms=t, input_length=length, output_length=output, hash_ids=ids)


# Block 0 is a system prompt everyone shares; 1 is shared by two conversations; 2, 3, 4 are unique.
TRACE = [
    _request(0, (0, 1, 2), 1500, 5),
    _request(100, (0, 1, 3), 1200, 7),
    _request(300, (0, 4), 600, 9),
]


def test_learning_keeps_shared_blocks_and_where_contexts_end() -> None:
    model = PrefixModel.learn(TRACE, block_size=512)
    assert set(model.tree.nodes) == {ROOT, 0, 1}
    assert model.tree.nodes[1]["ends"] == 2  # two requests' shared context ends at block 1
    assert model.tree.nodes[0]["ends"] == 1
    assert sorted(model.user_prompt_lengths.tolist()) == [88, 176, 476]
    assert model.gaps_ms.tolist() == [100.0, 200.0]


def test_sampling_reproduces_context_shapes_and_is_deterministic() -> None:
    model = PrefixModel.learn(TRACE, block_size=512)
    knobs = SynthKnobs(num_requests=300, seed=4)
    sampled = model.sample(knobs)
    assert sampled == model.sample(knobs)
    contexts = {r.hash_ids[: r.context_len // 512] for r in sampled}
    assert contexts == {(0,), (0, 1)}
    share_01 = sum(r.context_len == 1024 for r in sampled) / len(sampled)
    assert share_01 == pytest.approx(2 / 3, abs=0.1)
    for r in sampled:
        assert r.input_length == r.context_len + r.unique_user_prompt_len
        assert len(r.hash_ids) == -(-r.input_length // 512)
        assert r.unique_user_prompt_len in (88, 176, 476)
        assert r.output_length in (5, 7, 9)
    own = [r.hash_ids[r.context_len // 512 :] for r in sampled]
    flat = [block for blocks in own for block in blocks]
    assert len(flat) == len(set(flat))  # user prompts never share blocks
    assert all(b.timestamp_ms - a.timestamp_ms in (100.0, 200.0) for a, b in itertools.pairwise(sampled))


def test_knobs_scale_what_they_name() -> None:
    model = PrefixModel.learn(TRACE, block_size=512)
    base = model.sample(SynthKnobs(num_requests=200, seed=1))
    longer = model.sample(SynthKnobs(num_requests=200, seed=1, prefix_len_multiplier=2.0))
    assert [r.context_len * 2 for r in base] == [r.context_len for r in longer]
    # expanded contexts are still shared: equal original contexts give equal expanded ones
    by_context: dict[int, set[tuple[int, ...]]] = {}
    for r in longer:
        by_context.setdefault(r.context_len, set()).add(r.hash_ids[: r.context_len // 512])
    assert all(len(v) == 1 for v in by_context.values())
    prompts = model.sample(SynthKnobs(num_requests=200, seed=1, prompt_len_multiplier=0.5))
    assert [round(r.unique_user_prompt_len * 0.5) or 1 for r in base] == [
        r.unique_user_prompt_len for r in prompts
    ]
    outputs = model.sample(SynthKnobs(num_requests=200, seed=1, osl_multiplier=3.0))
    assert [r.output_length * 3 for r in base] == [r.output_length for r in outputs]
    faster = model.sample(SynthKnobs(num_requests=200, seed=1, speedup_ratio=4.0))
    assert faster[-1].timestamp_ms == pytest.approx(base[-1].timestamp_ms / 4)
    roots = model.sample(SynthKnobs(num_requests=200, seed=1, prefix_root_multiplier=3))
    assert len({r.hash_ids[0] for r in roots}) == 3  # three copies of the system prompt


def test_bad_knobs_are_refused() -> None:
    with pytest.raises(ValueError, match="speedup_ratio must be a positive number"):
        SynthKnobs(speedup_ratio=0)
    with pytest.raises(ValueError, match="prefix_root_multiplier must be at least 1"):
        SynthKnobs(prefix_root_multiplier=0)


def test_synth_cli_writes_mooncake_jsonl(tmp_path: Path) -> None:
    source = tmp_path / "trace.jsonl"
    source.write_text(
        "".join(
            json.dumps(
                {
                    "timestamp": r.timestamp_ms,
                    "input_length": r.input_length,
                    "output_length": r.output_length,
                    "hash_ids": list(r.hash_ids),
                }
            )
            + "\n"
            for r in TRACE
        )
    )
    out = tmp_path / "synth.jsonl"
    result = CliRunner().invoke(
        synth, ["--trace", str(source), "--out", str(out), "--num-requests", "20", "--osl-multiplier", "2"]
    )
    assert result.exit_code == 0, result.output
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 20
    assert set(rows[0]) == {
        "timestamp",
        "input_length",
        "output_length",
        "hash_ids",
        "context_len",
        "unique_user_prompt_len",
    }
    bad = CliRunner().invoke(synth, ["--trace", str(source), "--speedup", "-1"])
    assert bad.exit_code == 2
    assert "speedup_ratio must be a positive number" in bad.stderr
