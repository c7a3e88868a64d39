"""RoIAlign with a vectorised backward pass, for training Mask R-CNN heads on the CPU.

torchvision's CPU ``roi_align`` backward loops over every (RoI, channel, bin, sample) and
recomputes the same bilinear weights for each channel: on the detection study's detector
it is about 30% of a training step. RoIAlign's sampling weights are separable (a
sample's weight on a cell is its weight along y times its weight along x), so the
gradient of one RoI is ``Ay^T @ G @ Ax`` on a small window of the feature map (``Ay``:
the bins' interpolation weights over the window's rows, ``Ax`` over its columns, ``G``
the RoI's output gradient), added into the map with one ``index_add_``.

The forward pass is torchvision's own op, so outputs (and evaluation) are unchanged bit
for bit; the gradient equals torchvision's up to float rounding (tested). Only float
CPU tensors with ``sampling_ratio > 0`` take this path (every detector here samples 2x2
per bin); CUDA, half precision and the adaptive sampling grid keep torchvision's backward.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torchvision.ops import MultiScaleRoIAlign as _TorchvisionMultiScaleRoIAlign
from torchvision.ops import roi_align as torchvision_roi_align
from torchvision.ops.poolers import _convert_to_roi_format, _filter_input, _setup_scales

#: The backward pass's working tensors (RoIs x window x channels) stay below this many
#: elements (64 MiB in float32): RoIs go through it in chunks.
WINDOW_ELEMENTS = 1 << 24


def roi_align(
    features: Tensor,
    rois: Tensor,
    output_size: tuple[int, int],
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool = False,
) -> Tensor:
    """``torchvision.ops.roi_align`` (``rois``: ``(K, 5)``, batch index first) whose
    gradient with respect to ``features`` is computed by :func:`roi_align_backward`.
    Without a gradient to compute, off the CPU (torchvision's CUDA backward is parallel
    already), in half precision, or with an adaptive sampling grid (``sampling_ratio <=
    0``), it is torchvision's op as it is."""
    vectorised = features.device.type == "cpu" and features.dtype in (torch.float32, torch.float64)
    if sampling_ratio <= 0 or not vectorised or not (torch.is_grad_enabled() and features.requires_grad):
        return torchvision_roi_align(features, rois, output_size, spatial_scale, sampling_ratio, aligned)
    return _RoIAlign.apply(features, rois, tuple(output_size), float(spatial_scale), int(sampling_ratio), aligned)


class _RoIAlign(torch.autograd.Function):
    @staticmethod
    def forward(ctx, features, rois, output_size, spatial_scale, sampling_ratio, aligned):  # type: ignore[override]
        ctx.save_for_backward(rois)
        ctx.options = (features.shape, output_size, spatial_scale, sampling_ratio, aligned)
        return torchvision_roi_align(features, rois, output_size, spatial_scale, sampling_ratio, aligned)

    @staticmethod
    def backward(ctx, grad_output):  # type: ignore[override]
        (rois,) = ctx.saved_tensors
        shape, output_size, spatial_scale, sampling_ratio, aligned = ctx.options
        grad = roi_align_backward(grad_output, rois, shape, output_size, spatial_scale, sampling_ratio, aligned)
        return grad, None, None, None, None, None


def _axis_weights(start: Tensor, length: Tensor, bins: int, grid: int, size: int) -> tuple[Tensor, Tensor]:
    """One axis of RoIAlign's sampling, as torchvision's CPU kernel computes it: for each
    RoI (``start``, ``length``: ``(K,)``, in feature-map pixels) the ``(K, bins, window)``
    interpolation weights each bin's ``grid`` samples put on the window's cells (summed
    over the samples), and each window's first cell ``(K,)``. Samples outside
    ``[-1, size]`` weigh nothing; the others clamp to the map as the kernel does."""
    dtype, device = start.dtype, start.device
    bin_size = length / bins
    offsets = torch.arange(bins, dtype=dtype, device=device)
    samples = (torch.arange(grid, dtype=dtype, device=device) + 0.5).view(1, 1, grid)
    # y = roi_start + ph * bin_size + (iy + .5) * bin_size / grid, in the kernel's order
    coords = (start[:, None] + offsets[None] * bin_size[:, None])[..., None] + samples * bin_size[:, None, None] / grid
    inside = (coords >= -1.0) & (coords <= size)
    coords = coords.clamp(min=0)
    low = coords.floor().long()
    at_edge = low >= size - 1
    low = torch.where(at_edge, size - 1, low)
    high = torch.where(at_edge, low, low + 1)
    frac = torch.where(at_edge, torch.zeros_like(coords), coords - low.to(dtype))
    keep = inside.to(dtype)
    # the window starts at the lowest cell any kept sample reads (the last cell for an RoI with none)
    first = torch.where(inside, low, torch.full_like(low, size)).flatten(1).amin(dim=1).clamp(max=size - 1)
    span = int((torch.where(inside, high, first[:, None, None]) - first[:, None, None]).max()) + 1
    weights = torch.zeros(start.shape[0], bins, span, dtype=dtype, device=device)
    # samples outside the map weigh nothing: clamping their cells keeps them in the window
    weights.scatter_add_(2, (low - first[:, None, None]).clamp(0, span - 1), (1 - frac) * keep)
    weights.scatter_add_(2, (high - first[:, None, None]).clamp(0, span - 1), frac * keep)
    return weights, first


def roi_align_backward(
    grad_output: Tensor,
    rois: Tensor,
    shape: torch.Size | tuple[int, ...],
    output_size: tuple[int, int],
    spatial_scale: float,
    sampling_ratio: int,
    aligned: bool = False,
) -> Tensor:
    """The gradient of ``roi_align`` with respect to its ``shape``-sized features
    (``(N, C, H, W)``), given ``grad_output`` (``(K, C, out_h, out_w)``), the same
    ``rois`` and options; ``sampling_ratio`` > 0."""
    batch, channels, height, width = shape
    grad = grad_output.new_zeros(batch * height * width, channels)
    if rois.shape[0] == 0:
        return grad.view(batch, height, width, channels).permute(0, 3, 1, 2).contiguous()
    out_h, out_w = output_size
    offset = 0.5 if aligned else 0.0
    boxes = rois[:, 1:].to(grad_output.dtype) * spatial_scale - offset
    width_, height_ = boxes[:, 2] - boxes[:, 0], boxes[:, 3] - boxes[:, 1]
    if not aligned:  # the kernel's legacy rule: an RoI is at least one pixel
        width_, height_ = width_.clamp(min=1.0), height_.clamp(min=1.0)
    weights_y, first_y = _axis_weights(boxes[:, 1], height_, out_h, sampling_ratio, height)
    weights_x, first_x = _axis_weights(boxes[:, 0], width_, out_w, sampling_ratio, width)
    # each RoI's window gradient, cells last: Ay^T (span_y x out_h) @ G (out_h x out_w) @ Ax (out_w x span_x)
    scaled = (grad_output / (sampling_ratio * sampling_ratio)).permute(0, 2, 3, 1)  # (K, out_h, out_w, C)
    span_y, span_x = weights_y.shape[2], weights_x.shape[2]
    rows = (first_y[:, None] + torch.arange(span_y, device=rois.device)).clamp(max=height - 1)
    cols = (first_x[:, None] + torch.arange(span_x, device=rois.device)).clamp(max=width - 1)
    # cells past the map's edge carry zero weight; clamping them keeps their (zero) rows in range
    index = (rois[:, 0].long()[:, None, None] * height + rows[:, :, None]) * width + cols[:, None, :]
    # RoIs in chunks, so that a large RoI's window (the span is every RoI's) stays within WINDOW_ELEMENTS
    chunk = max(1, WINDOW_ELEMENTS // (max(span_y, out_h) * max(span_x, out_w) * channels))
    for start in range(0, rois.shape[0], chunk):
        part = slice(start, start + chunk)
        rows_done = torch.bmm(weights_y[part].transpose(1, 2), scaled[part].flatten(2))
        rows_done = rows_done.view(rows_done.shape[0], span_y, out_w, channels)
        window = torch.matmul(weights_x[part].transpose(1, 2).unsqueeze(1), rows_done)  # (k, span_y, span_x, C)
        grad.index_add_(0, index[part].flatten(), window.reshape(-1, channels))
    return grad.view(batch, height, width, channels).permute(0, 3, 1, 2).contiguous()


class MultiScaleRoIAlign(_TorchvisionMultiScaleRoIAlign):
    """torchvision's ``MultiScaleRoIAlign`` (its own input filter, scales, RoI format and
    level mapping; the same outputs) pooling with :func:`roi_align`, whose backward pass
    is vectorised: torchvision's ``_multiscale_roi_align`` calls its module's
    ``roi_align``, which cannot be swapped without patching torchvision for everyone."""

    def forward(self, x: dict[str, Tensor], boxes: list[Tensor], image_shapes: list[tuple[int, int]]) -> Tensor:
        features = _filter_input(x, self.featmap_names)
        if self.scales is None or self.map_levels is None:
            self.scales, self.map_levels = _setup_scales(
                features, image_shapes, self.canonical_scale, self.canonical_level
            )
        rois = _convert_to_roi_format(boxes)
        output_size = tuple(self.output_size)
        if len(features) == 1:
            return roi_align(features[0], rois, output_size, self.scales[0], self.sampling_ratio)
        levels = self.map_levels(boxes)
        result = features[0].new_zeros((rois.shape[0], features[0].shape[1], *output_size))
        for level, (feature, scale) in enumerate(zip(features, self.scales)):
            chosen = torch.where(levels == level)[0]
            pooled = roi_align(feature, rois[chosen], output_size, scale, self.sampling_ratio)
            result[chosen] = pooled.to(result.dtype)
        return result
