"""The planner and EPLB through the binding: closed forms computed here, the reference EPLB example."""

import math

import numpy as np
import pytest

import moekit

EPLB_WEIGHT = [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86],
               [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
EPLB_PHY2LOG = [[5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
                [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1]]


def test_specs():
    assert "deepseek-v3" in moekit.embedded_models() and "h200" in moekit.embedded_gpus()
    ds = moekit.model_spec("deepseek-v3")
    assert (ds["num_routed_experts"], ds["num_experts_per_token"], ds["hidden_size"]) == (256, 8, 7168)
    with pytest.raises(moekit.Error, match="unknown model 'nope'"):
        moekit.model_spec("nope")


def test_plan_matches_closed_forms():
    spec = moekit.model_spec("deepseek-v3")
    E, k, P = spec["num_routed_experts"], spec["num_experts_per_token"], 8
    result = moekit.plan("deepseek-v3", "h200", P, [1, 64, 256])
    assert result["model"] == "deepseek-v3" and result["ep"] == P
    assert [r["batch"] for r in result["rows"]] == [1, 64, 256]
    for row in result["rows"]:
        B = row["batch"]
        assert row["tokens_per_gpu"] == pytest.approx(B / P)
        assert row["coverage"] == pytest.approx(1 - (1 - k / E) ** B)
        assert row["expected_rows_per_expert"] == pytest.approx(B * k / E)
        assert row["dedup_targets"] == pytest.approx(P * (1 - (1 - 1 / P) ** k))
        assert row["floor_ms"] == pytest.approx(max(row["weight_read_ms"], row["compute_ms"]))
    # The same plan from a dict spec and a batch string.
    again = moekit.plan(spec, moekit.gpu_spec("h200"), P, "1,64,256", tpot_sla="30ms")
    assert again["rows"][2]["coverage"] == result["rows"][2]["coverage"]
    assert again["tpot_sla_ms"] == 30


def test_plan_bad_arguments():
    with pytest.raises(moekit.Error, match="ep"):
        moekit.plan("deepseek-v3", "h200", 0, [1])
    with pytest.raises(moekit.Error):
        moekit.plan("deepseek-v3", "h200", 7, [1])  # 7 does not divide 256 experts
    with pytest.raises(moekit.Error):
        moekit.plan("deepseek-v3", "h200", 8, "abc")
    with pytest.raises(TypeError, match="model must be a spec name"):
        moekit.plan(42, "h200", 8, [1])
    with pytest.raises(TypeError, match="batches must be a list of ints"):
        moekit.plan("deepseek-v3", "h200", 8, [1.5j])


def test_plan_mtp():
    # Qwen3.5-397B-A17B on 8 x H200 with MTP-3 at L = 3.1 (tests/cpu/test_plan.cpp works these by hand):
    # the step of B sequences verifies 4·B tokens; TPOT = floor / 3.1.
    spec = moekit.model_spec("qwen3.5-397b-a17b")
    E, k = spec["num_routed_experts"], spec["num_experts_per_token"]
    result = moekit.plan("qwen3.5-397b-a17b", "h200", 8, [1, 8, 32], mtp=3, accept=3.1)
    assert result["mtp"] == 3 and result["accept_length"] == 3.1 and result["accept_length_is_bound"] is False
    for row, tpot in zip(result["rows"], [0.334162130, 1.607626429, 3.074979378]):
        B = row["batch"]
        assert row["mtp_tokens_per_step"] == 4 * B
        assert row["coverage"] == pytest.approx(1 - (1 - k / E) ** (4 * B))
        assert row["expected_rows_per_expert"] == pytest.approx(4 * B * k / E)
        assert row["tpot_ms"] == pytest.approx(row["floor_ms"] / 3.1)
        assert row["tpot_ms"] == pytest.approx(tpot, rel=1e-8)
        assert row["tokens_per_s"] == pytest.approx(B * 1e3 / row["tpot_ms"])
        assert row["no_mtp"]["mtp_tokens_per_step"] == B
        assert row["tpot_ms_no_mtp"] == row["no_mtp"]["floor_ms"]
        assert row["mtp_speedup"] == pytest.approx(row["tpot_ms_no_mtp"] / row["tpot_ms"])
    # Default L: N + 1, marked as the bound. mtp=0 is the plain plan, key for key.
    assert moekit.plan("qwen3.5-397b-a17b", "h200", 8, [8], mtp=3)["accept_length"] == 4
    assert moekit.plan("deepseek-v3", "h200", 8, [1, 64], mtp=0) == moekit.plan("deepseek-v3", "h200", 8, [1, 64])


def test_plan_mtp_bad_values():
    with pytest.raises(moekit.Error, match=r"--mtp = -1 must be in \[0, 64\]"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=-1)
    with pytest.raises(moekit.Error, match=r"mtp = 100000000000000000000 must be in \[0, 64\]"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=10**20)
    with pytest.raises(moekit.Error, match=r"--accept = 0 must be in \[1, N \+ 1\] = \[1, 4\]"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=3, accept=0)
    with pytest.raises(moekit.Error, match=r"--accept = 5 must be in \[1, N \+ 1\] = \[1, 4\]"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=3, accept=5)
    with pytest.raises(moekit.Error, match=r"accept = 1000000000000000000000.* must be in \[1, mtp \+ 1\]"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=3, accept=10**400)
    with pytest.raises(moekit.Error, match=r"--accept = nan"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=3, accept=float("nan"))
    with pytest.raises(TypeError, match="mtp must be an int.*'3'"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp="3")
    with pytest.raises(TypeError, match="accept must be a number.*'x'"):
        moekit.plan("deepseek-v3", "h200", 8, [8], mtp=3, accept="x")


def test_eplb_reference_example(backend):
    weight = backend.put(np.array(EPLB_WEIGHT, dtype=np.float32))
    phy2log, log2phy, replica_count = moekit.rebalance(weight, 16, 4, 2, 8)
    phy2log, log2phy, replica_count = (backend.get(t) for t in (phy2log, log2phy, replica_count))
    np.testing.assert_array_equal(phy2log, EPLB_PHY2LOG)
    assert phy2log.dtype == np.int64
    for layer in range(2):
        # replica_count and log2phy must describe phy2log: counted and inverted here.
        np.testing.assert_array_equal(replica_count[layer], np.bincount(phy2log[layer], minlength=12))
        for e in range(12):
            slots = [s for s in log2phy[layer, e] if s >= 0]
            assert sorted(slots) == [s for s in range(16) if phy2log[layer, s] == e]
            assert len(slots) == replica_count[layer, e]
    # The reference example's per-GPU loads and balancedness (docs/eplb.md §The reference example).
    report = moekit.balance(weight, moekit.rebalance(weight, 16, 4, 2, 8)[0], 4, 2, 8)
    np.testing.assert_allclose(report["gpu_load_after"][0], [121.5, 86.5, 125, 113, 147.5, 131.5, 156, 152])
    np.testing.assert_allclose(report["gpu_load_after"][1], [173, 179.5, 120.5, 172, 123, 152, 118.5, 117.5])
    np.testing.assert_allclose(report["balancedness_after"], [0.828, 0.805], atol=5e-4)


def test_eplb_alias_and_integer_loads():
    assert moekit.rebalance_experts is moekit.rebalance
    p, _, _ = moekit.rebalance_experts(np.array(EPLB_WEIGHT, dtype=np.int64), 16, 4, 2, 8)
    np.testing.assert_array_equal(p, EPLB_PHY2LOG)


def test_eplb_bad_arguments():
    w = np.array(EPLB_WEIGHT, dtype=np.float64)
    with pytest.raises(moekit.Error, match="num_slots"):
        moekit.rebalance(w, 15, 4, 2, 8)  # not a multiple of 8 GPUs
    with pytest.raises(moekit.Error):
        moekit.rebalance(-w, 16, 4, 2, 8)  # negative loads
    with pytest.raises(ValueError, match=r"weight must have shape \[num_layers=any, num_experts=any\]"):
        moekit.rebalance(w.ravel(), 16, 4, 2, 8)
    with pytest.raises(TypeError, match="weight must have dtype"):
        moekit.rebalance(w.astype(np.complex64), 16, 4, 2, 8)
