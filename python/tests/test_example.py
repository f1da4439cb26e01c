"""examples/moe_layer.py runs (NumPy here, PyTorch where it exists) and its DeepEP/DeepGEMM-style
step agrees with its float64 evaluation to FP8 precision (a misrouted token would be off by ~100%)."""

import importlib.util
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "moe_layer.py"


def test_example_moe_layer(capsys):
    spec = importlib.util.spec_from_file_location("moe_layer_example", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    err = example.main(["--numpy", "--ranks", "2", "--tokens", "4"])
    # Two FP8 activation quantisations (1x128, 3 mantissa bits) against unquantised float64: a few %.
    assert err < 0.08
    assert "recv_count" in capsys.readouterr().out
