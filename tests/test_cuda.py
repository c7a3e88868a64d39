"""CUDA paths: FlashAttention varlen packing, bf16 autocast training steps, GPU
evaluation. Skipped where no GPU is visible (CI has none); run on a GPU machine with

    python -m pytest tests/test_cuda.py
"""

from __future__ import annotations

import pytest
import torch

from splitvit.config import BudgetConfig, PolicyConfig, PolicyTrainingConfig
from splitvit.model import SplitViT
from splitvit.model.packed import varlen_kernel
from splitvit.train.steps import SplitLossConfig, calibrate_thresholds, evaluate, training_step

from .test_model import tiny_vit

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CUDA = torch.device("cuda")


def _pair(policy: str, **kwargs) -> tuple[SplitViT, SplitViT]:
    """Packed and padded models sharing weights and policy, on the GPU."""
    vit = tiny_vit(32, embed_dim=64, num_heads=2, **kwargs)
    packed = SplitViT(vit, policy=PolicyConfig(kind=policy, depth=1), levels=3, image_size=32)
    padded = SplitViT(vit, policy=packed.policy_config, levels=3, image_size=32, attention="padded")
    padded.policy = packed.policy  # the same policy module: the same decisions
    padded.level_embed = packed.level_embed
    return packed.to(CUDA), padded.to(CUDA)


def _images(n: int = 16) -> torch.Tensor:
    torch.manual_seed(5)
    images = torch.rand(n, 3, 32, 32)
    images[0] = 0.5  # flat: all-coarse
    images[1, :, :16] = 0.2  # half flat
    return images.to(CUDA)


def test_varlen_kernel_matches_per_sequence_attention_in_bf16_and_fp32():
    from splitvit.model.packed import reference_kernel

    kernel = varlen_kernel(CUDA)
    assert kernel is not None, "torch.nn.attention.varlen is missing from this torch"
    torch.manual_seed(0)
    lengths = [1, 17, 5, 64, 33]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=CUDA)
    for dtype, tol in ((torch.bfloat16, 2e-2), (torch.float32, 1e-5)):
        q, k, v = (torch.randn(sum(lengths), 2, 32, device=CUDA, dtype=dtype) for _ in range(3))
        got = kernel(q, k, v, cu, cu, max(lengths), max(lengths), scale=32**-0.5)
        want = reference_kernel(q.double(), k.double(), v.double(), cu, cu, max(lengths), max(lengths), scale=32**-0.5)
        rel = (got.double() - want).norm() / want.norm()
        assert got.dtype == dtype and rel <= tol, (dtype, float(rel))


@pytest.mark.parametrize("policy", ["learned", "entropy", "random"])
def test_packed_varlen_equals_padded_on_cuda(policy):
    packed, padded = _pair(policy)
    images = _images()
    torch.manual_seed(1)
    thresholds = calibrate_thresholds(packed.eval(), images, 0.5)  # an untrained policy scores near 0.5
    with torch.no_grad():
        for autocast, tol in ((False, 1e-4), (True, 5e-2)):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                torch.manual_seed(1)
                a = packed.eval()(images, thresholds=thresholds)
                torch.manual_seed(1)
                b = padded.eval()(images, thresholds=thresholds)
            assert torch.equal(a.tokens, b.tokens)
            assert len(set(a.tokens.tolist())) > 1
            assert a.attention_slots is None  # the varlen kernel ran, not the CPU grouping
            scale = b.logits.float().abs().max().item()
            assert (a.logits.float() - b.logits.float()).abs().max().item() <= tol * max(scale, 1.0), (policy, autocast)


def test_packed_varlen_gradients_match_padded_under_bf16():
    packed, padded = _pair("learned")
    images = _images()
    grads = []
    for model in (packed, padded):
        model.train().zero_grad()
        torch.manual_seed(7)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = model(images)
            loss = out.logits.float().square().mean() + out.expected_tokens.mean() / out.full_tokens
        loss.backward()
        grads.append({n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None})
    assert set(grads[0]) == set(grads[1]) and any(n.startswith("policy.") for n in grads[0])
    for name, g in grads[0].items():
        ref = grads[1][name]
        assert torch.isfinite(g).all(), name
        assert (g - ref).norm() <= 0.05 * ref.norm() + 1e-6, name


@pytest.mark.parametrize("epoch", [0, 1, 3])  # full-resolution warm-up, random splits, learned policy + teacher
def test_training_steps_run_on_cuda_under_bf16(epoch):
    packed, _ = _pair("learned")
    cfg = SplitLossConfig(
        budget=BudgetConfig(target_ratio=0.4, weight=2.0), policy=PolicyTrainingConfig(warmup_epochs=2)
    )
    optimizer = torch.optim.AdamW(packed.parameters(), lr=1e-3)
    images, target = _images(), torch.randint(0, 5, (16,), device=CUDA)
    generator = torch.Generator().manual_seed(0)  # the Ray loop's warm-up generator is a CPU one
    packed.train()
    losses = []
    for _ in range(3):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss, stats = training_step(packed, images, target, cfg, epoch, generator)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(float(loss.detach()))
    assert all(torch.isfinite(torch.tensor(losses)))
    assert ("teacher_loss" in stats) == (epoch >= 2)
    assert 0.0 < stats["token_ratio"] <= 1.0


def test_learned_scores_are_float32_under_autocast():
    packed, _ = _pair("learned")
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        scores = packed.eval().split_scores(_images())
    assert all(s.dtype == torch.float32 for s in scores)
    assert len(set(torch.cat([s.flatten() for s in scores]).tolist())) > 100  # no bf16 ties near 0.5


@pytest.mark.parametrize("autocast", [False, True])
def test_calibration_meets_the_budget_it_is_evaluated_at(autocast):
    """Calibrated and evaluated in one precision (as CheckpointEvaluator does), the
    evaluated token ratio is the calibrated one."""
    packed, _ = _pair("learned")
    images = _images(64)
    batches = [(images[i : i + 16].cpu(), torch.randint(0, 5, (16,))) for i in range(0, 64, 16)]
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        thresholds = calibrate_thresholds(packed.eval(), images, 0.4)
        result = evaluate(packed, batches, thresholds=thresholds, num_classes=5)
    assert 0.0 <= result["accuracy"] <= 1.0 and result["images"] == 64
    assert abs(result["token_ratio"] - 0.4) <= 0.05


@pytest.mark.parametrize("policy", ["learned", "entropy"])
@pytest.mark.parametrize("token_buckets", [0, 4])
def test_forward_synchronises_with_the_host_at_most_once(policy, token_buckets):
    """The packed varlen path under bf16: at most one synchronising CUDA operation per
    forward pass (the read-back of the token counts, before the blocks), as counted
    by ``torch.cuda.set_sync_debug_mode``."""
    import warnings

    model = (
        SplitViT(
            tiny_vit(32, embed_dim=64, num_heads=2),
            policy=PolicyConfig(kind=policy, depth=1),
            levels=3,
            image_size=32,
            token_buckets=token_buckets,
        )
        .to(CUDA)
        .eval()
    )
    images = _images()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.set_thresholds(calibrate_thresholds(model, images, 0.5))
        model(images)  # lazy initialisation out of the count
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                out = model(images)
            finally:
                torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(set(out.tokens.tolist())) > 1  # a mixed batch: the packed path ran
    assert len(syncs) <= 1, syncs


def test_compiled_encoder_with_token_buckets_matches_eager():
    """``compile_encoder`` over ``token_buckets``: the encoder's per-token work under
    ``torch.compile`` gives the eager logits on the GPU."""
    eager = (
        SplitViT(tiny_vit(32, embed_dim=64, num_heads=2), levels=3, policy="entropy", image_size=32, token_buckets=4)
        .to(CUDA)
        .eval()
    )
    compiled = SplitViT(eager.vit, levels=3, policy="entropy", image_size=32, token_buckets=4).to(CUDA).eval()
    compiled.compile_encoder()
    images = _images()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for t in (0.3, 0.5, 0.7):
            a, b = eager(images, thresholds=[t, t]), compiled(images, thresholds=[t, t])
            assert torch.equal(a.tokens, b.tokens)
            assert (a.logits.float() - b.logits.float()).abs().max().item() <= 2e-2  # bf16


def test_compiled_dense_path_matches_eager():
    """``compile_encoder`` on a model whose images all keep one length (``full``): the
    whole blocks under ``torch.compile`` with CUDA graphs give the eager logits."""
    eager = SplitViT(tiny_vit(32, embed_dim=64, num_heads=2), levels=3, policy="full", image_size=32).to(CUDA).eval()
    compiled = SplitViT(eager.vit, levels=3, policy="full", image_size=32).to(CUDA).eval()
    compiled.compile_encoder(mode="reduce-overhead")
    images = _images()
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        for _ in range(3):  # CUDA graphs record on the first calls, then replay
            a, b = eager(images), compiled(images)
            assert (a.logits.float() - b.logits.float()).abs().max().item() <= 2e-2  # bf16
