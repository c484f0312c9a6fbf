"""The command line loads the default model and answers through the paged runtime."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from kvpool.cli import main


def test_generate_answers_with_the_default_model(capsys):
    assert main(["generate", "What is 2+2?", "--max-tokens", "30", "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    assert "4" in captured.out
    for fact in ("llama", "134.5 M parameters", "46,080 bytes per token", "blocks of 16"):
        assert fact in captured.err


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["generate", "hi", "--model", "no-such-model:7b", "--quiet"]) == 2
    assert "never downloads" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("device", "said"),
    [("mps", "kvpool computes on cpu or cuda"), ("gpu:x", "choose cpu, cuda or cuda:N"),
     ("cuda:64", "CUDA device")],
)  # fmt: skip
def test_a_device_that_is_not_there_is_a_clear_error(capsys, device, said):
    """``--device`` names where the model computes; one torch does not see is refused
    before anything loads (on a machine with fewer than 65 GPUs, any machine here)."""
    assert main(["generate", "hi", "--device", device, "--quiet"]) == 2
    assert said in capsys.readouterr().err


def test_generate_computes_on_the_device_asked_for(capsys):
    assert main(["generate", "hi", "--max-tokens", "2", "--device", "cpu", "--quiet"]) == 0
    assert "compute dtype" in capsys.readouterr().err


def test_load_time_leaves_out_a_native_build(fp32_model, default_model_file):
    """The first start of an install builds the native ops (~30 s): the report names it
    apart instead of calling it load time."""
    from kvpool.model.loader import LoadedModel

    loaded = LoadedModel(default_model_file, fp32_model.config, fp32_model, None, 1.25, 0.3)
    assert "loaded in 1.25 s" in loaded.describe() and "built in" not in loaded.describe()
    loaded.native_seconds = 31.0
    assert "loaded in 1.25 s (native ops built in 31 s, once)" in loaded.describe()


def test_serve_refuses_a_gpu_torch_does_not_see(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("torch sees a CUDA device here")
    assert main(["serve", "--device", "cuda", "--port", "0", "--quiet"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().err
