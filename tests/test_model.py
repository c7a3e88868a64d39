"""Invariants of the SPLIT model (issue: SPLIT model library)."""

from __future__ import annotations

import copy
import math
import platform as stdlib_platform
from dataclasses import replace

import pytest
import timm
import torch
import torch.nn.functional as F

from splitvit.config import (
    BudgetConfig,
    DistillConfig,
    PolicyConfig,
    PolicyTrainingConfig,
    TeacherConfig,
    build_dataclass,
)
from splitvit.model import GeometryError, QuadtreeGeometry, SplitViT, expected_tokens, token_counts, top_down_decisions
from splitvit.model.policies import EntropyPolicy, PolicyContext
from splitvit.train.losses import budget_penalty, distillation_loss, feature_distillation_loss
from splitvit.train.steps import SplitLossConfig, calibrate_thresholds

POLICIES = ["learned", "entropy", "random", "full", "coarse"]


def tiny_vit(image_size: int = 32, patch_size: int = 4, **kwargs) -> timm.models.VisionTransformer:
    torch.manual_seed(0)
    args = dict(img_size=image_size, patch_size=patch_size, embed_dim=32, depth=2, num_heads=2, num_classes=5)
    args.update(kwargs)
    return timm.create_model("vit_tiny_patch16_224", **args)


def tiny_model(policy: str = "learned", image_size: int = 32, levels: int = 3, **kwargs) -> SplitViT:
    return SplitViT.from_timm(
        tiny_vit(image_size), policy=PolicyConfig(kind=policy, depth=1), levels=levels, image_size=image_size, **kwargs
    )


def timm_inputs(vit: timm.models.VisionTransformer, images: torch.Tensor) -> torch.Tensor:
    """``[0, 1]`` images as timm's ViT expects them: normalised with timm's own data
    config of ``vit`` (resolved here, independently of SplitViT)."""
    config = timm.data.resolve_model_data_config(vit)
    mean = torch.tensor(config["mean"]).view(1, -1, 1, 1)
    std = torch.tensor(config["std"]).view(1, -1, 1, 1)
    return (images - mean) / std


def test_platform_folder_does_not_shadow_stdlib():
    assert stdlib_platform.system()  # the stdlib module, not the platform/ source root


# 1. full policy reproduces timm's logits -------------------------------------------------------
@pytest.mark.parametrize(
    "name,timm_kwargs",
    [
        ("vit_tiny_patch16_224", {}),  # class token, pos embed over prefix
        ("vit_small_patch16_224", dict(global_pool="avg", class_token=False)),  # mean pool, no prefix
        ("vit_base_patch16_224", dict(embed_dim=96, depth=2, num_heads=3, reg_tokens=2, no_embed_class=True)),
    ],
)
@pytest.mark.parametrize("resolution", [64, 128])
def test_full_policy_reproduces_timm_logits(name, timm_kwargs, resolution):
    torch.manual_seed(0)
    vit = timm.create_model(name, img_size=resolution, num_classes=7, **timm_kwargs).eval()
    model = SplitViT.from_timm(vit, levels=3 if resolution == 64 else 2, policy="full", image_size=resolution).eval()
    images = torch.rand(2, 3, resolution, resolution)
    with torch.no_grad():
        expected = vit(timm_inputs(vit, images))
        out = model(images)
    assert out.logits.shape == expected.shape
    assert (out.logits - expected).abs().max().item() <= 1e-4
    assert out.tokens.tolist() == [model.geometry.full_tokens] * 2


def test_full_policy_matches_timm_at_other_resolution_with_resampled_pos_embed():
    vit = tiny_vit(32, dynamic_img_size=True).eval()
    model = SplitViT.from_timm(vit, levels=2, policy="full", image_size=48).eval()
    images = torch.rand(2, 3, 48, 48)
    with torch.no_grad():
        assert (model(images).logits - vit(timm_inputs(vit, images))).abs().max().item() <= 1e-4


# 2. token bounds ----------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", POLICIES)
def test_token_counts_lie_between_coarse_and_full(policy):
    model = tiny_model(policy).eval()
    geometry = model.geometry
    with torch.no_grad():
        out = model(torch.rand(4, 3, 32, 32))
    assert ((out.tokens >= geometry.min_tokens) & (out.tokens <= geometry.full_tokens)).all()
    if policy == "coarse":
        assert out.tokens.tolist() == [geometry.min_tokens] * 4 == [4] * 4
    if policy == "full":
        assert out.tokens.tolist() == [geometry.full_tokens] * 4 == [64] * 4


# 3. reported tokens == tokens attended --------------------------------------------------------------
@pytest.mark.parametrize("policy", ["learned", "entropy", "random"])
@pytest.mark.parametrize("buckets", [1, 3])
def test_reported_tokens_equal_attended_tokens(policy, buckets):
    model = tiny_model(policy, length_buckets=buckets, attention="padded").eval()
    seen: list[torch.Tensor] = []

    def record(module, args, kwargs):
        x = args[0]
        mask = kwargs.get("attn_mask")
        keys = torch.full((x.shape[0],), x.shape[1]) if mask is None else mask.reshape(x.shape[0], -1).sum(1)
        seen.append(keys - model.vit.num_prefix_tokens)

    last = model.vit.blocks[-1]  # the encoder's last block: the policy's coarse pass uses only block 0
    handle = last.register_forward_pre_hook(record, with_kwargs=True)
    images = torch.rand(6, 3, 32, 32)
    images[:2, :, :16] = 0.5  # flat regions: fewer entropy splits, so lengths differ
    with torch.no_grad():
        out = model(images, thresholds=[0.5, 0.5])
    handle.remove()
    # with buckets the batch is split; put the per-bucket counts back in batch order
    attended = torch.cat(seen)
    assert attended.numel() == 6
    assert sorted(attended.tolist()) == sorted(out.tokens.tolist())
    if buckets == 1:
        assert attended.tolist() == out.tokens.tolist()
    assert out.padded_tokens >= int(out.tokens.sum())


def _forward_mixed_lengths(model: SplitViT):
    """The model on 6 images, 2 of them half flat, at each level's median score as its
    threshold (about half the nodes split): a batch of mixed lengths."""
    images = torch.rand(6, 3, 32, 32)
    images[:2, :, :16] = 0.5
    with torch.no_grad():
        thresholds = [float(s.median()) for s in model.split_scores(images)]
        out = model(images, thresholds=thresholds)
    assert len(set(out.tokens.tolist())) > 1, "the batch must mix lengths"
    return out


@pytest.mark.parametrize("policy", ["learned", "entropy", "random"])
@pytest.mark.parametrize("buckets", [1, 3])
def test_packed_path_attends_reported_tokens_without_padding(policy, buckets, monkeypatch):
    """Inference: images packed longest first, each length's images attending together
    (one kernel per forward, used by every block): each image's queries see exactly its
    own tokens, and nothing is padded, attention included."""
    from splitvit.model import packed
    from splitvit.model import splitvit as splitvit_module

    model = tiny_model(policy, length_buckets=buckets).eval()
    kernels: list[list[tuple[int, int]]] = []
    calls: list[torch.Tensor] = []

    def recording_kernel(groups):
        kernels.append(list(groups))
        kernel = packed.grouped_kernel(groups)
        attend = kernel.qkv_attention

        def wrapped(qkv, heads, head_dim, scale=None):
            calls.append(qkv.shape[0])
            return attend(qkv, heads, head_dim, scale=scale)

        kernel.qkv_attention = wrapped
        return kernel

    monkeypatch.setattr(splitvit_module, "grouped_kernel", recording_kernel)
    if policy == "random":
        model.policy.seed = 0
    out = _forward_mixed_lengths(model)
    assert len(kernels) == 1 and len(calls) == len(model.vit.blocks)  # one kernel, every block
    prefix = model.vit.num_prefix_tokens
    attended = [length - prefix for n, length in kernels[0] for _ in range(n)]
    assert attended == sorted(out.tokens.tolist(), reverse=True)  # longest first, each its own keys
    assert calls == [int(out.tokens.sum()) + 6 * prefix] * len(model.vit.blocks)  # packed rows, no padding
    assert out.padded_tokens == int(out.tokens.sum()) == out.attention_slots


def test_packed_path_in_training_pads_attention_only(monkeypatch):
    """Training (drop path draws per image): the padded kernel, in batch order; only
    its attention pads."""
    from splitvit.model import packed
    from splitvit.model import splitvit as splitvit_module

    model = tiny_model("entropy").train()
    calls: list[torch.Tensor] = []

    def recording_kernel(cu_seqlens, groups=None):
        kernel = packed.padded_sdpa_kernel(cu_seqlens, groups)

        def wrapped(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None):
            calls.append(cu_k.diff() - model.vit.num_prefix_tokens)  # keys each image's queries see
            return kernel(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale)

        wrapped.padded_rows = kernel.padded_rows
        return wrapped

    monkeypatch.setattr(splitvit_module, "padded_sdpa_kernel", recording_kernel)
    out = _forward_mixed_lengths(model)
    assert len(calls) == len(model.vit.blocks)  # one kernel per block, built once per forward
    assert calls[-1].tolist() == out.tokens.tolist()
    assert out.padded_tokens == int(out.tokens.sum())  # no padding outside attention
    assert out.attention_slots >= int(out.tokens.sum())


# 4. gradients reach the policy --------------------------------------------------------------------
def test_gradients_reach_policy_from_task_loss_and_from_budget_penalty():
    model = tiny_model("learned").train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    policy_params = [p for p in model.policy.parameters()]

    out = model(images)
    torch.nn.functional.cross_entropy(out.logits, labels).backward()
    task_grad = sum(float(p.grad.abs().sum()) for p in policy_params if p.grad is not None)
    assert task_grad > 0, "the task loss must reach the policy through the straight-through gates"

    model.zero_grad()
    out = model(images)
    budget_penalty(out.expected_tokens / out.full_tokens, target_ratio=0.3).backward()
    budget_grad = sum(float(p.grad.abs().sum()) for p in policy_params if p.grad is not None)
    assert budget_grad > 0


def test_straight_through_gates_leave_forward_values_unchanged():
    model = tiny_model("learned")
    images = torch.rand(3, 3, 32, 32)
    torch.manual_seed(1)
    model.train()
    out_train = model(images)
    # the same decisions given from outside, without gates, give the same logits
    model.eval()
    out_fixed = model(images, decisions=out_train.decisions)
    assert torch.equal(out_train.tokens, out_fixed.tokens)
    assert (out_train.logits - out_fixed.logits).abs().max() <= 1e-6


def test_expected_tokens_formula():
    geometry = QuadtreeGeometry(32, 4, 3)  # 2x2 roots, 4x4 mid, 8x8 fine
    q0 = torch.full((1, 2, 2), 0.5)
    q1 = torch.full((1, 4, 4), 0.25)
    # E[mid] = 0.75 + 0.25*4 = 1.75 ; E[root] = 0.5 + 0.5*4*1.75 = 4.0 ; total 16
    assert expected_tokens([q0, q1]).item() == pytest.approx(16.0)
    hard = [torch.ones(1, 2, 2, dtype=torch.bool), torch.zeros(1, 4, 4, dtype=torch.bool)]
    assert expected_tokens([h.float() for h in hard]).item() == token_counts(top_down_decisions(hard)).item() == 16
    assert geometry.full_tokens == 64 and geometry.min_tokens == 4


# 5. thresholds are monotone -----------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["learned", "entropy", "random"])
def test_raising_a_threshold_never_adds_tokens(policy):
    model = tiny_model(policy).eval()
    if policy == "random":
        model.policy.seed = 3
    images = torch.rand(4, 3, 32, 32)
    grid = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    with torch.no_grad():
        for fixed in grid:
            for level in (0, 1):  # raise one level's threshold, the other held fixed
                previous = None
                for t in grid:
                    thresholds = [t, fixed] if level == 0 else [fixed, t]
                    counts = model(images, thresholds=thresholds).tokens
                    if previous is not None:
                        assert (counts <= previous).all(), (level, fixed, t)
                    previous = counts


# 6. padding does not change an image's logits ---------------------------------------------------
@pytest.mark.parametrize("pool_kwargs", [{}, dict(global_pool="avg", class_token=False)])
@pytest.mark.parametrize("buckets", [1, 2])
def test_logits_in_padded_batch_equal_logits_alone(pool_kwargs, buckets):
    vit = tiny_vit(32, **pool_kwargs)
    model = SplitViT.from_timm(vit, levels=3, policy="entropy", image_size=32, length_buckets=buckets).eval()
    images = torch.rand(4, 3, 32, 32)
    images[0] = 0.5  # flat: all-coarse, the shortest sequence, padded in the batch
    images[1, :, :16] = 0.2
    with torch.no_grad():
        batch = model(images, thresholds=[0.3, 0.3])
        assert len(set(batch.tokens.tolist())) > 1, "the batch must mix lengths for this test to mean anything"
        for i in range(4):
            alone = model(images[i : i + 1], thresholds=[0.3, 0.3])
            assert alone.tokens.item() == batch.tokens[i].item()
            assert (alone.logits[0] - batch.logits[i]).abs().max().item() <= 1e-4


def test_dense_head_gives_per_pixel_logits_and_padding_invariance():
    model = tiny_model("entropy", task="dense", num_classes=3).eval()
    images = torch.rand(3, 3, 32, 32)
    images[0] = 0.5
    with torch.no_grad():
        batch = model(images, thresholds=[0.3, 0.3])
        assert batch.logits.shape == (3, 3, 32, 32)
        alone = model(images[:1], thresholds=[0.3, 0.3])
        assert (alone.logits[0] - batch.logits[0]).abs().max().item() <= 1e-4


@pytest.mark.parametrize("policy", ["entropy", "full", "coarse"])
@pytest.mark.parametrize("attention", ["packed", "padded"])
def test_fine_map_gather_equals_masked_fill_of_every_level(policy, attention):
    """The dense head's input, one row gather per finest cell, holds exactly what masking
    every level's grid and adding them up gives (the computation it replaced): mixed
    lengths with all three levels' leaves, and one-level layouts (full, coarse)."""
    model = tiny_model(policy, task="dense", num_classes=3, attention=attention).eval()
    images = _mixed_images(6)
    with torch.no_grad():
        thresholds = [float(s.median()) for s in model.split_scores(images)]  # about half the nodes split
        encoded = model._encode_leaves(images, thresholds, None, False, None, None)
        fine = model._scatter_to_fine(encoded.features, encoded.layout, encoded.leaves, encoded.geometry)
        tokens = encoded.features[:, model.vit.num_prefix_tokens :]
        grids = model._to_layout(tokens, encoded.layout, encoded.leaves, encoded.geometry)
        masked_sum = model._fill_fine(grids, encoded.leaves, encoded.geometry).permute(0, 3, 1, 2)
    if policy == "entropy":
        assert encoded.layout[0] == "gather" and all(bool(m.any()) for m in encoded.leaves)
        assert len(set(encoded.counts.tolist())) > 1
    assert fine.shape == (6, 32, 8, 8)
    assert torch.equal(fine, masked_sum)


# 7. bad input: one clear error each ---------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(image_size=(30, 32), patch_size=4, levels=3), "30x32 is not a multiple of the coarsest patch 16"),
        (dict(image_size=32, patch_size=4, levels=1), "levels must be >= 2"),
        (dict(image_size=32, patch_size=0, levels=2), "patch_size must be >= 1"),
    ],
)
def test_bad_geometry_errors(kwargs, message):
    with pytest.raises(GeometryError, match=message):
        QuadtreeGeometry(**kwargs)


def test_bad_image_size_for_model_names_sizes():
    with pytest.raises(GeometryError, match="not a multiple of the coarsest patch 32"):
        SplitViT.from_timm(tiny_vit(32), levels=4, policy="full", image_size=48)
    model = tiny_model("full")
    with pytest.raises(GeometryError, match="36x36"):
        model(torch.rand(1, 3, 36, 36))


@pytest.mark.parametrize(
    "thresholds,message",
    [
        ([0.5, 1.5], r"thresholds\[1\] = 1.5 is outside \[0, 1\]"),
        ([-0.1, 0.5], r"thresholds\[0\] = -0.1 is outside"),
        ([0.5], "expected 2 values"),
    ],
)
def test_bad_thresholds(thresholds, message):
    with pytest.raises(ValueError, match=message):
        tiny_model("entropy", thresholds=thresholds)
    model = tiny_model("entropy")
    with pytest.raises(ValueError, match=message):
        model(torch.rand(1, 3, 32, 32), thresholds=thresholds)


@pytest.mark.parametrize(
    "kwargs,message",
    [
        (dict(weight=-1.0), "weight must be >= 0, got -1.0"),
        (dict(target_ratio=0.0), "target_ratio must be in"),
        (dict(penalty="linear"), r"train\.budget\.penalty: must be one of squared, hinge"),
    ],
)
def test_bad_penalty_settings(kwargs, message):
    """The budget section refuses a bad value as it is built (a name: its Literal type, as
    the config builds it)."""
    with pytest.raises(ValueError, match=message):
        build_dataclass(BudgetConfig, kwargs, "train.budget.") if "penalty" in kwargs else BudgetConfig(**kwargs)


def test_unknown_policy_names_choices():
    with pytest.raises(ValueError, match="unknown policy 'apt'"):
        tiny_model("apt")


# 8. entropy splits the busy region, not the flat one ----------------------------------------------
def test_entropy_policy_splits_high_entropy_region_only():
    torch.manual_seed(0)
    image = torch.full((1, 3, 32, 32), 0.4)
    image[:, :, :, 16:] = torch.rand(1, 3, 32, 16)  # right half noise, left half flat
    geometry = QuadtreeGeometry(32, 4, 3)
    scores = EntropyPolicy()(image, geometry, PolicyContext())
    decisions = top_down_decisions([s > 0.5 for s in scores])
    assert decisions[0][0, :, 1].all() and not decisions[0][0, :, 0].any()
    assert decisions[1][0, :, 2:].all() and not decisions[1][0, :, :2].any()


def test_calibrated_thresholds_hit_a_budget():
    model = tiny_model("entropy").eval()
    images = torch.rand(8, 3, 32, 32)
    images[:4, :, :, :16] = 0.3
    thresholds = calibrate_thresholds(model, images, 0.5)
    with torch.no_grad():
        ratio = model(images, thresholds=thresholds).token_ratio.mean().item()
    assert abs(ratio - 0.5) < 0.1


def test_calibration_lands_at_or_under_its_target(monkeypatch):
    """Where the ratio nearest the target lies just over it, calibration takes the one
    under it: a point quoted at a budget never spends more on its calibration images
    (a 50% point at 50.52% missed a "<= 50%" goal)."""
    from splitvit.model.quadtree import token_counts, top_down_decisions

    model = tiny_model("entropy", levels=2).eval()  # 4x4 coarse cells of 8 px; 64 tokens when all split
    images = torch.rand(1, 3, 32, 32)
    # sixteen distinct scores: splitting k cells spends 16 + 3k of 64 tokens
    scores = [torch.linspace(0.02, 0.98, 16).reshape(1, 4, 4)]
    monkeypatch.setattr(model, "split_scores", lambda images: scores)

    def ratio(thresholds):
        decisions = top_down_decisions([s > t for s, t in zip(scores, thresholds)])
        return float(token_counts(decisions).float().mean()) / 64

    # 0.52: 6 splits give 34/64 = 0.531 (nearest, over), 5 give 31/64 = 0.484 (under)
    assert ratio(calibrate_thresholds(model, images, 0.52)) == 31 / 64
    assert ratio(calibrate_thresholds(model, images, 34 / 64)) == 34 / 64  # exactly reachable: met
    assert ratio(calibrate_thresholds(model, images, 1.0)) == 1.0
    # below the fewest tokens the model can spend (every cell coarse): that fewest
    assert ratio(calibrate_thresholds(model, images, 0.1)) == 16 / 64


def test_save_and_load_round_trip(tmp_path):
    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=3,
        policy="learned",
        image_size=32,
        num_classes=5,
        timm_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2),
        thresholds=[0.3, 0.7],
    ).eval()
    path = tmp_path / "m.pt"
    model.save(path)
    loaded = SplitViT.load(path).eval()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(images).logits, loaded(images).logits)
    assert loaded.thresholds.tolist() == pytest.approx([0.3, 0.7])
    entropy = SplitViT.load(path, policy="entropy")
    assert entropy.policy.name == "entropy"


def test_a_checkpoint_spec_keeps_its_keys_and_reads_back_to_itself(tmp_path):
    """The spec a checkpoint holds is the mapping it always was (``splitvit train``'s
    keys, in its order); read back, it is the model's :class:`ModelSpec` again."""
    from splitvit.model.spec import ModelSpec

    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=3,
        policy="learned",
        image_size=32,
        num_classes=5,
        timm_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2),
        thresholds=[0.3, 0.7],
        fine_aggregation=False,
        task="classification",
        length_buckets=1,
        data_config=None,  # not a plain value: not kept
    )
    model.save(tmp_path / "m.pt")
    saved = torch.load(tmp_path / "m.pt", weights_only=False)["spec"]
    assert list(saved) == [
        "name",
        "levels",
        "policy",
        "image_size",
        "num_classes",
        "timm_kwargs",
        "normalize",
        "thresholds",
        "fine_aggregation",
        "task",
        "length_buckets",
    ]
    assert saved["policy"]["kind"] == "learned" and saved["thresholds"] == [0.3, 0.7]
    assert ModelSpec.from_dict(saved) == model.spec and model.spec.to_dict() == saved
    with pytest.raises(TypeError, match="no 'colour'"):
        ModelSpec.from_dict({**saved, "colour": "red"})


TINY_TIMM = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2)


@pytest.mark.parametrize(
    "vit",
    [
        lambda: tiny_vit(),  # timm's pretrained config: mean = std = 0.5
        lambda: timm.models.VisionTransformer(img_size=32, patch_size=4, embed_dim=32, depth=1, num_heads=2),
    ],
    ids=["named", "bare"],
)
def test_model_normalises_its_inputs_with_timms_data_config(vit):
    """The model carries timm's data config; its mean and std are buffers in the state
    dict, and the entropy policy still sees the raw [0, 1] pixels."""
    vit = vit().eval()
    config = timm.data.resolve_model_data_config(vit)
    model = SplitViT.from_timm(vit, policy=PolicyConfig(kind="entropy", depth=1), levels=2, image_size=32).eval()
    assert model.data_config["mean"] == pytest.approx(config["mean"])
    assert model.data_config["std"] == pytest.approx(config["std"])
    assert model.data_config["interpolation"] == config["interpolation"] == "bicubic"
    assert model.data_config["crop_pct"] == config["crop_pct"]
    assert model.data_config["input_size"] == (3, 32, 32)  # the model's, not timm's pretrained 224
    state = model.state_dict()
    assert state["input_mean"].flatten().tolist() == pytest.approx(config["mean"])
    assert state["input_std"].flatten().tolist() == pytest.approx(config["std"])
    images = torch.rand(2, 3, 32, 32)
    assert torch.equal(model.normalize(images), timm_inputs(vit, images))
    geometry = model.geometry
    raw = EntropyPolicy()(images, geometry, PolicyContext())
    normalised = EntropyPolicy()(timm_inputs(vit, images), geometry, PolicyContext())
    scores = model.split_scores(images)
    assert all(torch.equal(a, b) for a, b in zip(scores, raw))
    if len(set(config["std"])) > 1:  # unequal channel scales change the grey level: the policy would differ
        assert not all(torch.equal(a, b) for a, b in zip(scores, normalised))


def test_saved_model_keeps_its_data_config(tmp_path):
    """The data config is saved with the model and comes back with it, even where it
    differs from what timm resolves for the same name."""
    custom = {"mean": (0.1, 0.2, 0.3), "std": (0.4, 0.5, 0.6), "interpolation": "bilinear", "crop_pct": 1.0}
    model = SplitViT.from_timm(
        "vit_tiny_patch16_224", levels=2, image_size=32, num_classes=5, timm_kwargs=TINY_TIMM, data_config=custom
    ).eval()
    path = tmp_path / "m.pt"
    model.save(path)
    payload = torch.load(path, weights_only=False)
    assert payload["data_config"]["interpolation"] == "bilinear"
    loaded = SplitViT.load(path).eval()
    assert loaded.data_config == model.data_config
    assert loaded.data_config["mean"] == pytest.approx(custom["mean"])
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(images).logits, loaded(images).logits)


def test_checkpoint_without_normalisation_loads_as_unnormalised(tmp_path):
    """A checkpoint from before inputs were normalised (no buffers, no data config)
    still loads, as the model it was: mean 0, std 1, timm's ViT on the raw pixels;
    ``init_from`` carries the same normalisation with its weights."""
    from splitvit.train.checkpoints import init_weights

    args = dict(levels=2, policy="full", image_size=32, num_classes=5, timm_kwargs=TINY_TIMM, normalize="timm")
    model = SplitViT.from_timm("vit_tiny_patch16_224", **args).eval()
    assert model.data_config["mean"] == pytest.approx((0.5, 0.5, 0.5))  # timm's
    model.save(tmp_path / "model.pt")
    payload = torch.load(tmp_path / "model.pt", weights_only=False)
    del payload["data_config"], payload["state_dict"]["input_mean"], payload["state_dict"]["input_std"]
    torch.save(payload, tmp_path / "model.pt")
    old = SplitViT.load(tmp_path / "model.pt").eval()
    assert old.data_config["mean"] == (0.0, 0.0, 0.0) and old.data_config["std"] == (1.0, 1.0, 1.0)
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert (old(images).logits - model.vit(images)).abs().max() <= 1e-5
    fresh = SplitViT.from_timm("vit_tiny_patch16_224", **args)
    assert init_weights(fresh, tmp_path) == ["budget", "thresholds"]
    assert fresh.data_config["mean"] == (0.0, 0.0, 0.0) and fresh.data_config["std"] == (1.0, 1.0, 1.0)


def test_normalisation_follows_where_the_weights_come_from(tmp_path):
    """``auto``: timm's mean and std for weights from timm (a local checkpoint here,
    as ``pretrained`` would be), the raw pixels for a model trained from scratch;
    ``timm`` and ``none`` force either; anything else is an error naming the key."""
    args = dict(levels=2, image_size=32, num_classes=5, timm_kwargs=TINY_TIMM)
    source = timm.create_model("vit_tiny_patch16_224", img_size=32, num_classes=5, **TINY_TIMM)
    torch.save(source.state_dict(), tmp_path / "weights.pth")
    timms = timm.data.resolve_model_data_config(source)
    scratch = SplitViT.from_timm("vit_tiny_patch16_224", **args)
    assert scratch.data_config["mean"] == (0.0, 0.0, 0.0) and scratch.data_config["std"] == (1.0, 1.0, 1.0)
    images = torch.rand(2, 3, 32, 32)
    assert torch.equal(scratch.normalize(images), images)
    weighted = SplitViT.from_timm("vit_tiny_patch16_224", checkpoint_path=tmp_path / "weights.pth", **args)
    assert weighted.data_config["mean"] == pytest.approx(timms["mean"])
    assert SplitViT.from_timm("vit_tiny_patch16_224", normalize="timm", **args).data_config["std"] == pytest.approx(
        timms["std"]
    )
    forced = SplitViT.from_timm(
        "vit_tiny_patch16_224", checkpoint_path=tmp_path / "weights.pth", normalize="none", **args
    )
    assert forced.data_config["std"] == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="normalize must be one of auto, timm, none, got 'imagenet'"):
        SplitViT.from_timm("vit_tiny_patch16_224", normalize="imagenet", **args)


def test_from_timm_loads_a_local_checkpoint_file(tmp_path):
    args = dict(patch_size=4, embed_dim=32, depth=2, num_heads=2, img_size=32, num_classes=5)
    source = timm.create_model("vit_tiny_patch16_224", **args).eval()
    path = tmp_path / "weights.pth"
    torch.save(source.state_dict(), path)
    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=2,
        policy="full",
        checkpoint_path=path,
        image_size=32,
        num_classes=5,
        timm_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2),
    ).eval()
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert (model(images).logits - source(timm_inputs(source, images))).abs().max() <= 1e-5
    with pytest.raises(FileNotFoundError, match="missing.pth"):
        SplitViT.from_timm("vit_tiny_patch16_224", levels=2, checkpoint_path=tmp_path / "missing.pth")


def test_packed_attention_path_equals_padded(monkeypatch):
    """The packing logic (offsets, per-sequence attention, unpacking), with the CPU
    padded-SDPA kernel and with a per-sequence reference kernel standing in for
    CUDA's varlen FlashAttention."""
    from splitvit.model import packed
    from splitvit.model import splitvit as splitvit_module

    padded = tiny_model("entropy", attention="padded").eval()
    packed_model = SplitViT(padded.vit, levels=3, policy="entropy", image_size=32).eval()
    assert packed_model.attention == "packed"  # the default
    images = torch.rand(4, 3, 32, 32)
    images[0] = 0.5
    with torch.no_grad():
        expected = padded(images, thresholds=[0.3, 0.3])
        cpu = packed_model(images, thresholds=[0.3, 0.3])  # CPU: padded-SDPA kernel
        calls = []

        def kernel(*args, **kwargs):
            calls.append(args[3].tolist())
            return packed.reference_kernel(*args, **kwargs)

        monkeypatch.setattr(splitvit_module, "varlen_kernel", lambda device: kernel)
        got = packed_model(images, thresholds=[0.3, 0.3])
    assert len(set(expected.tokens.tolist())) > 1
    assert calls, "the packed path must have run"
    lengths = [b - a for a, b in zip(calls[0][:-1], calls[0][1:])]
    assert lengths == (expected.tokens + 1).tolist()  # + the class token
    assert cpu.attention_slots is not None and got.attention_slots is None
    assert (cpu.logits - expected.logits).abs().max() <= 1e-4
    assert (got.logits - expected.logits).abs().max() <= 1e-4


def _mixed_images(n: int = 5) -> torch.Tensor:
    torch.manual_seed(3)
    images = torch.rand(n, 3, 32, 32)
    images[0] = 0.5  # flat: all-coarse
    images[1, :, :16] = 0.2
    return images


def _pair(policy: str, buckets: int = 1, vit_kwargs: dict | None = None, **kwargs) -> tuple[SplitViT, SplitViT]:
    """The same weights and policy module, packed and padded."""
    vit = tiny_vit(32, **(vit_kwargs or {}))
    packed_model = SplitViT(
        vit, policy=PolicyConfig(kind=policy, depth=1), levels=3, image_size=32, length_buckets=buckets, **kwargs
    )
    padded = SplitViT(
        vit,
        policy=packed_model.policy_config,
        levels=3,
        image_size=32,
        length_buckets=buckets,
        attention="padded",
        **kwargs,
    )
    padded.policy = packed_model.policy  # the same policy module: the same decisions
    padded.level_embed = packed_model.level_embed
    padded.dense_head = packed_model.dense_head
    return packed_model, padded


@pytest.mark.parametrize("task", ["classification", "dense"])
@pytest.mark.parametrize("pool_kwargs", [{}, dict(global_pool="avg", class_token=False), dict(qk_norm=True)])
@pytest.mark.parametrize("buckets", [1, 3])
def test_packed_equals_padded_in_eval(task, pool_kwargs, buckets):
    extra = dict(task="dense", num_classes=3) if task == "dense" else {}
    packed_model, padded = _pair("entropy", buckets, pool_kwargs, **extra)
    images = _mixed_images()
    with torch.no_grad():
        a = packed_model.eval()(images, thresholds=[0.3, 0.3])
        b = padded.eval()(images, thresholds=[0.3, 0.3])
    assert len(set(a.tokens.tolist())) > 1
    assert torch.equal(a.tokens, b.tokens)
    assert a.attention_slots is not None and b.attention_slots is None  # each took its own path
    assert (a.logits - b.logits).abs().max().item() <= 1e-4


@pytest.mark.parametrize("task", ["classification", "dense"])
@pytest.mark.parametrize("vit_kwargs", [{}, dict(drop_path_rate=0.5)])
def test_packed_equals_padded_in_training_with_gradients(task, vit_kwargs):
    """Training mode: sampled decisions, straight-through gates, per-image drop path;
    the same seed gives the same logits and the same gradients on both paths."""
    extra = dict(task="dense", num_classes=3) if task == "dense" else {}
    packed_model, padded = _pair("learned", 1, vit_kwargs, **extra)
    images = _mixed_images(6)
    results = []
    for model in (packed_model, padded):
        model.train().zero_grad()
        torch.manual_seed(7)
        out = model(images)
        loss = out.logits.square().mean() + out.expected_tokens.mean() / out.full_tokens
        loss.backward()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
        results.append((out, grads))
    (a, ga), (b, gb) = results
    assert len(set(a.tokens.tolist())) > 1
    assert torch.equal(a.tokens, b.tokens)
    assert (a.logits - b.logits).abs().max().item() <= 1e-4
    assert set(ga) == set(gb) and any(name.startswith("policy.") for name in ga)
    for name in ga:
        assert (ga[name] - gb[name]).abs().max().item() <= 1e-4 * max(1.0, gb[name].abs().max().item()), name


@pytest.mark.parametrize("train", [False, True])
def test_packed_path_in_chunks_equals_padded(train, monkeypatch):
    """Large CPU batches are encoded in chunks of similar length: same logits and
    gradients as the padded path, whatever the chunking."""
    from splitvit.model import packed

    monkeypatch.setattr(packed, "CPU_CHUNK_TOKENS", 60)  # a handful of images per chunk
    packed_model, padded = _pair("learned")
    images = _mixed_images(9)
    results = []
    for model in (packed_model, padded):
        model.train(train).zero_grad()
        torch.manual_seed(7)
        out = model(images, thresholds=[0.45, 0.5])
        out.logits.square().mean().backward()
        results.append((out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
    (a, ga), (b, gb) = results
    assert len(set(a.tokens.tolist())) > 2
    # training chunks by token_chunks, inference runs sorted_chunks: several chunks either way
    assert (
        len(packed.token_chunks(a.tokens + 1)) > 2
        and len(packed.sorted_chunks(sorted((a.tokens + 1).tolist(), reverse=True))) > 2
    )
    assert torch.equal(a.tokens, b.tokens)
    assert a.padded_tokens == int(a.tokens.sum()) and a.attention_slots >= a.padded_tokens
    assert (a.logits - b.logits).abs().max().item() <= 1e-4
    assert set(ga) == set(gb)
    for name in ga:
        assert (ga[name] - gb[name]).abs().max().item() <= 1e-4 * max(1.0, gb[name].abs().max().item()), name


def test_token_chunks_cover_the_batch_by_length():
    from splitvit.model.packed import token_chunks

    lengths = torch.tensor([5, 30, 12, 30, 7, 1, 50])
    chunks = token_chunks(lengths, max_tokens=40)
    assert sorted(torch.cat(chunks).tolist()) == list(range(7))
    assert [lengths[c].tolist() for c in chunks] == [[50], [30], [30], [12, 7, 5, 1]]  # longest first; oversize alone
    assert [c.tolist() for c in token_chunks(lengths, max_tokens=1000)] == [[6, 1, 3, 2, 4, 0, 5]]


def test_packed_model_returns_attention_through_the_padded_path():
    packed_model, padded = _pair("entropy")
    images = _mixed_images()
    with torch.no_grad():
        plain = packed_model.eval()(images, thresholds=[0.3, 0.3])
        with_attention = packed_model(images, thresholds=[0.3, 0.3], return_attention=True)
        reference = padded.eval()(images, thresholds=[0.3, 0.3], return_attention=True)
    assert plain.attention_slots is not None and with_attention.attention_slots is None
    assert (plain.logits - with_attention.logits).abs().max().item() <= 1e-4
    assert torch.equal(with_attention.fine_attention, reference.fine_attention)
    mass = with_attention.fine_attention.sum(dim=(1, 2))  # the class token's own share is not on a cell
    assert ((mass > 0) & (mass <= 1 + 1e-5)).all()


def test_attention_dropout_in_training_takes_the_padded_path():
    packed_model, _ = _pair("entropy", vit_kwargs=dict(attn_drop_rate=0.1))
    images = _mixed_images()
    with torch.no_grad():
        assert packed_model.eval()(images, thresholds=[0.3, 0.3]).attention_slots is not None
        assert packed_model.train()(images, thresholds=[0.3, 0.3]).attention_slots is None


def test_attention_option_is_validated():
    with pytest.raises(ValueError, match="attention must be one of"):
        tiny_model("entropy", attention="flash")


def test_padded_sdpa_kernel_matches_reference_kernel():
    from splitvit.model.packed import padded_sdpa_kernel, reference_kernel

    torch.manual_seed(0)
    lengths = torch.tensor([5, 1, 9, 3, 9, 2])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    cu[1:] = lengths.cumsum(0)
    total = int(cu[-1])
    q, k, v = (torch.randn(total, 2, 8) for _ in range(3))
    expected = reference_kernel(q, k, v, cu, cu, 9, 9, scale=0.3)
    for groups in (None, 1, 2, 6, 10):
        kernel = padded_sdpa_kernel(cu, groups)
        assert kernel.padded_rows >= total
        for _ in range(2):  # reused buffers give the same answer on the next block
            assert (kernel(q, k, v, cu, cu, 9, 9, scale=0.3) - expected).abs().max().item() <= 1e-5
    assert padded_sdpa_kernel(cu, 1).padded_rows == 9 * len(lengths)
    assert padded_sdpa_kernel(cu, len(lengths)).padded_rows == total  # one group per image: no padding
    bimodal = torch.tensor([0, 100, 200, 300, 302, 304], dtype=torch.int32)  # lengths 100, 100, 100, 2, 2
    assert padded_sdpa_kernel(bimodal).padded_rows == 3 * 100 + 2 * 2  # automatic groups: no padding here
    with pytest.raises(ValueError, match="other sequence offsets"):
        padded_sdpa_kernel(cu, 1)(q, k, v, cu.flip(0), cu, 9, 9)
    # the fused form takes the qkv projection's (T, 3 * H * hd) rows as they come: per
    # sequence in place for a few sequences, else through the padded layout
    from splitvit.model import packed

    qkv = torch.stack([q, k, v], dim=1).reshape(total, 3 * 2 * 8)
    for per_image in (packed.PER_IMAGE_SEQUENCES, 0):
        packed.PER_IMAGE_SEQUENCES, saved = per_image, packed.PER_IMAGE_SEQUENCES
        try:
            for groups in (None, 1, 6):
                fused = padded_sdpa_kernel(cu, groups).qkv_attention(qkv, 2, 8, scale=0.3)
                assert (fused.view(total, 2, 8) - expected).abs().max().item() <= 1e-5
        finally:
            packed.PER_IMAGE_SEQUENCES = saved


def _count_block_calls(model: SplitViT, fn) -> int:
    calls = []
    hooks = [b.register_forward_hook(lambda *_: calls.append(1)) for b in model.vit.blocks]
    try:
        fn()
    finally:
        for h in hooks:
            h.remove()
    return len(calls)


def test_policy_with_own_blocks_runs_none_of_the_vits_blocks_and_learns():
    """``policy_width``: the learned policy's own narrow blocks replace the ViT's
    shared ones (the cost that kept SPLIT from its ideal speed at ViT-B size)."""
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    shared = tiny_model("learned")  # policy_depth=1: one shared block
    own = SplitViT.from_timm(
        tiny_vit(32), policy=PolicyConfig(kind="learned", depth=2, width=16), levels=3, image_size=32
    )
    assert _count_block_calls(shared, lambda: shared.split_scores(images)) == 1
    assert _count_block_calls(own, lambda: own.split_scores(images)) == 0
    assert len(own.policy.blocks) == 2 and own.policy.blocks[0].attn.qkv.in_features == 16
    own.train()
    out = own(images)
    loss = torch.nn.functional.cross_entropy(out.logits, labels) + budget_penalty(
        out.expected_tokens / out.full_tokens, 0.3
    )
    loss.backward()
    assert own.policy.blocks[0].attn.qkv.weight.grad.abs().sum() > 0
    assert own.policy.proj.weight.grad.abs().sum() > 0
    assert own.vit.blocks[0].attn.qkv.weight.grad is not None  # the task loss still trains the ViT
    own.set_policy("learned")  # rebuilt by name: the same settings
    assert own.policy.own_blocks and len(own.policy.blocks) == 2


def test_policy_width_survives_save_and_load(tmp_path):
    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(kind="learned", width=16, depth=1),
        levels=3,
        image_size=32,
        num_classes=5,
        timm_kwargs=dict(patch_size=4, embed_dim=32, depth=2, num_heads=2),
    ).eval()
    model.save(tmp_path / "m.pt")
    loaded = SplitViT.load(tmp_path / "m.pt").eval()
    assert loaded.policy.own_blocks and loaded.policy_config.width == 16
    images = torch.rand(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(model(images).logits, loaded(images).logits)


@pytest.mark.parametrize("width", [0, 129])
def test_bad_policy_width_names_it(width):
    with pytest.raises(ValueError, match=r"policy\.width must be a positive multiple"):
        SplitViT.from_timm(tiny_vit(32), policy=PolicyConfig(kind="learned", width=width), levels=3, image_size=32)


@pytest.mark.parametrize("seed", range(5))
def test_length_groups_minimise_padded_attention_work(seed):
    import itertools

    from splitvit.model.packed import length_groups

    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 40, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
    overhead = 64

    def cost(sizes):
        ordered, total, start = sorted(lengths, reverse=True), 0, 0
        for n in sizes:
            total += n * ordered[start] ** 2 + overhead
            start += n
        return total

    sizes = length_groups(lengths, overhead)
    assert sum(sizes) == len(lengths) and all(n > 0 for n in sizes)
    ordered = sorted(lengths, reverse=True)
    bounds = list(itertools.accumulate(sizes))[:-1]
    assert all(ordered[b - 1] != ordered[b] for b in bounds)  # equal lengths stay together
    best = min(
        cost([b - a for a, b in zip((0,) + cuts, cuts + (len(lengths),))])
        for r in range(len(lengths))
        for cuts in itertools.combinations(range(1, len(lengths)), r)
    )
    assert cost(sizes) == best
    assert length_groups([7] * 5) == [5] and length_groups([100] * 4 + [2] * 4) == [4, 4]


def _entropy_with_one_hot(images: torch.Tensor, geometry: QuadtreeGeometry, bins: int) -> list[torch.Tensor]:
    """The entropy policy's first definition: one-hot histograms averaged per node."""
    import math

    import torch.nn.functional as F

    grey = images.float().mean(1)
    lo = grey.flatten(1).min(1).values.view(-1, 1, 1)
    hi = grey.flatten(1).max(1).values.view(-1, 1, 1)
    grey = (grey - lo) / (hi - lo).clamp_min(1e-6)
    idx = (grey * bins).long().clamp_(0, bins - 1)
    onehot = F.one_hot(idx, bins).permute(0, 3, 1, 2).float()
    scores = []
    for level in range(geometry.levels - 1):
        size = geometry.cell_size(level)
        hist = F.avg_pool2d(onehot, size)
        ent = -(hist * hist.clamp_min(1e-12).log()).sum(1)
        scores.append((ent / math.log(min(bins, size * size))).clamp(0, 1))
    return scores


@pytest.mark.parametrize("size,patch,levels,bins", [(96, 8, 3, 32), (64, 4, 4, 32), (32, 4, 2, 8), (48, 4, 3, 256)])
def test_entropy_histograms_equal_the_one_hot_definition(size, patch, levels, bins):
    torch.manual_seed(size + levels)
    geometry = QuadtreeGeometry(size, patch, levels)
    images = torch.rand(4, 3, size, size)
    images[0] = 0.5
    images[1, :, : size // 2] = 0.1
    got = EntropyPolicy(bins)(images, geometry, PolicyContext())
    expected = _entropy_with_one_hot(images, geometry, bins)
    assert [tuple(g.shape) for g in got] == [tuple(e.shape) for e in expected]
    for g, e in zip(got, expected):
        assert (g - e).abs().max().item() <= 1e-6


def test_teacher_runs_on_every_kth_policy_step_only(monkeypatch):
    """``teacher_every``: the relevance pass (about half of a policy-phase step) runs on
    steps 0, k, 2k... of an epoch; the others train the policy through the task loss
    and budget penalty alone, and still reach it."""
    from splitvit.train.steps import training_step

    model = tiny_model("learned").train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    calls = []
    relevance = model.relevance_and_logits
    monkeypatch.setattr(model, "relevance_and_logits", lambda *a, **k: calls.append(1) or relevance(*a, **k))
    cfg = SplitLossConfig(policy=PolicyTrainingConfig(warmup_epochs=0), teacher=TeacherConfig(every=3))
    taught = []
    for step in range(6):
        model.zero_grad()
        loss, stats = training_step(model, images, labels, cfg, epoch=0, step=step)
        loss.backward()
        taught.append("teacher_loss" in stats)
        assert sum(float(p.grad.abs().sum()) for p in model.policy.parameters() if p.grad is not None) > 0
    assert taught == [True, False, False, True, False, False] and len(calls) == 2
    with pytest.raises(ValueError, match="every must be >= 1"):
        SplitLossConfig(teacher=TeacherConfig(every=0))


@pytest.mark.parametrize("method", ["attention", "gradient"])
def test_nested_teacher_targets_are_a_tree_that_meets_the_target_ratio(method):
    """``train.teacher.targets: nested``: the nodes of all levels ranked together by
    relevance mass are a tree (nothing marked under an unmarked node) whose tokens are
    the target ratio's (``N_min + f (N_full - N_min)``) on every image. (Per-level marks
    rank each level alone; on these images their tree had 22-31 tokens where 34 were
    the target at ratio 0.5.)"""
    from splitvit.train.losses import relevance_targets, split_fraction_for_ratio

    model = tiny_model("learned")
    torch.manual_seed(1)
    images = torch.rand(6, 3, 32, 32)
    relevance = model.relevance(images, method, target=torch.arange(6) % 5)
    geometry = model.geometry_for((32, 32))
    for ratio in (0.3, 0.5, 0.7):
        fraction = split_fraction_for_ratio(ratio, geometry)
        nested = [t.bool() for t in relevance_targets(relevance, fraction, "nested")]
        assert [t.shape for t in nested] == [r.shape for r in relevance]
        assert all(torch.equal(a, b) for a, b in zip(top_down_decisions(nested), nested))  # a tree
        nodes = sum(r[0].numel() for r in relevance)
        splits = math.ceil(fraction * nodes)
        assert all(int(sum(t[i].sum() for t in nested)) == splits for i in range(6))
        expected = geometry.min_tokens + 3 * splits  # every split of a 4-way node adds 3 tokens
        assert token_counts(nested).tolist() == [expected] * 6
        # mixed: the mean of the two marks, so a node either marks gets half a target
        per_level = relevance_targets(relevance, fraction, "per_level")
        mixed = relevance_targets(relevance, fraction, "mixed")
        for m, n, p in zip(mixed, nested, per_level):
            assert torch.equal(m, (n.float() + p) / 2) and set(m.unique().tolist()) <= {0.0, 0.5, 1.0}
        assert any(not torch.equal(n.float(), p) for n, p in zip(nested, per_level))  # they differ here
    with pytest.raises(
        ValueError, match=r"train\.teacher\.targets: must be one of per_level, nested, mixed, got 'joint'"
    ):
        build_dataclass(TeacherConfig, {"targets": "joint"}, "train.teacher.")  # the name: its Literal type
    with pytest.raises(ValueError, match="teacher.targets must be one of"):
        relevance_targets(relevance, 0.5, "joint")


def test_batch_scoped_teacher_marks_rank_every_images_nodes_together():
    """``teacher_scope: batch``: the batch meets the split fraction, not each image, so
    an image whose nodes all matter more gets every mark and a blank one none; per
    image, the nested marks are still a tree."""
    from splitvit.train.losses import relevance_targets

    torch.manual_seed(0)
    cells = torch.rand(2, 8, 8) * torch.tensor([1.0, 1e-3]).view(2, 1, 1)  # image 0 busy, image 1 nearly blank
    # each node's mass: its finest cells' sum (the 4x4 nodes, then the 2x2 coarsest)
    relevance = [
        F.avg_pool2d(cells.unsqueeze(1), 4).squeeze(1) * 16,
        F.avg_pool2d(cells.unsqueeze(1), 2).squeeze(1) * 4,
    ]
    for kind in ("per_level", "nested", "mixed"):
        image = relevance_targets(relevance, 0.5, kind)
        batch = relevance_targets(relevance, 0.5, kind, "batch")
        assert [sum(float(m[i].sum()) for m in image) for i in range(2)] == [10.0, 10.0]  # each its half ...
        assert [sum(float(m[i].sum()) for m in batch) for i in range(2)] == [20.0, 0.0]  # ... or busy has all
    nested = [m.bool() for m in relevance_targets(relevance, 0.5, "nested", "batch")]
    assert all(torch.equal(a, b) for a, b in zip(top_down_decisions(nested), nested))  # a tree per image
    with pytest.raises(ValueError, match=r"teacher.scope must be one of \('image', 'batch'\), got 'canvas'"):
        relevance_targets(relevance, 0.5, "mixed", "canvas")


@pytest.mark.parametrize(
    "targets, scope", [("per_level", "image"), ("nested", "batch"), ("mixed", "image"), ("mixed", "batch")]
)
def test_the_training_step_teaches_with_the_configured_targets(monkeypatch, targets, scope):
    from splitvit.train import losses, steps

    marked = []
    original = losses.relevance_targets
    monkeypatch.setattr(
        losses, "relevance_targets", lambda r, f, kind, sc: marked.append((kind, sc)) or original(r, f, kind, sc)
    )
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=0),
        teacher=TeacherConfig(kind="attention", targets=targets, scope=scope),
    )
    _, stats = steps.training_step(tiny_model("learned").train(), torch.rand(4, 3, 32, 32), torch.arange(4), cfg, 0)
    assert marked == [(targets, scope)] and stats["teacher_loss"] > 0


def test_distillation_loss_is_the_kl_divergence_from_the_teacher():
    torch.manual_seed(0)
    student, teacher = torch.randn(4, 5, requires_grad=True), torch.randn(4, 5, requires_grad=True)
    expected = F.kl_div(
        F.log_softmax(student / 2, 1), F.log_softmax(teacher / 2, 1), log_target=True, reduction="batchmean"
    )
    loss = distillation_loss(student, teacher, temperature=2.0)
    assert loss.item() == pytest.approx(4 * expected.item(), rel=1e-5)  # scaled by T**2
    loss.backward()
    assert student.grad.abs().sum() > 0 and teacher.grad is None  # the teacher is detached
    assert distillation_loss(teacher.detach(), teacher.detach()).item() == pytest.approx(0.0, abs=1e-6)
    # per pixel for dense logits: the mean of the per-pixel divergences
    dense_s, dense_t = torch.randn(2, 3, 4, 4), torch.randn(2, 3, 4, 4)
    flat = distillation_loss(dense_s.permute(0, 2, 3, 1).reshape(-1, 3), dense_t.permute(0, 2, 3, 1).reshape(-1, 3))
    assert distillation_loss(dense_s, dense_t).item() == pytest.approx(flat.item(), rel=1e-5)
    # unlabelled pixels (255) count no more in the divergence than in the task loss
    mask = torch.zeros(2, 4, 4, dtype=torch.long)
    mask[:, :2] = 255
    top = distillation_loss(dense_s[:, :, 2:], dense_t[:, :, 2:])
    assert distillation_loss(dense_s, dense_t, target=mask).item() == pytest.approx(top.item(), rel=1e-5)
    assert distillation_loss(dense_s, dense_t, target=torch.full_like(mask, 255)).item() == 0.0
    labels = torch.tensor([0, 1, 2, 3])  # a classification target changes nothing
    assert distillation_loss(student, teacher, 2.0, labels).item() == pytest.approx(loss.item(), rel=1e-6)


def test_feature_distillation_loss_is_the_squared_error_relative_to_the_teachers_variance():
    torch.manual_seed(0)
    teacher = 3.0 + 5.0 * torch.randn(2, 8, 4, 4)
    student = torch.randn(2, 8, 4, 4, requires_grad=True)
    held = teacher.clone().requires_grad_(True)
    loss = feature_distillation_loss(student, held)
    assert loss.item() == pytest.approx(float(((student - teacher) ** 2).mean() / teacher.var()), rel=1e-5)
    loss.backward()
    assert student.grad.abs().sum() > 0 and held.grad is None  # the teacher is detached
    assert feature_distillation_loss(teacher, teacher).item() == 0.0
    # the teacher's mean everywhere scores about 1, at any scale of the features
    mean = torch.full_like(teacher, float(teacher.mean()))
    assert feature_distillation_loss(mean, teacher).item() == pytest.approx(1.0, abs=0.01)
    assert feature_distillation_loss(100 * student, 100 * teacher).item() == pytest.approx(loss.item(), rel=1e-5)


def test_self_distillation_teaches_the_split_path_the_full_resolution_logits(monkeypatch):
    """``distill_weight``: the split path learns the same model's full-resolution
    logits. On a relevance-teacher step the teacher's pass gives them (no extra
    forward); on other steps one gradient-free full-resolution pass runs; a
    full-resolution model (nothing to distil) and the warm-up get no such loss."""
    from splitvit.train.steps import training_step

    torch.manual_seed(0)
    model = tiny_model("learned").train()
    images, labels = torch.rand(4, 3, 32, 32), torch.tensor([0, 1, 2, 3])
    passes = []
    forward = model.forward
    monkeypatch.setattr(
        model, "forward", lambda *a, **k: passes.append(k.get("decisions") is not None) or forward(*a, **k)
    )
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=0),
        teacher=TeacherConfig(every=2),
        distill=DistillConfig(weight=1.0, temperature=2.0),
    )
    _, taught = training_step(model, images, labels, cfg, epoch=0, step=0)
    assert "teacher_loss" in taught and taught["distill_loss"] > 0
    assert passes.count(False) == 1 and passes.count(True) == 1  # the policy's pass and the teacher's
    passes.clear()
    _, untaught = training_step(model, images, labels, cfg, epoch=0, step=1)
    assert "teacher_loss" not in untaught and untaught["distill_loss"] > 0 and passes == [False, True]
    _, warm = training_step(model, images, labels, replace(cfg, policy=replace(cfg.policy, warmup_epochs=1)), epoch=0)
    assert "distill_loss" not in warm
    full = tiny_model("full").train()
    assert "distill_loss" not in training_step(full, images, labels, cfg, epoch=0)[1]
    # a fixed policy's split path is distilled too
    coarse = tiny_model("coarse").train()
    loss, stats = training_step(coarse, images, labels, replace(cfg, teacher=replace(cfg.teacher, weight=0.0)), epoch=0)
    assert stats["distill_loss"] > 0 and loss.item() == pytest.approx(
        stats["task_loss"] + stats["distill_loss"], rel=1e-5
    )
    # gradient steps on the distillation alone bring the coarse logits toward the full ones
    optimizer = torch.optim.SGD(coarse.parameters(), lr=0.5)

    def gap() -> float:
        with torch.no_grad():
            return distillation_loss(
                coarse(images).logits, coarse(images, decisions=coarse.full_decisions(images)).logits
            ).item()

    before = gap()
    for _ in range(5):
        optimizer.zero_grad()
        out = coarse(images)
        with torch.no_grad():
            target = coarse(images, decisions=coarse.full_decisions(images)).logits
        distillation_loss(out.logits, target).backward()
        optimizer.step()
    assert gap() < before


class _HostReads(torch.overrides.TorchFunctionMode):
    """Counts the tensor operations that read a value back to the host (on a GPU, a
    synchronisation): ``item``, ``tolist``, truth and number conversions, ``nonzero``,
    boolean-mask indexing, ``repeat_interleave`` without ``output_size``, ``cpu``."""

    READS = {
        torch.Tensor.item,
        torch.Tensor.tolist,
        torch.Tensor.__bool__,
        torch.Tensor.__int__,
        torch.Tensor.__float__,
        torch.Tensor.__index__,
        torch.Tensor.nonzero,
        torch.nonzero,
        torch.Tensor.cpu,
        torch.Tensor.numpy,
        torch.masked_select,
        torch.Tensor.masked_select,
    }

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if func in self.READS:
            self.reads.append(name)
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in index):
                self.reads.append(f"{name}[bool mask]")
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None:
                self.reads.append(name)
        return func(*args, **kwargs)


@pytest.mark.parametrize("policy", ["learned", "entropy"])
@pytest.mark.parametrize("buckets", [0, 3])
def test_device_path_reads_the_host_once_per_forward(policy, buckets, monkeypatch):
    """The packed path as it runs on CUDA (a host-read-free varlen kernel standing in
    for FlashAttention): one read-back per forward pass, before the blocks. The CUDA
    twin of this test runs under ``torch.cuda.set_sync_debug_mode``."""
    from splitvit.model import packed
    from splitvit.model import splitvit as splitvit_module

    monkeypatch.setattr(splitvit_module, "varlen_kernel", lambda device: packed.masked_kernel)
    model = tiny_model(policy, token_buckets=buckets).eval()
    images = _mixed_images()
    model.set_thresholds(calibrate_thresholds(model, images, 0.5))
    with torch.no_grad():
        with _HostReads() as mode:
            out = model(images)
    assert len(set(out.tokens.tolist())) > 1  # a mixed batch: the packed path ran
    assert mode.reads == ["tolist"], mode.reads


def test_token_buckets_fix_the_encoders_shapes_and_keep_the_logits(monkeypatch):
    """``token_buckets``: at most N packed sizes reach the blocks whatever the batch's
    lengths, dummy sequences change no real token, and the compiled encoder
    (``compile_encoder``) compiles once per shape and gives the eager logits."""
    from torch._dynamo.testing import CompileCounter

    from splitvit.model import packed
    from splitvit.model import splitvit as splitvit_module

    monkeypatch.setattr(splitvit_module, "varlen_kernel", lambda device: packed.masked_kernel)
    exact = tiny_model("entropy").eval()
    bucketed = SplitViT(exact.vit, levels=3, policy="entropy", image_size=32, token_buckets=2).eval()
    compiled = SplitViT(copy.deepcopy(exact.vit), levels=3, policy="entropy", image_size=32, token_buckets=2).eval()
    counter = CompileCounter()
    compiled.compile_encoder(backend=counter)
    sizes = []
    hook = exact.vit.blocks[0].norm1.register_forward_hook(lambda m, args, out: sizes.append(args[0].shape[0]))
    totals = set()
    images = _mixed_images()
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for rate in (0.1, 0.3, 0.5, 0.7, 0.9):
            wishes = [torch.rand(5, *exact.geometry.grid(level), generator=generator) < rate for level in range(2)]
            decisions = top_down_decisions(wishes)
            expected = exact(images, decisions=decisions)
            sizes.clear()
            got = bucketed(images, decisions=decisions)
            totals.add(int(got.tokens.sum()))
            assert torch.equal(got.tokens, expected.tokens)
            assert (got.logits - expected.logits).abs().max().item() <= 1e-5
            assert (compiled(images, decisions=decisions).logits - expected.logits).abs().max().item() <= 1e-5
            if len(set(got.tokens.tolist())) > 1:
                full = 5 * (64 + 1)  # every sequence full, class token included
                assert sizes and set(sizes) <= {full // 2 + 1, full}, sizes  # one of the two buckets
    hook.remove()
    assert len(totals) >= 3  # the batches' lengths varied
    assert counter.frame_count <= 2 * 2  # two pieces per block, one graph per bucket (shared by the blocks)
    with pytest.raises(ValueError, match="token_buckets"):
        tiny_model("entropy", token_buckets=-1)


def test_compiled_encoder_covers_the_dense_path_with_one_graph_for_all_blocks():
    """``compile_encoder`` also compiles whole blocks where every image has the same
    length (the ``full`` policy): the logits stay the eager ones, the blocks share one
    graph per batch size, and training keeps the eager blocks."""
    from torch._dynamo.testing import CompileCounter

    eager = tiny_model("full").eval()
    compiled = SplitViT(copy.deepcopy(eager.vit), levels=3, policy="full", image_size=32).eval()
    counter = CompileCounter()
    compiled.compile_encoder(backend=counter)
    images = _mixed_images()
    with torch.no_grad():
        for batch in (images, images[:3], images):
            assert (compiled(batch).logits - eager(batch).logits).abs().max().item() <= 1e-5
    assert counter.frame_count == 2  # one graph per batch size, shared by every block
    compiled.train()
    compiled(images).logits.sum().backward()
    assert counter.frame_count == 2  # training ran the eager blocks


def test_geometry_cache_is_per_model_and_lets_the_model_go():
    """Other input sizes' geometries are cached on the model itself: a second size is
    built once, and a dropped model is freed (a cache on the method kept it alive)."""
    import gc
    import weakref

    model = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        levels=2,
        image_size=64,
        num_classes=3,
        timm_kwargs={"embed_dim": 32, "depth": 2, "num_heads": 2, "patch_size": 8, "dynamic_img_size": True},
    )
    other = model.geometry_for((32, 48))
    assert other is model.geometry_for((32, 48)) and other.image_size == (32, 48)
    assert model.geometry_for((64, 64)) is model.geometry
    alive = weakref.ref(model)
    del model, other
    gc.collect()
    assert alive() is None


@pytest.mark.parametrize("teacher", ["gradient", "attention"])
def test_the_policys_own_epochs_train_the_policy_alone(teacher):
    """``train.policy.epochs``' step (:func:`policy_training_step`): the teacher's loss on
    the policy's scores and nothing else, so every weight outside the policy gets no
    gradient and the policy's do."""
    from splitvit.train.steps import policy_training_step

    model = tiny_model("learned").train()
    images, labels = torch.rand(4, 3, 32, 32), torch.arange(4)
    cfg = SplitLossConfig(teacher=TeacherConfig(kind=teacher, weight=2.0), budget=BudgetConfig(target_ratio=0.5))
    loss, stats = policy_training_step(model, images, labels, cfg)
    assert set(stats) == {"teacher_loss", "loss"} and stats["loss"] == pytest.approx(2.0 * stats["teacher_loss"])
    loss.backward()
    policy = {id(p) for p in model.policy.parameters()}
    assert all(p.grad is not None and float(p.grad.abs().sum()) > 0 for p in model.policy.parameters())
    assert all(p.grad is None for p in model.parameters() if id(p) not in policy)


def test_the_schedule_restarts_its_cosine_for_the_policys_own_epochs():
    from splitvit.train.phases import warmup_cosine

    def factors(tail: int) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = warmup_cosine(optimizer, 2, 10, tail)
        return [schedule.lr_lambdas[0](step) for step in range(16)]

    plain, tailed = factors(0), factors(4)
    assert plain[:10] == tailed[:10] and plain[9] < 0.05 and plain[10:] == [0.0] * 6
    assert tailed[10] == 1.0 and tailed[12] == pytest.approx(0.5) and tailed[14:] == [0.0, 0.0]


def test_the_policys_lead_epochs_run_their_own_cosine_and_shift_the_fine_tunes_schedule():
    """``train.policy.lead_epochs``: a cosine from the peak over the lead's steps, then the
    fine-tune's warm-up and cosine exactly as without a lead, then the tail's."""
    from splitvit.train.phases import warmup_cosine

    def factors(lead: int) -> list[float]:
        optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
        schedule = warmup_cosine(optimizer, 2, 10, 4, lead_steps=lead)
        return [schedule.lr_lambdas[0](step) for step in range(lead + 14)]

    plain, led = factors(0), factors(4)
    assert led[0] == 1.0 and led[2] == pytest.approx(0.5)
    assert led[3] == pytest.approx(0.5 * (1 + math.cos(0.75 * math.pi)))
    assert led[4:] == plain and led[4] == 0.5  # the fine-tune's warm-up starts after the lead
