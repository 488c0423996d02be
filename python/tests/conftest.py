"""Shared setup of the nanguard pytest suite."""
import pytest
import torch


@pytest.fixture(autouse=True)
def _seed():
    """Every test starts from the same RNG state and 2 threads."""
    torch.manual_seed(0)
    torch.set_num_threads(2)


NO_CUDA = "no CUDA device found: the CUDA half of this test compares with the CPU one on the GPU machine " \
          "(bench/gpu/run.sh)"
cuda_only = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_CUDA)


@pytest.fixture(params=["cpu", pytest.param("cuda", marks=cuda_only)])
def on_device(request):
    """Runs the test once per device, with that device as torch's default
    (factories and modules made inside the test land on it); the CUDA run
    skips, saying why, where no GPU is found."""
    torch.set_default_device(request.param)
    yield request.param
    # None, not "cpu": a default device is a TorchFunctionMode, which turns
    # fused fast paths off (nn.TransformerEncoderLayer's) for the tests after.
    torch.set_default_device(None)
