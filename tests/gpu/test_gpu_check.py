"""bench/gpu_check.py, the one-command check of a GPU machine, run as its CPU smoke (`--device cpu --quick`):
every section runs and reports positive figures, lines stream before the final object, a spent budget
skips sections with a reason and still prints the JSON, and the made-up tokenizers decode every id."""

from __future__ import annotations

import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.py"


def _check(*args: str, out: Path, timeout: float) -> tuple[dict, list[dict]]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out-dir", str(out),
                           *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    final = lines[-1]
    assert final["check"] == "gpu_check"
    assert json.loads((out / "gpu_check.json").read_text()) == final
    return final, lines


def _finite(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values)


def _positive(*values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
               for v in values)


@pytest.fixture(scope="module")
def baseline_tree(tmp_path_factory) -> Path:
    """A second source tree for --baseline: a copy of this checkout's package."""
    tree = tmp_path_factory.mktemp("baseline")
    shutil.copytree(ROOT / "servelm", tree / "servelm", ignore=shutil.ignore_patterns("__pycache__", "lib"))
    return tree


@pytest.fixture(scope="module")
def smoke(tmp_path_factory, baseline_tree) -> tuple[dict, list[dict]]:
    out = tmp_path_factory.mktemp("gpu-check")
    return _check("--work", str(out / "work"), "--baseline", str(baseline_tree), "--fp8-shapes", "tiny",
                  "--async-shapes", "tiny", "--mixed-shapes", "tiny", out=out, timeout=400)


@pytest.mark.slow
@pytest.mark.server
def test_every_section_runs_and_passes(smoke):
    final, _ = smoke
    sections = final["sections"]
    assert list(sections) == ["setup", "ceilings", "tests", "tiny", "s1"]
    assert {name: s["status"] for name, s in sections.items()} == dict.fromkeys(sections, "ok")
    assert final["ok"] is True and final["complete"] is True
    assert _positive(final["wall_s"]) and final["wall_s"] <= final["budget_s"]
    for s in sections.values():
        assert _positive(s["cap_s"]) and s["wall_s"] >= 0


@pytest.mark.slow
@pytest.mark.server
def test_figures_are_positive_numbers(smoke):
    sections = smoke[0]["sections"]
    setup = sections["setup"]
    assert setup["torch"] and isinstance(setup["missing_packages"], list)
    assert _positive(sections["ceilings"]["copy_gb_s"], sections["ceilings"]["bf16_tflop_s"])

    tests = sections["tests"]
    assert tests["passed"] >= 1 and tests["failed"] == tests["errors"] == 0 and tests["failing"] == []
    assert tests["skipped"] >= 1  # tests/gpu/test_gpu.py without CUDA

    shape = sections["tiny"]
    assert _positive(shape["w1"]["output_tok_s"], shape["w1"]["requests"], shape["w1"]["output_tokens"])
    tpot = shape["tpot_b1"]
    assert _positive(tpot["ttft_ms"], tpot["bound_ms"])
    # TPOT is a difference of two timings (128 tokens against 1): on a loaded CPU the tiny model's prefill
    # varies by more than its decode takes, so only its being a number is asserted here
    assert _finite(tpot["tpot_ms"], tpot["tpot_over_bound"])
    assert _positive(shape["prefill_2k"]["tflop_s"], shape["prefill_2k"]["ms"], shape["prefill_2k"]["of_peak"])
    assert shape["prefill_2k"]["prompt_tokens"] == 2048
    sampled = shape["w1_sampled"]
    assert (sampled["temperature"], sampled["top_p"]) == (0.8, 0.95)
    assert _positive(sampled["greedy_tok_s"], sampled["sampled_tok_s"], sampled["sampled_over_greedy"])
    attention = shape["decode_attention"]  # the decode attention kernels, interpreted: a smoke of the figure
    assert [(r["batch"], r["context"]) for r in attention["runs"]] == [(1, 64), (2, 64)]
    for r in attention["runs"]:
        assert _positive(r["single_ms"], r["split_ms"], r["single_over_split"], r["splits"])
    assert attention["runs"][0]["splits"] > 1  # one row of two KV heads: the split-KV path ran
    prefill = shape["prefill_attention"]  # the prompt-chunk tilings, interpreted: a smoke of the figure
    assert [(r["block_m"], r["q_len"]) for r in prefill["runs"]] == [(prefill["default"]["block_m"], 32), (128, 32)]
    assert all(_positive(r["ms"], r["tflop_s"]) for r in prefill["runs"])
    assert prefill["best_32_of_32"]["speedup_over_default"] >= 1
    big = shape["w1_big"]
    assert _positive(big["output_tok_s"], big["total_tok_s"], big["compute_bound_s"], big["of_bound"])
    assert big["total_tok_s"] > big["output_tok_s"]  # the prompts' tokens count in the total

    s1 = sections["s1"]
    assert _positive(s1["ready_s"])
    assert [r["rate"] for r in s1["rates"]] == [8.0, 16.0, 32.0]
    for row in s1["rates"]:
        assert row["status"] == "ok" and row["completed"] == row["requests"] and row["failed"] == 0
        assert _positive(row["output_tok_s"], row["client_itl_ms"]["mean"], row["client_itl_ms"]["p50"],
                         row["client_itl_ms"]["p99"])
        server = row["server_itl_ms"]  # from the server's own histogram, between two scrapes of /metrics
        assert _positive(server["count"], server["mean"], server["p50"], server["p99"])
        assert _positive(row["client_over_server_mean"])


@pytest.mark.slow
@pytest.mark.server
def test_figures_stream_as_json_lines_before_the_final_object(smoke):
    final, lines = smoke
    assert lines[0]["sections"] == list(final["sections"])
    figures = {(line["section"], line["figure"]) for line in lines if "figure" in line}
    assert {("ceilings", "ceilings"), ("tiny", "w1"), ("tiny", "decode_attention"), ("tiny", "w1_big"),
            ("s1", "rate 8")} <= figures
    done = [line["section"] for line in lines if line.get("done")]
    assert done == list(final["sections"])
    assert any(line.get("section") == "tests" and line.get("outcome") == "PASSED" for line in lines)


def test_a_spent_budget_skips_the_rest_with_the_reason(tmp_path):
    final, _ = _check("--budget-s", "1", "--work", str(tmp_path / "work"), out=tmp_path, timeout=120)
    sections = final["sections"]
    assert sections["setup"]["status"] == "ok"
    for name in ("ceilings", "tests", "tiny", "s1"):
        assert sections[name]["status"] == "skipped"
        assert sections[name]["reason"].startswith("time budget")


def test_every_id_of_a_made_up_tokenizer_decodes_to_text(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    from gpu_check import write_tokenizer
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "tok", 1000))
    assert len(tok) == 1000
    assert (tok.bos_token_id, tok.eos_token_id) == (1, 2)
    texts = [tok.decode([i]) for i in range(4, 1000)]
    assert all(texts) and texts[-1] == "<x999>"
    assert tok.decode(tok("print('hi')", add_special_tokens=False)["input_ids"]) == "print('hi')"
    # a base tokenizer (here the one just made) is padded to a larger vocabulary, its own ids unchanged
    padded = AutoTokenizer.from_pretrained(write_tokenizer(tmp_path / "padded", 1500, base=tmp_path / "tok"))
    assert len(padded) == 1500 and padded.decode([1499]) == "<x1499>" and padded.decode([999]) == "<x999>"


@pytest.mark.slow
@pytest.mark.server
def test_a_baseline_tree_runs_beside_on_the_same_model(smoke, baseline_tree):
    """--baseline: the shape's W1 and TPOT again with servelm imported from the given source tree (a copy of this
    one), and the ratios; the shape's own figures come from this checkout."""
    tiny = smoke[0]["sections"]["tiny"]
    base = tiny["baseline"]
    assert base["status"] == "ok" and base["src"] == str(baseline_tree)
    assert base["load"]["servelm"] == str(baseline_tree / "servelm")
    assert tiny["load"]["servelm"] == str(ROOT / "servelm")
    assert base["w1"]["requests"] == tiny["w1"]["requests"] and _positive(base["w1"]["output_tok_s"])
    assert _positive(base["w1_speedup"]) and _finite(base["tpot_b1"]["tpot_ms"], base["tpot_b1_speedup"])
    assert base["w1_speedup"] == round(tiny["w1"]["output_tok_s"] / base["w1"]["output_tok_s"], 3)
    assert "prefill_2k" not in base  # W1 and TPOT only


@pytest.mark.slow
@pytest.mark.server
def test_an_fp8_variant_runs_beside_on_the_same_model(smoke):
    """--fp8-shapes: the shape's batch-1 TPOT and 2k prefill again with fp8 weights, its bound at one byte a
    linear weight (so below the bf16 bound), the speed-ups over this tree's bf16 figures, and the shape's
    four linears timed alone on each fp8 path (interpreted here: a smoke of the figure)."""
    tiny = smoke[0]["sections"]["tiny"]
    fp8 = tiny["fp8"]
    assert fp8["status"] == "ok" and "w1" not in fp8
    assert _finite(fp8["tpot_b1"]["tpot_ms"], fp8["tpot_b1_speedup"])
    assert _positive(fp8["prefill_2k"]["ms"],
                     fp8["prefill_2k_speedup"])
    assert fp8["tpot_b1"]["bytes_per_step_gb"] <= tiny["tpot_b1"]["bytes_per_step_gb"]
    assert fp8["prefill_2k_speedup"] == round(tiny["prefill_2k"]["ms"] / fp8["prefill_2k"]["ms"], 3)
    linears = tiny["fp8_linear"]
    assert [(r["linear"], r["rows"]) for r in linears["runs"]] == [
        (name, rows) for name in ("qkv", "o_proj", "gate_up", "down_proj") for rows in (1, 2)]
    for r in linears["runs"]:
        assert _positive(r["bf16_ms"], r["weight_only_ms"], r["scaled_mm_ms"], r["weight_only_gb_s"],
                         r["fastest_fp8_over_bf16"])
        assert r["fastest_fp8"] in ("weight_only", "scaled_mm")
    tuning = tiny["fp8_tuning"]
    default = tuning["default"]
    assert default["gemv_rows"] == 0 and tuning["runs"][0] == {**tuning["runs"][0], **default, "kernel": "dot"}
    assert tuning["runs"][1]["kernel"] == "gemv" and tuning["runs"][1]["gemv_rows"] >= 1
    assert all(_positive(r["ms"], r["gb_s"]) for r in tuning["runs"])
    best = tuning["best_1_rows"]
    assert best["ms"] == min(r["ms"] for r in tuning["runs"]) and best["speedup_over_default"] >= 1


@pytest.mark.slow
@pytest.mark.server
def test_a_step_by_step_variant_runs_beside_on_the_same_model(smoke):
    """--async-shapes: the shape's W1 and batch-1 TPOT again step by step (--no-async-scheduling), and the
    default's speed-ups over them."""
    tiny = smoke[0]["sections"]["tiny"]
    stepwise = tiny["async"]
    assert stepwise["status"] == "ok" and "prefill_2k" not in stepwise
    assert stepwise["w1"]["requests"] == tiny["w1"]["requests"] and _positive(stepwise["w1_speedup"])
    assert _finite(stepwise["tpot_b1"]["tpot_ms"], stepwise["tpot_b1_speedup"])
    assert stepwise["w1_speedup"] == round(tiny["w1"]["output_tok_s"] / stepwise["w1"]["output_tok_s"], 3)


@pytest.mark.slow
@pytest.mark.server
def test_a_mixed_step_graphs_variant_runs_beside_on_the_same_model(smoke):
    """--mixed-shapes: the shape's W1 and 2k prefill again with --cuda-graph-mixed-tokens (on the CPU the
    setting changes nothing: the wiring is what runs), and the speed-ups over this tree's figures."""
    tiny = smoke[0]["sections"]["tiny"]
    mixed = tiny["mixed"]
    assert mixed["status"] == "ok" and "tpot_b1" not in mixed
    assert _positive(mixed["w1_speedup"], mixed["prefill_2k_speedup"])
    assert mixed["prefill_2k_speedup"] == round(tiny["prefill_2k"]["ms"] / mixed["prefill_2k"]["ms"], 3)
