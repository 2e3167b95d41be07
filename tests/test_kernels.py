"""The decode kernels against torch's own ops, and the code that chooses them."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from tests.model_fixtures import tiny_engine  # noqa: E402
from worker import projection as projection_module  # noqa: E402
from worker.kernels import MAX_ROWS, Kernels, build_directory, load_kernels  # noqa: E402
from worker.projection import Projection  # noqa: E402

if shutil.which("c++") is None:
    pytest.skip("no C++ compiler to build the decode kernels with", allow_module_level=True)


@pytest.fixture(scope="module")
def kernels() -> Kernels:
    built = load_kernels()
    assert built is not None, "the decode kernels did not build: see the warning logged above"
    return built


def test_a_build_killed_midway_does_not_block_later_loads(kernels: Kernels) -> None:
    """torch's builder leaves its lock file behind when its process is killed; a
    worker that then waited on it would never start."""
    (build_directory() / "lock").touch()
    loaded = subprocess.run(
        [sys.executable, "-c", "from worker.kernels import load_kernels; assert load_kernels()"],
        timeout=120,
        capture_output=True,
        text=True,
    )
    assert loaded.returncode == 0, loaded.stderr
    assert not (build_directory() / "lock").exists()


# --- skinny_linear ------------------------------------------------------------------


def operands(
    num_rows: int, in_features: int, out_features: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(num_rows, in_features, generator=generator)
    weight = torch.randn(out_features, in_features, generator=generator)
    bias = torch.randn(out_features, generator=generator)
    return x, weight, bias


@pytest.mark.parametrize("num_rows", range(1, MAX_ROWS + 1))
# Out features that leave every remainder of the kernel's row blocks (4 and 8),
# and a width of one vector.
@pytest.mark.parametrize("shape", [(16, 1), (64, 37), (768, 2305), (3072, 70)])
@pytest.mark.parametrize("has_bias", [True, False])
def test_skinny_linear_matches_f_linear(
    kernels: Kernels, num_rows: int, shape: tuple[int, int], has_bias: bool
) -> None:
    x, weight, bias = operands(num_rows, *shape)
    bias = bias if has_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 rounding over up to 3072 products, against a float64 reference.
    torch.testing.assert_close(
        kernels.skinny_linear(x, weight, bias), expected.float(), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize(
    ("x", "weight", "message"),
    [
        (torch.zeros(MAX_ROWS + 1, 16), torch.zeros(4, 16), "1 to 8 rows"),
        (torch.zeros(2, 20), torch.zeros(4, 20), "multiple of 16"),
        (torch.zeros(2, 16), torch.zeros(4, 32), "in_features must match"),
        (torch.zeros(16, 2).t(), torch.zeros(4, 16), "contiguous"),
        (torch.zeros(2, 16, dtype=torch.float64), torch.zeros(4, 16), "float32"),
    ],
)
def test_skinny_linear_rejects_what_it_cannot_compute(
    kernels: Kernels, x: torch.Tensor, weight: torch.Tensor, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        kernels.skinny_linear(x, weight, None)


@pytest.mark.parametrize("num_rows", [1, MAX_ROWS, MAX_ROWS + 1, 40])
def test_projection_takes_the_kernel_up_to_its_rows_and_onednn_above(num_rows: int) -> None:
    x, weight, bias = operands(num_rows, 64, 96)
    projection = Projection(weight, bias)
    kernel = projection.skinny_linear
    assert kernel is not None
    kernel_rows: list[int] = []

    def counting_kernel(
        rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> torch.Tensor:
        kernel_rows.append(rows.shape[0])
        return kernel(rows, weight, bias)

    projection.skinny_linear = counting_kernel
    y = projection(x.view(num_rows, 1, 64))  # leading dims are kept
    assert y.shape == (num_rows, 1, 96)
    torch.testing.assert_close(y[:, 0], F.linear(x, weight, bias))
    assert kernel_rows == ([num_rows] if num_rows <= MAX_ROWS else [])


def test_projection_without_the_kernel_uses_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projection_module, "load_kernels", lambda: None)
    x, weight, bias = operands(3, 64, 96)
    projection = Projection(weight, bias)
    assert projection.skinny_linear is None and projection.is_packed
    torch.testing.assert_close(projection(x), F.linear(x, weight, bias))


# --- decode_attention ---------------------------------------------------------------


def cache_views(
    num_rows: int, num_heads: int, length: int, head_dim: int, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (R, H, D), and keys and values as the slot cache hands them out: the first
    ``length`` of 3 * length positions, so each head's (L, D) block is contiguous
    but rows and heads are strided."""
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(num_rows, num_heads, head_dim, generator=generator)
    kv = torch.randn(2, num_rows, num_heads, 3 * length, head_dim, generator=generator)
    return q, kv[0, :, :, :length], kv[1, :, :, :length]


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
def test_decode_attention_matches_masked_sdpa(kernels: Kernels, head_dim: int) -> None:
    q, keys, values = cache_views(num_rows=5, num_heads=3, length=40, head_dim=head_dim)
    lengths = torch.tensor([40, 1, 17, 39, 2])
    visible = (torch.arange(40)[None, :] < lengths[:, None])[:, None, None, :]  # (R, 1, 1, L)
    expected = F.scaled_dot_product_attention(q[:, :, None], keys, values, attn_mask=visible)
    got = kernels.decode_attention(q, keys, values, lengths)
    torch.testing.assert_close(got, expected[:, :, 0], rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_nothing_past_a_rows_length(kernels: Kernels) -> None:
    q, keys, values = cache_views(num_rows=2, num_heads=2, length=10, head_dim=16)
    lengths = torch.tensor([4, 10])
    before = kernels.decode_attention(q, keys, values, lengths)
    keys[0, :, 4:] = float("nan")
    values[0, :, 4:] = float("nan")
    torch.testing.assert_close(kernels.decode_attention(q, keys, values, lengths), before)


@pytest.mark.parametrize(
    ("lengths", "head_dim", "message"),
    [
        ([0, 3], 16, "outside 1..8"),
        ([9, 3], 16, "outside 1..8"),
        ([8, 3], 48, "head_dim must be"),
    ],
)
def test_decode_attention_rejects_what_it_cannot_compute(
    kernels: Kernels, lengths: list[int], head_dim: int, message: str
) -> None:
    q, keys, values = cache_views(num_rows=2, num_heads=2, length=8, head_dim=head_dim)
    with pytest.raises(RuntimeError, match=message):
        kernels.decode_attention(q, keys, values, torch.tensor(lengths))


@pytest.mark.model
def test_a_float32_cpu_engine_decodes_through_both_kernels() -> None:
    gpt2 = tiny_engine(capacity=2).gpt2
    assert gpt2.decode_attention is not None
    projections = [gpt2.lm_head]
    for layer in gpt2.layers:
        projections += [layer.attn, layer.proj, layer.fc, layer.out]
    assert all(projection.skinny_linear is not None for projection in projections)
