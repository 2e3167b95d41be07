"""The decode kernel against F.linear, and the projection that chooses it."""

from __future__ import annotations

import shutil

import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional

from worker import projection as projection_module  # noqa: E402
from worker.projection import Projection  # noqa: E402
from worker.skinny_linear import MAX_ROWS, SkinnyLinear, load_skinny_linear  # noqa: E402

if shutil.which("c++") is None:
    pytest.skip("no C++ compiler to build the decode kernel with", allow_module_level=True)


@pytest.fixture(scope="module")
def skinny_linear() -> SkinnyLinear:
    kernel = load_skinny_linear()
    assert kernel is not None, "the decode kernel did not build: see the warning logged above"
    return kernel


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
def test_kernel_matches_f_linear(
    skinny_linear: SkinnyLinear, num_rows: int, shape: tuple[int, int], has_bias: bool
) -> None:
    x, weight, bias = operands(num_rows, *shape)
    bias = bias if has_bias else None
    expected = F.linear(x.double(), weight.double(), None if bias is None else bias.double())
    # float32 rounding over up to 3072 products, against a float64 reference.
    torch.testing.assert_close(
        skinny_linear(x, weight, bias), expected.float(), rtol=1e-5, atol=1e-4
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
def test_kernel_rejects_what_it_cannot_compute(
    skinny_linear: SkinnyLinear, x: torch.Tensor, weight: torch.Tensor, message: str
) -> None:
    with pytest.raises(RuntimeError, match=message):
        skinny_linear(x, weight, None)


@pytest.mark.parametrize("num_rows", [1, MAX_ROWS, MAX_ROWS + 1, 40])
def test_projection_matches_f_linear_on_either_side_of_the_kernel(num_rows: int) -> None:
    x, weight, bias = operands(num_rows, 64, 96)
    projection = Projection(weight, bias)
    assert projection.skinny_linear is not None
    y = projection(x.view(num_rows, 1, 64))  # leading dims are kept
    assert y.shape == (num_rows, 1, 96)
    torch.testing.assert_close(y[:, 0], F.linear(x, weight, bias))


def test_projection_without_the_kernel_uses_onednn(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(projection_module, "load_skinny_linear", lambda: None)
    x, weight, bias = operands(3, 64, 96)
    projection = Projection(weight, bias)
    assert projection.skinny_linear is None and projection.is_packed
    torch.testing.assert_close(projection(x), F.linear(x, weight, bias))
