"""The detector's RoIAlign (issue 34's training speed): torchvision's forward pass, a
vectorised backward pass that gives torchvision's gradient."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
import torchvision
from torchvision.ops import roi_align as torchvision_roi_align

from splitvit.model.roi_align import MultiScaleRoIAlign, roi_align, roi_align_backward


def random_rois(generator: torch.Generator, images: int, count: int, height: int, width: int, scale: float):
    """RoIs (batch index first) in image pixels, some past the map's edges, some smaller
    than a feature pixel, some larger than the map."""
    size = torch.tensor([width, height, width, height], dtype=torch.float64) / scale
    corner = torch.rand(count, 2, generator=generator, dtype=torch.float64) * (size[:2] + 8) - 6
    extent = torch.rand(count, 2, generator=generator, dtype=torch.float64) * size[:2] * 1.5
    extent[: count // 4] *= 0.05  # below one feature pixel
    index = torch.randint(0, images, (count, 1), generator=generator).double()
    return torch.cat([index, corner, corner + extent], dim=1)


CASES = [  # (images, channels, height, width, rois, output size, scale, sampling ratio, aligned)
    (2, 3, 9, 13, 11, (7, 7), 0.5, 2, False),
    (1, 4, 16, 16, 7, (14, 14), 0.25, 2, False),
    (3, 2, 5, 4, 9, (3, 5), 1.0, 1, False),
    (2, 5, 12, 7, 10, (4, 4), 0.125, 3, True),
    (2, 3, 1, 1, 5, (2, 2), 0.125, 2, False),  # a one-pixel map: every sample clamps to it
]


@pytest.mark.parametrize("images,channels,height,width,count,output,scale,ratio,aligned", CASES)
def test_gradient_is_torchvisions(images, channels, height, width, count, output, scale, ratio, aligned):
    generator = torch.Generator().manual_seed(count * height + width)
    features = torch.randn(images, channels, height, width, dtype=torch.float64, generator=generator)
    features.requires_grad_(True)
    rois = random_rois(generator, images, count, height, width, scale)
    expected = torchvision_roi_align(features, rois, output, scale, ratio, aligned)
    pooled = roi_align(features, rois, output, scale, ratio, aligned)
    assert torch.equal(pooled, expected)  # the forward pass is torchvision's own
    grad_output = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    (want,) = torch.autograd.grad(expected, features, grad_output)
    (got,) = torch.autograd.grad(pooled, features, grad_output)
    assert want.abs().sum() > 0
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)


def test_gradient_passes_gradcheck():
    """RoIAlign is linear in its features: finite differences check the backward pass
    without torchvision's."""
    generator = torch.Generator().manual_seed(3)
    features = torch.randn(2, 2, 6, 7, dtype=torch.float64, generator=generator, requires_grad=True)
    rois = random_rois(generator, 2, 6, 6, 7, 0.5)
    assert torch.autograd.gradcheck(lambda f: roi_align(f, rois, (3, 3), 0.5, 2), (features,))


def test_no_rois_give_a_zero_gradient():
    features = torch.randn(2, 3, 8, 8, requires_grad=True)
    rois = torch.zeros(0, 5)
    pooled = roi_align(features, rois, (7, 7), 0.5, 2)
    assert pooled.shape == (0, 3, 7, 7)
    pooled.sum().backward()
    assert torch.equal(features.grad, torch.zeros_like(features))
    assert torch.equal(roi_align_backward(pooled, rois, features.shape, (7, 7), 0.5, 2), torch.zeros_like(features))


@pytest.mark.parametrize(
    "why,features,ratio",
    [
        ("no gradient asked", torch.randn(1, 2, 8, 8), 2),
        ("adaptive sampling grid", torch.randn(1, 2, 8, 8, requires_grad=True), 0),
        ("half precision", torch.randn(1, 2, 8, 8, dtype=torch.float16, requires_grad=True), 2),
    ],
)
def test_other_cases_are_torchvisions_op(why, features, ratio):
    rois = torch.tensor([[0.0, 1.0, 2.0, 9.0, 12.0]], dtype=features.dtype)
    pooled = roi_align(features, rois, (3, 3), 0.5, ratio)
    assert pooled.grad_fn is None or type(pooled.grad_fn).__name__ != "_RoIAlignBackward", why
    assert torch.equal(pooled, torchvision_roi_align(features, rois, (3, 3), 0.5, ratio))


def test_multiscale_pool_matches_torchvisions():
    """The detector's pools: torchvision's levels, scales and level mapping, its outputs
    bit for bit, its gradients up to rounding, on a 64-px canvas's pyramid."""
    generator = torch.Generator().manual_seed(7)
    names = ["0", "1", "2", "3"]
    maps = OrderedDict(
        (name, torch.randn(2, 4, 32 >> i, 32 >> i, dtype=torch.float64, generator=generator).requires_grad_(True))
        for i, name in enumerate(names)
    )
    boxes = []
    for count in (13, 6):
        corner = torch.rand(count, 2, generator=generator, dtype=torch.float64) * 48
        size = 2 + torch.rand(count, 2, generator=generator, dtype=torch.float64) * 40
        boxes.append(torch.cat([corner, (corner + size).clamp(max=64)], dim=1))
    options = dict(output_size=7, sampling_ratio=2, canonical_scale=14, canonical_level=3)
    ours = MultiScaleRoIAlign(names, **options)
    theirs = torchvision.ops.MultiScaleRoIAlign(names, **options)
    pooled, expected = ours(maps, boxes, [(64, 64)] * 2), theirs(maps, boxes, [(64, 64)] * 2)
    assert torch.equal(pooled, expected)
    assert ours.scales == theirs.scales
    levels = ours.map_levels(boxes)
    assert len(levels.unique()) >= 3  # the boxes spread over the pyramid
    grad_output = torch.randn(expected.shape, dtype=torch.float64, generator=generator)
    want = torch.autograd.grad(expected, list(maps.values()), grad_output)
    got = torch.autograd.grad(pooled, list(maps.values()), grad_output)
    for level_want, level_got in zip(want, got):
        torch.testing.assert_close(level_got, level_want, rtol=1e-12, atol=1e-12)


def test_rois_in_chunks_give_the_same_gradient(monkeypatch):
    """A small working-memory bound puts the RoIs through the backward pass a few at a
    time (a large RoI's window sets every RoI's span): the gradient is the same."""
    import splitvit.model.roi_align as module

    generator = torch.Generator().manual_seed(11)
    features = torch.randn(2, 3, 12, 12, dtype=torch.float64, generator=generator, requires_grad=True)
    rois = random_rois(generator, 2, 9, 12, 12, 0.5)
    grad_output = torch.randn(9, 3, 7, 7, dtype=torch.float64, generator=generator)
    (want,) = torch.autograd.grad(torchvision_roi_align(features, rois, (7, 7), 0.5, 2), features, grad_output)
    monkeypatch.setattr(module, "WINDOW_ELEMENTS", 3 * 12 * 12 * 2)  # 2-5 RoIs per chunk
    (got,) = torch.autograd.grad(roi_align(features, rois, (7, 7), 0.5, 2), features, grad_output)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
