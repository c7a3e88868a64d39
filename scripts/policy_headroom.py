"""How far can a detector's learned policy get on its own features with more steps?

    .venv/bin/python scripts/policy_headroom.py CHECKPOINT [--steps 1128] [--lr 3e-3] [--json OUT]

Loads a fine-tuned detector (e.g. a detection study's `split-0.5-objects-d2-s0/checkpoint_epoch0002`),
freezes everything but the policy's own modules, and goes on training them alone with the
objects teacher (`train.teacher.kind: objects`, the checkpoint's teacher targets, target
ratio, scope and context unless `--teacher-scope` / `--teacher-context` say otherwise)
on the training canvases: the step of `train.policy.epochs` (`detection_policy_step`),
at a constant learning rate. Every `--every` steps, on `--samples` validation
canvases: each scored level's ROC AUC of the policy's scores against "the node holds
instance-mask pixels" (the oracle's splits, `splitvit eval --oracle`), and at each
`--ratios` token ratio (thresholds calibrated on those same canvases) the share of the
items' finest cells kept fine (`object_coverage`). The policy reads the backbone's
features detached, as in training, so a plateau here is what those features allow a
policy of this size, not a matter of steps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch
from torch.utils.data import DataLoader

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))  # this checkout's splitvit

from splitvit.config import TEACHER_SCOPES, SplitLossConfig, build_dataclass, upgrade_sections  # noqa: E402
from splitvit.data import detection_collate  # noqa: E402
from splitvit.model.detection import SplitDetector  # noqa: E402
from splitvit.model.quadtree import top_down_decisions  # noqa: E402
from splitvit.train.detection import annotation_decisions, detection_policy_step  # noqa: E402
from splitvit.train.evaluation import CheckpointEvaluator  # noqa: E402
from splitvit.train.steps import calibrate_thresholds, object_counts, object_figures  # noqa: E402


def roc_auc(scores: torch.Tensor, labels: torch.Tensor) -> float:
    """The ROC AUC of ``scores`` for boolean ``labels`` (Mann-Whitney: the chance that a
    positive outscores a negative; ties count half). NaN without both classes."""
    s, y = scores.flatten().double(), labels.flatten().bool()
    positives, negatives = int(y.sum()), int((~y).sum())
    if not positives or not negatives:
        return float("nan")
    greater = (s[y].unsqueeze(1) > s[~y].unsqueeze(0)).double().sum()
    ties = (s[y].unsqueeze(1) == s[~y].unsqueeze(0)).double().sum()
    return float((greater + 0.5 * ties) / (positives * negatives))


def policy_figures(detector: SplitDetector, images: torch.Tensor, targets: list, ratios: list[float]) -> dict:
    """Per-level AUC against the oracle's splits, and item coverage at each ratio."""
    backbone = detector.backbone
    geometry = backbone.geometry_for(tuple(images.shape[-2:]))
    was_training = detector.training
    detector.eval()
    with torch.no_grad():
        scores = backbone.split_scores(images)
        oracle = annotation_decisions(targets, geometry)
        figures: dict = {"auc": [roc_auc(s, o) for s, o in zip(scores, oracle)], "coverage": {}}
        masks = torch.stack([(t["masks"] > 0).any(dim=0) for t in targets])
        for ratio in ratios:
            thresholds = calibrate_thresholds(backbone, images, ratio)
            decisions = top_down_decisions([s > t for s, t in zip(scores, thresholds)])
            # a finest cell is a token of its own when its last-level parent split (1), else not (0)
            fine = decisions[-1].long().repeat_interleave(2, 1).repeat_interleave(2, 2)
            counts = object_counts(fine, 1, geometry.patch_size, masks)
            figures["coverage"][str(ratio)] = object_figures(*counts).get("object_coverage", float("nan"))
    detector.train(was_training)
    return figures


def test_figures(
    tester: CheckpointEvaluator, calibration: CheckpointEvaluator, detector: SplitDetector, images, ratios
) -> dict:
    """Box AP, mask AP, coverage and token ratio on the test canvases at each ratio,
    thresholds calibrated on the validation ``images``."""
    figures = {}
    for ratio in ratios:
        thresholds = calibration.calibrate(images, ratio, model=detector)
        found = tester.evaluate(thresholds, model=detector)
        figures[str(ratio)] = {k: found[k] for k in ("box_ap", "mask_ap", "object_coverage", "token_ratio")}
    return figures


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a fine-tuned detector's checkpoint folder")
    parser.add_argument(
        "--steps", type=int, default=1128, help="policy-only steps (default: 2 epochs of 3000 canvases)"
    )
    parser.add_argument("--lr", type=float, default=3e-3, help="the policy's learning rate (the study's: 3e-4 x 10)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--every", type=int, default=188, help="report every this many steps")
    parser.add_argument("--samples", type=int, default=500, help="validation canvases the figures are taken on")
    parser.add_argument("--ratios", default="0.5,0.7")
    parser.add_argument(
        "--policy-depth",
        type=int,
        help="score from the ViT's first N blocks instead of the checkpoint's model.policy.depth "
        "(richer features for the policy; its heads retrain on them from where they are)",
    )
    parser.add_argument(
        "--teacher-scope",
        choices=TEACHER_SCOPES,
        help="rank the teacher's marks within each image or across the batch (train.teacher.scope; "
        "default: the checkpoint's)",
    )
    parser.add_argument(
        "--teacher-context", type=int, help="the teacher's context ring in pixels (default: the checkpoint's)"
    )
    parser.add_argument(
        "--fine-evidence",
        action="store_true",
        help="give the policy fine evidence (model.policy.fine_evidence: the most telling finest patch "
        "under each node), zero at first, trained with the rest of the policy",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--test-samples",
        type=int,
        default=0,
        help="before and after: box and mask AP on this many test canvases at each ratio, thresholds "
        "calibrated on the validation canvases (the study's protocol); 0: off",
    )
    parser.add_argument("--json", help="write every report to this JSON file")
    args = parser.parse_args(argv)
    torch.manual_seed(args.seed)
    ratios = [float(r) for r in args.ratios.split(",")]

    evaluator = CheckpointEvaluator(args.checkpoint, split="val", samples=args.samples)
    detector = evaluator.model
    if not isinstance(detector, SplitDetector) or not detector.backbone.policy.learned:
        sys.exit(f"{args.checkpoint}: not a detector with a learned policy")
    if args.policy_depth is not None and not 0 <= args.policy_depth <= len(detector.backbone.vit.blocks):
        sys.exit(f"--policy-depth must be in [0, {len(detector.backbone.vit.blocks)}], got {args.policy_depth}")
    # the checkpoint's own SPLIT objective (settings it predates keep their defaults), taught by the annotations
    trained = evaluator.payload["config"]["train"]
    trained = upgrade_sections({"train": trained}, warn=False)["train"]  # a checkpoint's old key names too
    names = {f.name for f in dataclasses.fields(SplitLossConfig)}
    loss_cfg = build_dataclass(SplitLossConfig, {k: v for k, v in trained.items() if k in names}, "train.")
    overrides = {"scope": args.teacher_scope, "context": args.teacher_context}
    teacher = dataclasses.replace(
        loss_cfg.teacher, kind="objects", **{key: value for key, value in overrides.items() if value is not None}
    )
    loss_cfg = dataclasses.replace(loss_cfg, teacher=teacher)
    images, targets = detection_collate([evaluator.dataset[i] for i in range(len(evaluator.dataset))])
    train = evaluator.split_dataset("train")
    backbone = detector.backbone

    if args.fine_evidence and not backbone.policy_config.fine_evidence:
        backbone.policy_config.fine_evidence = True
        trained_policy = backbone.policy
        backbone.set_policy("learned")  # the same policy with the evidence MLP, its last layer zero
        backbone.policy.load_state_dict(trained_policy.state_dict(), strict=False)
    for parameter in detector.parameters():
        parameter.requires_grad_(False)
    own = list(backbone.policy.parameters())
    for parameter in own:
        parameter.requires_grad_(True)
    optimizer = torch.optim.AdamW(own, lr=args.lr, weight_decay=0.0)
    generator = torch.Generator().manual_seed(args.seed)
    loader = DataLoader(
        train, batch_size=args.batch_size, shuffle=True, collate_fn=detection_collate, generator=generator
    )

    tester = (
        CheckpointEvaluator(args.checkpoint, split="test", samples=args.test_samples) if args.test_samples else None
    )
    before = test_figures(tester, evaluator, detector, images, ratios) if tester else None
    reports = [{"step": 0, **policy_figures(detector, images, targets, ratios)}]
    print(
        f"{args.checkpoint}: {len(train)} training canvases, teacher targets {loss_cfg.teacher.targets}, "
        f"ranked per {loss_cfg.teacher.scope}, context {loss_cfg.teacher.context} px, "
        f"policy depth {backbone.policy_config.depth}"
        + (", fine evidence" if backbone.policy_config.fine_evidence else "")
        + ("" if args.policy_depth is None else f", trained on at depth {args.policy_depth}")
    )
    print(f"step 0: {reports[-1]}", flush=True)
    if args.policy_depth is not None:  # "before" and step 0 are the checkpoint's own
        backbone.policy_config.depth = args.policy_depth
    detector.train()
    step, start = 0, time.perf_counter()
    while step < args.steps:
        for batch_images, batch_targets in loader:
            loss, _ = detection_policy_step(detector, batch_images, batch_targets, loss_cfg, generator)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            step += 1
            if step % args.every == 0 or step == args.steps:
                reports.append(
                    {"step": step, "loss": float(loss.detach()), **policy_figures(detector, images, targets, ratios)}
                )
                print(f"step {step} ({time.perf_counter() - start:.0f} s): {reports[-1]}", flush=True)
            if step >= args.steps:
                break
    result = {
        "checkpoint": args.checkpoint,
        "lr": args.lr,
        "steps": args.steps,
        "policy_depth": backbone.policy_config.depth,
        "fine_evidence": backbone.policy_config.fine_evidence,
        "reports": reports,
    }
    if tester:
        result["test"] = {"before": before, "after": test_figures(tester, evaluator, detector, images, ratios)}
        for when in ("before", "after"):
            line = ", ".join(
                f"{r}: box AP {f['box_ap'] * 100:.1f}, mask AP {f['mask_ap'] * 100:.1f}, "
                f"coverage {f['object_coverage']:.3f} at {f['token_ratio']:.3f}"
                for r, f in result["test"][when].items()
            )
            print(f"test ({args.test_samples} canvases), {when}: {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
