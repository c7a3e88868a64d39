"""SPLIT's objective and COCO evaluation for detection (issue 34): the training step
(warm-up, budget penalty, the detection loss's relevance teacher), evaluation through
the COCO files the procedural set writes, shards that merge into one evaluation, and
a detector checkpoint that loads back to the same detections."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, Subset

from splitvit.config import (
    BudgetConfig,
    ConfigError,
    DistillConfig,
    PolicyConfig,
    PolicyTrainingConfig,
    SplitLossConfig,
    TeacherConfig,
)
from splitvit.data.coco import CocoDetection
from splitvit.data.fashion_det import FashionDetection, write_coco
from splitvit.data.fashion_mnist import CLASSES
from splitvit.model.detection import SplitDetector
from splitvit.model.quadtree import QuadtreeGeometry
from splitvit.train.coco_eval import coco_evaluate, detection_records, load_ground_truth
from splitvit.train.detection import (
    DetectionTotals,
    annotation_decisions,
    detection_relevance,
    detection_training_step,
    evaluate_detection_totals,
)

from .helpers import fake_items
from .test_detection_model import SMALL_HEADS

CANVAS, LEVELS = 64, 2


def detector(policy: str = "learned", seed: int = 0) -> SplitDetector:
    """A tiny detector built from a timm name (so it can be saved): 64-px canvas, 8-px
    finest patches (16-px coarse), 10 Fashion-MNIST classes."""
    torch.manual_seed(seed)
    return SplitDetector.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(kind=policy, depth=1),
        num_classes=10,
        pyramid_channels=32,
        detector_options=SMALL_HEADS,
        timm_kwargs=dict(patch_size=8, embed_dim=48, depth=2, num_heads=2),
        levels=LEVELS,
        image_size=CANVAS,
        thresholds=0.5,
    )


def collate(batch):
    return torch.stack([image for image, _ in batch]), [target for _, target in batch]


@pytest.fixture(scope="module")
def coco_set(tmp_path_factory):
    """Eight procedural canvases (2-3 items of 16-28 px, no clutter) written as COCO files
    and read back with the COCO loader: the path real COCO data takes."""
    images, labels = fake_items(64, seed=3)
    procedural = FashionDetection(
        images,
        labels,
        image_size=CANVAS,
        num_samples=8,
        min_items=2,
        max_items=3,
        min_item_size=16,
        max_item_size=28,
        clutter=False,
        seed=1,
    )
    files = write_coco(procedural, tmp_path_factory.mktemp("coco"), "train")
    return CocoDetection(files.annotation_file, files.image_root)


def test_warm_up_trains_at_full_resolution_first_then_the_policy_with_budget_and_teacher(coco_set):
    model = detector("learned").train()
    images, targets = collate([coco_set[i] for i in range(2)])
    cfg = SplitLossConfig(
        policy=PolicyTrainingConfig(warmup_epochs=2),
        budget=BudgetConfig(target_ratio=0.5, weight=1.0),
        teacher=TeacherConfig(weight=1.0),
    )
    _, stats = detection_training_step(model, images, targets, cfg, epoch=0)
    assert stats["token_ratio"] == 1.0 and "budget_penalty" not in stats and "teacher_loss" not in stats
    assert {"loss_objectness", "loss_rpn_box_reg", "loss_classifier", "loss_box_reg", "loss_mask"} <= set(stats)
    model.zero_grad()
    loss, stats = detection_training_step(model, images, targets, cfg, epoch=2, step=0)
    assert {"budget_penalty", "teacher_loss"} <= set(stats) and 0 < stats["token_ratio"] < 1
    assert stats["loss"] == pytest.approx(
        stats["task_loss"] + stats["teacher_loss"] + stats["budget_penalty"], rel=1e-5
    )
    loss.backward()
    policy_grads = [p.grad for p in model.backbone.policy.parameters() if p.requires_grad]
    assert policy_grads and all(g is not None for g in policy_grads)
    assert sum(float(g.abs().sum()) for g in policy_grads) > 0  # the policy learns from budget and teacher
    # the teacher runs on every teacher_every-th step only
    _, stats = detection_training_step(
        model, images, targets, SplitLossConfig(teacher=TeacherConfig(every=2)), epoch=5, step=1
    )
    assert "teacher_loss" not in stats and "budget_penalty" in stats


def test_the_teacher_relevance_is_the_detection_losss_gradient_on_each_node(coco_set):
    model = detector("learned").train()
    images, targets = collate([coco_set[i] for i in range(2)])
    relevance = detection_relevance(model, images, targets)
    geometry = model.backbone.geometry_for((CANVAS, CANVAS))
    assert [tuple(r.shape) for r in relevance] == [(2, *geometry.grid(level)) for level in range(LEVELS - 1)]
    assert all(bool(torch.isfinite(r).all()) and bool((r >= 0).all()) for r in relevance)
    assert all(float(r.sum()) > 0 for r in relevance)
    # no boxes: the box and mask losses vanish, and the relevance with them (up to the RPN's background)
    empty = [{**t, **{k: t[k][:0] for k in ("boxes", "labels", "masks", "iscrowd", "area")}} for t in targets]
    torch.manual_seed(0)
    background = detection_relevance(model, images, empty)
    assert all(float(b.sum()) < float(r.sum()) for b, r in zip(background, relevance))


def test_self_distillation_teaches_the_split_fine_map_the_full_resolution_one(coco_set):
    """``distill_weight`` on a detector: the split path's fine map learns the same
    backbone's full-resolution fine map (relative squared error, the teacher detached);
    not in warm-up, not under the full policy."""
    images, targets = collate([coco_set[i] for i in range(2)])
    cfg = SplitLossConfig(policy=PolicyTrainingConfig(warmup_epochs=1), distill=DistillConfig(weight=2.0))
    model = detector("coarse").train()
    loss, stats = detection_training_step(model, images, targets, cfg, epoch=1)
    backbone = model.backbone
    with torch.no_grad():
        coarse, _ = backbone.fine_features(images, decisions=[~d for d in backbone.full_decisions(images)])
        full, _ = backbone.fine_features(images, decisions=backbone.full_decisions(images))
    expected = float(((coarse - full) ** 2).mean() / full.var())
    assert stats["distill_loss"] == pytest.approx(expected, rel=1e-5) and expected > 0.05
    assert stats["loss"] == pytest.approx(stats["task_loss"] + 2.0 * expected, rel=1e-5)
    model.zero_grad()
    loss.backward()
    assert float(backbone.vit.blocks[-1].mlp.fc2.weight.grad.abs().sum()) > 0
    learned = detector("learned").train()
    _, stats = detection_training_step(learned, images, targets, cfg, epoch=1)
    assert stats["distill_loss"] > 0 and stats["loss"] == pytest.approx(
        stats["task_loss"] + stats["teacher_loss"] + stats["budget_penalty"] + 2.0 * stats["distill_loss"], rel=1e-5
    )
    assert "distill_loss" not in detection_training_step(learned, images, targets, cfg, epoch=0)[1]  # warm-up
    assert "distill_loss" not in detection_training_step(detector("full").train(), images, targets, cfg, epoch=1)[1]


def test_labels_the_detector_cannot_predict_are_refused(coco_set):
    images, targets = collate([coco_set[0]])
    targets[0]["labels"] = targets[0]["labels"].clone()
    targets[0]["labels"][0] = 11  # 10 object classes: labels 1..10
    with pytest.raises(ConfigError, match=r"object label 11, outside 1..10 for model.num_classes = 10") as info:
        detection_training_step(detector(), images, targets, SplitLossConfig(), epoch=0)
    assert info.value.key == "model.num_classes"


def test_a_trained_detector_finds_the_items_and_shards_evaluate_as_one(coco_set, tmp_path):
    """Full resolution, trained on the eight canvases until it has learned them: COCO's
    box and mask AP on those canvases are high; two shards merged give the figures of
    one evaluation; the saved detector detects the same."""
    torch.manual_seed(0)
    model = detector("full").train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    loader = DataLoader(coco_set, batch_size=4, shuffle=True, collate_fn=collate)
    cfg = SplitLossConfig()
    first = None
    for epoch in range(40):
        for images, targets in loader:
            loss, stats = detection_training_step(model, images, targets, cfg, epoch=epoch)
            first = stats["loss"] if first is None else first
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    assert stats["loss"] < 0.4 * first, (first, stats["loss"])

    ground_truth = load_ground_truth(coco_set.index.dataset)
    label_to_category = [0, *coco_set.category_ids]
    ordered = DataLoader(coco_set, batch_size=4, collate_fn=collate)
    untrained = evaluate_detection_totals(detector("full"), ordered, label_to_category).figures(ground_truth)
    totals = evaluate_detection_totals(model, ordered, label_to_category)
    figures = totals.figures(ground_truth)
    # measured: box AP50 0.84 (AP 0.41), mask AP50 0.84; untrained: about 0
    assert figures["box_ap50"] > 0.6 and figures["mask_ap50"] > 0.6 and figures["box_ap"] > 0.25, figures
    assert untrained["box_ap50"] < 0.1 and untrained["mask_ap50"] < 0.1, untrained
    assert figures["token_ratio"] == 1.0 and figures["tokens_per_image"] == (CANVAS // 8) ** 2
    assert set(figures["per_class"]) == set(coco_set.categories)
    assert model.training  # evaluation restores the mode

    halves = [
        evaluate_detection_totals(
            model, DataLoader(Subset(coco_set, part), batch_size=3, collate_fn=collate), label_to_category
        )
        for part in (range(5, 8), range(0, 5))
    ]
    merged = DetectionTotals.merge(halves)
    same = {k: v for k, v in merged.figures(ground_truth).items() if k != "images_per_s"}
    assert same == {k: v for k, v in figures.items() if k != "images_per_s"}
    with pytest.raises(ValueError, match="overlap"):
        DetectionTotals.merge([halves[0], halves[0]])

    model.save(tmp_path / "detector.pt")
    loaded = SplitDetector.load(tmp_path / "detector.pt")
    again = evaluate_detection_totals(loaded, ordered, label_to_category)
    assert again.records == totals.records
    assert loaded.options == model.options


def test_a_detectors_evaluation_says_how_much_of_the_objects_its_backbone_saw_fine(coco_set):
    """``object_coverage`` (the objects' finest cells kept fine) and ``fine_on_object``
    (the fine tokens on an object), from the targets' instance masks, as classifiers
    report them: all of the objects at full resolution, none all-coarse; shards merge."""
    ground_truth = load_ground_truth(coco_set.index.dataset)
    label_to_category = [0, *coco_set.category_ids]
    ordered = DataLoader(coco_set, batch_size=3, collate_fn=collate)
    masks = torch.stack([(coco_set[i][1]["masks"] > 0).any(dim=0) for i in range(len(coco_set))])
    cells = int(masks.reshape(len(coco_set), CANVAS // 8, 8, CANVAS // 8, 8).any(dim=4).any(dim=2).sum())
    fine_total = len(coco_set) * (CANVAS // 8) ** 2
    assert 0 < cells < fine_total

    full = evaluate_detection_totals(detector("full"), ordered, label_to_category)
    assert (full.fine_total, full.fine_on_object, full.object_cells) == (fine_total, cells, cells)
    figures = full.figures(ground_truth)
    assert figures["object_coverage"] == 1.0 and figures["fine_on_object"] == pytest.approx(cells / fine_total)
    coarse = evaluate_detection_totals(detector("coarse"), ordered, label_to_category).figures(ground_truth)
    assert coarse["object_coverage"] == 0.0 and coarse["fine_on_object"] == 0.0

    learned = detector("learned")
    halves = [
        evaluate_detection_totals(
            learned, DataLoader(Subset(coco_set, part), batch_size=3, collate_fn=collate), label_to_category
        )
        for part in (range(0, 5), range(5, 8))
    ]
    merged = DetectionTotals.merge(halves)
    whole = evaluate_detection_totals(learned, ordered, label_to_category)
    assert (merged.fine_total, merged.fine_on_object, merged.object_cells) == (
        whole.fine_total,
        whole.fine_on_object,
        whole.object_cells,
    )
    assert 0.0 < whole.figures(ground_truth)["object_coverage"] < 1.0

    # the oracle: the learned backbone, split where the instance masks are. Every
    # object cell is fine; a 16-px coarse node splits into 4 fine tokens exactly when it
    # holds mask pixels (CANVAS / 16 = 4 coarse nodes a side)
    grad_enabled, forward = [], learned.forward
    learned.forward = lambda *a, **k: (grad_enabled.append(torch.is_grad_enabled()), forward(*a, **k))[1]
    oracle = evaluate_detection_totals(learned, ordered, label_to_category, oracle=True)
    assert grad_enabled and not any(grad_enabled)  # evaluation records no autograd graph
    assert oracle.figures(ground_truth)["object_coverage"] == 1.0
    split = int(masks.reshape(len(coco_set), 4, 16, 4, 16).any(dim=4).any(dim=2).sum())
    assert 0 < split < 16 * len(coco_set) and oracle.tokens == 16 * len(coco_set) + 3 * split
    assert oracle.fine_total == 4 * split


def test_the_oracle_splits_every_node_over_an_instance_and_needs_masks():
    """:func:`annotation_decisions` on a 32-px canvas, 4-px finest cells, 3 levels (2x2
    coarse nodes of 16 px, 4x4 of 8 px, 8x8 of 4 px): one 3-px instance in a corner
    splits its coarse node and one of that node's children (3 + 3 + 4 = 10 tokens); an
    image with no instances stays all-coarse (4 tokens)."""
    from splitvit.model.quadtree import leaf_masks

    geometry = QuadtreeGeometry(image_size=(32, 32), patch_size=4, levels=3)
    item = torch.zeros(1, 32, 32, dtype=torch.uint8)
    item[0, 29:32, 0:3] = 1  # bottom-left corner
    targets = [{"masks": item, "boxes": torch.tensor([[0.0, 29.0, 3.0, 32.0]])}, {"masks": item[:0]}]
    decisions = annotation_decisions(targets, geometry)
    assert [d.shape for d in decisions] == [(2, 2, 2), (2, 4, 4)]
    assert decisions[0][0].nonzero().tolist() == [[1, 0]] and decisions[1][0].nonzero().tolist() == [[3, 0]]
    assert not decisions[0][1].any() and not decisions[1][1].any()
    assert [int(sum(m[i].sum() for m in leaf_masks(decisions))) for i in range(2)] == [10, 4]
    with pytest.raises(ValueError, match="boxes only"):
        annotation_decisions([{"boxes": torch.zeros(1, 4)}], geometry)
    # context: the mask grown by 6 px (rows 23-31, columns 0-8) reaches 3 rows and 3
    # columns of finest cells, so every 8-px node under the corner's coarse node splits
    grown = annotation_decisions(targets, geometry, context=6)
    assert [int(sum(m[i].sum() for m in leaf_masks(grown))) for i in range(2)] == [19, 4]
    with pytest.raises(ValueError, match="--oracle-context must be >= 0"):
        annotation_decisions(targets, geometry, context=-1)


def test_the_objects_teachers_context_ring_ranks_an_items_surroundings_next_nearest_first():
    """``train.teacher.context``: on a 32-px canvas with one 3-px item in the bottom-left
    corner (4-px finest cells, 8-px and 16-px nodes), the ring falls linearly over the
    context's pixels; nodes rank item first, then the ring's nearest, then the
    untouched; without context the ring is absent."""
    from splitvit.train.detection import context_ring, object_relevance

    masks = torch.zeros(1, 1, 12, 12)
    masks[0, 0, 5, 5] = 1.0
    ring = context_ring(masks, 4)[0, 0]
    assert ring[5, 5] == 1.0 and ring[5, 6] == 1.0 and ring[3, 7] == 0.75 and ring[5, 1] == 0.25
    assert ring[5, 0] == 0.0 and ring[0, 0] == 0.0  # distance 5: outside

    geometry = QuadtreeGeometry(image_size=(32, 32), patch_size=4, levels=3)
    item = torch.zeros(1, 32, 32, dtype=torch.uint8)
    item[0, 29:32, 0:3] = 1
    target = {"masks": item, "boxes": torch.tensor([[0.0, 29.0, 3.0, 32.0]])}
    plain = object_relevance([target], geometry, torch.Generator().manual_seed(0))
    ringed = object_relevance([target], geometry, torch.Generator().manual_seed(0), context=6)
    mid_plain, mid = plain[1][0], ringed[1][0]  # the 8-px nodes, (row, column)
    assert float(mid_plain[2, 0]) < 1e-3 and float(mid_plain[3, 1]) < 1e-3  # no ring without context
    # the item's node, then the ring (rows 23-31, columns 0-8) nearest first, then nothing
    assert mid[3, 0] > mid[3, 1] > mid[2, 1] > 1e-3 and mid[3, 0] > mid[2, 0] > mid[2, 1]
    assert max(float(mid[1, 0]), float(mid[2, 2]), float(mid[0, 3])) < 1e-3
    assert ringed[0][0, 1, 0] == ringed[0][0].max() and float(ringed[0][0, 0, 1]) < 1e-3


@pytest.mark.parametrize("teacher, passes", [("objects", 0), ("gradient", 1)])
def test_a_detectors_policy_epochs_train_its_policy_alone(coco_set, teacher, passes):
    """``train.policy.epochs`` on a detector (:func:`detection_policy_step`): the teacher
    alone, so only the policy's weights get gradients; the objects teacher runs no
    detector pass at all, the gradient teacher its full-resolution one."""
    from splitvit.train.detection import detection_policy_step

    model = detector("learned").train()
    images, targets = collate([coco_set[i] for i in range(2)])
    calls = []
    encode = model.backbone.fine_features
    model.backbone.fine_features = lambda *args, **kwargs: calls.append(1) or encode(*args, **kwargs)
    cfg = SplitLossConfig(teacher=TeacherConfig(kind=teacher, context=4 if teacher == "objects" else 0))
    loss, stats = detection_policy_step(model, images, targets, cfg)
    assert set(stats) == {"teacher_loss", "loss"} and len(calls) == passes
    loss.backward()
    policy = {id(p) for p in model.backbone.policy.parameters()}
    assert all(p.grad is not None for p in model.backbone.policy.parameters())
    assert all(p.grad is None for p in model.parameters() if id(p) not in policy)
    targets[0]["labels"] = targets[0]["labels"].clone()
    targets[0]["labels"][0] = 11
    with pytest.raises(ConfigError, match="object label 11"):
        detection_policy_step(model, images, targets, cfg)


def _combine_shard(rank: int, world: int, folder: str) -> None:
    """One process of the test below: join a gloo group and combine this rank's shard."""
    import json
    from pathlib import Path

    import torch.distributed as dist

    from splitvit.train.ray_trainer import _combine_detection

    dist.init_process_group("gloo", init_method=f"file://{folder}/rendezvous", rank=rank, world_size=world)
    try:
        work = json.loads(Path(folder, "work.json").read_text())
        shard = DetectionTotals(**work["shards"][rank])
        ground_truth = load_ground_truth(work["ground_truth"]) if rank == 0 else None
        figures = _combine_detection(shard, ground_truth, None, rank, world)
        Path(folder, f"figures{rank}.json").write_text(json.dumps(figures))
    finally:
        dist.destroy_process_group()


def test_two_workers_detections_are_evaluated_once_to_the_figures_of_one(coco_set, tmp_path):
    """A real two-process gloo group: each rank detects on its shard, rank 0 evaluates
    the gathered detections once, and both ranks get the figures one process computes
    from all of them (COCO's AP is no mean of the shards' APs)."""
    import json

    import torch.multiprocessing as mp

    torch.manual_seed(0)
    model = detector("entropy")
    label_to_category = [0, *coco_set.category_ids]
    # the untrained detector's boxes, rescored so that AP lies strictly between 0 and 1
    shards = []
    for part in (range(0, 3), range(3, 8)):
        totals = evaluate_detection_totals(
            model, DataLoader(Subset(coco_set, part), batch_size=4, collate_fn=collate), label_to_category
        )
        shards.append(totals)
    ground_truth = coco_set.index.dataset
    # add each image's true boxes as detections, one of them under every false one
    for shard in shards:
        for image_id in shard.image_ids:
            for k, ann in enumerate(a for a in ground_truth["annotations"] if a["image_id"] == image_id):
                score = 0.01 if k == 0 else 0.99
                shard.records.append(
                    {
                        **{key: ann[key] for key in ("image_id", "category_id", "bbox")},
                        "score": score,
                        "segmentation": ann["segmentation"],
                    }
                )
    one = DetectionTotals.merge(shards).figures(load_ground_truth(ground_truth))
    assert 0.0 < one["box_ap"] < 1.0 and 0.0 < one["mask_ap"] < 1.0
    (tmp_path / "work.json").write_text(json.dumps({"shards": [vars(s) for s in shards], "ground_truth": ground_truth}))
    mp.spawn(_combine_shard, args=(2, str(tmp_path)), nprocs=2, join=True)
    expected = {k: v for k, v in one.items() if k != "images_per_s"}
    for rank in (0, 1):
        figures = json.loads((tmp_path / f"figures{rank}.json").read_text())
        assert figures.pop("val_images") == 8
        assert {k: v for k, v in figures.items() if k != "images_per_s"} == json.loads(json.dumps(expected))


# ---------------------------------------------------------------------- through Ray Train and MLflow
@pytest.mark.slow
def test_splitvit_train_runs_a_detector_on_two_ray_workers_and_eval_reads_its_checkpoint(
    ray_session, mlflow_uri, tmp_path, capsys
):
    """The shipped detection config, made tiny, through `splitvit train` on two Ray Train
    workers (warm-up epoch, then the policy with its budget and teacher): COCO's box and
    mask AP every epoch in MLflow with AP per class as an artifact, and `splitvit eval`
    of the checkpoint gives the run's last figures."""
    import json

    from mlflow import MlflowClient

    from splitvit.cli import main

    from .helpers import write_fake_fashion_mnist

    ray_session.ensure()
    # 5008 training items: viz reads Fashion-MNIST's own validation slice (its last 5000)
    root = write_fake_fashion_mnist(tmp_path / "fmnist", train=5008, test=8)
    settings = {
        "model.image_size": 64,
        "model.timm_kwargs": "{patch_size: 8, embed_dim: 32, depth: 1, num_heads: 2}",
        "model.policy.depth": 1,  # the 1-block ViT's (detection-v1's 2 are more than it has)
        "data.options": f"{{root: {root}, val_size: 8, train_samples: 16, val_samples: 8, clutter: true}}",
        "data.batch_size": 4,
        "train.epochs": 2,
        "train.policy.warmup_epochs": 1,
        "train.policy.lead_epochs": 1,  # the recipe's (detection-v1) phases, one epoch each
        "train.policy.epochs": 1,
        "scaling.num_workers": 2,
        "scaling.resources_per_worker": "{CPU: 1}",
        "storage.path": str(tmp_path / "runs"),
        "storage.name": "det",
        "tracking.tracking_uri": mlflow_uri,
        "tracking.experiment": "detection-e2e",
        "tracking.split_map_images": 2,
        "tracking.log_model": "false",
    }
    overrides = [arg for key, value in settings.items() for arg in ("--set", f"{key}={value}")]
    out = tmp_path / "train.json"
    assert main(["train", "jobs/configs/fashion_det.yaml", *overrides, "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    metrics = result["metrics"]
    assert result["run_status"] == "completed" and metrics["epoch"] == 3  # lead, 2 fine-tune epochs, policy
    for key in ("box_ap", "box_ap50", "mask_ap", "mask_ap50"):
        assert 0.0 <= metrics[key] <= 1.0, key
    assert metrics["val_images"] == 8 and 0 < metrics["token_ratio"] < 1  # the policy's budget, not full resolution
    # the last epoch is the policy's own (the teacher's loss alone); the fine-tune's are epochs 1 and 2
    assert "train_teacher_loss" in metrics and "train_loss_mask" not in metrics
    assert "box_ap" in capsys.readouterr().out  # the epoch lines and the table show the task's quality

    client = MlflowClient(mlflow_uri)
    run_id = result["mlflow_run_id"]
    assert [m.step for m in client.get_metric_history(run_id, "box_ap")] == [0, 1, 2, 3]
    assert [m.step for m in client.get_metric_history(run_id, "train_loss_mask")] == [1, 2]  # the fine-tune's
    assert [m.step for m in client.get_metric_history(run_id, "train_budget_penalty")] == [2]  # after its warm-up
    # the recipe the file names, as tags and as each key's layer
    run = client.get_run(run_id)
    assert run.data.tags["splitvit.recipe"] == "detection-v1" and run.data.tags["splitvit.recipe_version"] == "1"
    assert run.data.params["recipe"] == "detection-v1"
    layers = json.loads(Path(client.download_artifacts(run_id, "config_layers.json", str(tmp_path))).read_text())
    assert layers["recipe"] == "detection-v1"
    assert layers["keys"]["train.teacher.kind"] == {"value": "objects", "layer": "recipe detection-v1"}
    assert layers["keys"]["train.policy.epochs"] == {"value": 1, "layer": "--set"}
    assert layers["keys"]["model.task"]["layer"] == "file jobs/configs/fashion_det.yaml"
    artifacts = {a.path for a in client.list_artifacts(run_id, "per_class_ap")}
    assert artifacts == {f"per_class_ap/epoch_{epoch:04d}.json" for epoch in range(4)}
    # each epoch's split maps, the detector's confident detections drawn over them
    assert {a.path for a in client.list_artifacts(run_id, "split_maps")} == {
        f"split_maps/epoch_{epoch:04d}.png" for epoch in range(4)
    }
    per_class = json.loads(
        Path(client.download_artifacts(run_id, "per_class_ap/epoch_0003.json", str(tmp_path))).read_text()
    )
    assert set(per_class["per_class"]) <= set(CLASSES) and set(per_class["area_ranges"]) == {"small", "medium", "large"}

    figures = tmp_path / "eval.json"
    assert main(["eval", result["checkpoint_uri"], "--json", str(figures)]) == 0
    evaluated = json.loads(figures.read_text())
    assert evaluated["images"] == 8 and evaluated["tokens_per_image"] == metrics["tokens_per_image"]
    assert evaluated["box_ap"] == pytest.approx(metrics["box_ap"], abs=1e-6)
    assert evaluated["mask_ap"] == pytest.approx(metrics["mask_ap"], abs=1e-6)
    # the same checkpoint split where the annotations' instances are
    assert main(["eval", result["checkpoint_uri"], "--oracle", "--json", str(figures)]) == 0
    oracle = json.loads(figures.read_text())
    assert oracle["policy"] == "oracle" and oracle["thresholds"] is None and oracle["object_coverage"] == 1.0
    capsys.readouterr()
    assert main(["eval", result["checkpoint_uri"], "--oracle", "--oracle-context", "8", "--json", str(figures)]) == 0
    assert "policy oracle, the annotations' instances grown by 8 px" in capsys.readouterr().out
    context = json.loads(figures.read_text())
    assert context["object_coverage"] == 1.0 and context["tokens_per_image"] > oracle["tokens_per_image"]
    # the quadtree its backbone draws (the boxes and masks are not drawn yet)
    png = tmp_path / "viz.png"
    argv = ["viz", "--checkpoint", result["checkpoint_uri"], "--dataset", "fashion-det", "--root", str(root)]
    drawn = tmp_path / "viz.json"
    assert main([*argv, "--count", "2", "--out", str(png), "--json", str(drawn)]) == 0 and png.stat().st_size > 0
    assert len(json.loads(drawn.read_text())["detections"]) == 2  # detections drawn per image (any may be 0)


def test_letterboxed_coco_images_are_evaluated_in_their_own_pixels(tmp_path):
    """Images of other sizes than the canvas are letterboxed for the model; detections
    are mapped back (boxes divided by the scale, masks cut from the padding and resized)
    before COCO's evaluation meets the file's own annotations: the letterboxed targets,
    given back as detections, score box AP 1."""
    import json

    import numpy as np
    from PIL import Image

    from splitvit.train.detection import to_original_pixels

    folder = tmp_path / "images"
    folder.mkdir()
    sizes = {1: (48, 32), 2: (24, 40)}  # (width, height): wider and taller than the 32-px canvas
    objects = {1: [(6, 6, 30, 24), (34, 2, 46, 14)], 2: [(2, 10, 20, 36)]}
    annotations = []
    for image_id, (w, h) in sizes.items():
        pixels = np.zeros((h, w, 3), np.uint8)
        for x0, y0, x1, y1 in objects[image_id]:
            pixels[y0:y1, x0:x1] = 200
            annotations.append(
                {
                    "id": len(annotations) + 1,
                    "image_id": image_id,
                    "category_id": 1,
                    "bbox": [x0, y0, x1 - x0, y1 - y0],
                    "area": float((x1 - x0) * (y1 - y0)),
                    "segmentation": [[x0, y0, x1, y0, x1, y1, x0, y1]],
                    "iscrowd": 0,
                }
            )
        Image.fromarray(pixels).save(folder / f"{image_id}.png")
    document = {
        "images": [{"id": i, "file_name": f"{i}.png", "width": w, "height": h} for i, (w, h) in sizes.items()],
        "annotations": annotations,
        "categories": [{"id": 1, "name": "box"}],
    }
    (tmp_path / "instances.json").write_text(json.dumps(document))
    data = CocoDetection(tmp_path / "instances.json", folder, image_size=32)
    records, ids = [], []
    for image, target in (data[i] for i in range(len(data))):
        assert image.shape == (3, 32, 32) and target["masks"].shape[-2:] == (32, 32)
        assert float(target["scale"]) == pytest.approx(32 / max(sizes[int(target["image_id"])]))
        found = {
            "boxes": target["boxes"],
            "labels": target["labels"],
            "scores": torch.linspace(0.9, 0.5, len(target["labels"])),
            "masks": target["masks"][:, None].float(),
        }
        back = to_original_pixels(found, target)
        w, h = sizes[int(target["image_id"])]
        assert back["masks"].shape[-2:] == (h, w)
        ids.append(int(target["image_id"]))
        records += detection_records([ids[-1]], [back], [0, 1])
    figures = coco_evaluate(load_ground_truth(document), records)
    assert figures["bbox"]["AP"] == pytest.approx(1.0) and figures["segm"]["AP50"] == pytest.approx(1.0)
    # unmapped, the canvas's boxes miss the file's objects
    plain = [
        detection_records(
            [int(t["image_id"])],
            [{**{k: t[k] for k in ("boxes", "labels")}, "scores": torch.ones(len(t["labels"]))}],
            [0, 1],
        )
        for _, t in (data[i] for i in range(len(data)))
    ]
    assert coco_evaluate(load_ground_truth(document), sum(plain, []), iou_types=("bbox",))["bbox"]["AP"] < 0.5


def test_split_maps_draw_confident_detections_over_the_quadtree():
    """Boxes scoring at least MIN_SCORE are outlined (and their masks tinted) in the
    detection colour, each labelled; less confident ones are not drawn."""
    import numpy as np

    from splitvit.model.quadtree import QuadtreeGeometry
    from splitvit.tracking.split_maps import DETECTION_COLOUR, MIN_SCORE, split_map_grid

    geometry = QuadtreeGeometry((32, 32), patch_size=8, levels=2)
    image = torch.zeros(1, 3, 32, 32)
    decisions = [torch.zeros(1, *geometry.grid(0), dtype=torch.bool)]
    masks = torch.zeros(2, 1, 32, 32)
    masks[0, 0, 4:12, 4:12] = 1.0
    masks[1, 0, 20:28, 20:28] = 1.0
    found = {
        "boxes": torch.tensor([[4.0, 4.0, 12.0, 12.0], [20.0, 20.0, 28.0, 28.0]]),
        "labels": torch.tensor([1, 2]),
        "scores": torch.tensor([MIN_SCORE + 0.3, MIN_SCORE - 0.3]),
        "masks": masks,
    }
    grid = np.asarray(split_map_grid(image, decisions, geometry, detections=[found], names=["a", "b"], scale=4))
    magenta = (grid == np.array(DETECTION_COLOUR)).all(-1)
    assert magenta[4 * 4 : 12 * 4, 4 * 4].any()  # the confident box's left edge
    assert not magenta[20 * 4 : 28 * 4, 20 * 4 : 28 * 4].any()  # the other is not drawn
    tinted = grid[8 * 4 + 2, 8 * 4 + 2]  # inside the confident mask: half magenta over black
    assert tuple(tinted) == tuple(np.array(DETECTION_COLOUR) // 2)


def test_a_classifiers_checkpoint_is_not_loaded_as_a_detector(tmp_path):
    """SplitDetector.load names what it was given; model_from_payload picks the class by the payload's kind."""
    from splitvit.model import SplitViT
    from splitvit.train.checkpoints import model_from_payload

    classifier = SplitViT.from_timm(
        "vit_tiny_patch16_224",
        policy=PolicyConfig(depth=1),
        levels=2,
        image_size=32,
        num_classes=4,
        timm_kwargs=dict(patch_size=8, embed_dim=32, depth=1, num_heads=2),
    )
    classifier.save(tmp_path / "model.pt")
    with pytest.raises(ValueError, match="not a detector checkpoint"):
        SplitDetector.load(tmp_path / "model.pt")
    payload = torch.load(tmp_path / "model.pt", weights_only=False)
    assert type(model_from_payload(payload, str(tmp_path / "model.pt"))) is SplitViT
    detector("full").save(tmp_path / "detector.pt")
    payload = torch.load(tmp_path / "detector.pt", weights_only=False)
    assert type(model_from_payload(payload, str(tmp_path / "detector.pt"))) is SplitDetector


def test_the_objects_teacher_marks_the_annotated_items_without_a_forward_pass(coco_set):
    """``train.teacher.kind: objects``: each node's relevance is the instance masks' share of
    its area (boxes a tenth, noise below 1e-4), so the nested targets at the items' own
    share mark exactly the nodes on an item; a training step with it has a teacher loss
    and runs the detector once."""
    from splitvit.model.quadtree import QuadtreeGeometry
    from splitvit.train.detection import object_relevance
    from splitvit.train.losses import relevance_targets

    images, targets = collate([coco_set[i] for i in range(4)])
    geometry = QuadtreeGeometry(CANVAS, 8, LEVELS)
    (relevance,) = object_relevance(targets, geometry, torch.Generator().manual_seed(0))
    masks = torch.stack([(t["masks"] > 0).any(dim=0) for t in targets]).float()
    pixels = torch.nn.functional.avg_pool2d(masks.unsqueeze(1), 16).squeeze(1) * 4  # fine cells' worth, per node
    boxes = torch.zeros_like(masks)
    for b, target in enumerate(targets):
        for x1, y1, x2, y2 in target["boxes"].floor().long().tolist():
            boxes[b, y1 : y2 + 1, x1 : x2 + 1] = 1.0
    boxed = torch.nn.functional.avg_pool2d(boxes.unsqueeze(1), 16).squeeze(1) * 4
    assert torch.allclose(relevance, pixels + 0.1 * boxed, atol=4e-4)
    on_item = pixels > 0
    share = float(on_item.float().mean(dim=(1, 2)).min())  # the emptiest canvas's share of item nodes
    (marks,) = relevance_targets([relevance], share, "nested")
    assert bool((marks.bool() <= on_item).all())  # nothing off the items is marked ...
    assert int(marks.sum()) == int(share * relevance[0].numel() + 0.999) * len(targets)  # ... at the share asked

    model = detector("learned")
    calls = []
    encode = model.backbone.fine_features
    model.backbone.fine_features = lambda *args, **kwargs: calls.append(1) or encode(*args, **kwargs)
    for teacher, passes in (("objects", 1), ("gradient", 2)):  # the gradient's: a full-resolution pass more
        calls.clear()
        _, stats = detection_training_step(
            model, images, targets, SplitLossConfig(teacher=TeacherConfig(kind=teacher)), epoch=5
        )
        assert "teacher_loss" in stats and len(calls) == passes, teacher
    with pytest.raises(ValueError, match="train.teacher.kind: a detector's teachers are gradient and objects"):
        detection_training_step(
            model, images, targets, SplitLossConfig(teacher=TeacherConfig(kind="attention")), epoch=5
        )


def test_policy_lr_scale_gives_splitvits_own_modules_their_own_learning_rate():
    """``train.policy.lr_scale``: the policy, fine aggregation and level embeddings in a
    group at ``lr * scale`` (a classifier's and a detector's), every other parameter in
    the other at ``lr``; at 1, one group, the layout saved optimizers have."""
    from splitvit.train.local import param_groups

    from .helpers import tiny_model

    for model in (tiny_model(fine_aggregation=True), detector("learned")):
        everything = {id(p) for p in model.parameters()}
        (one,) = param_groups(model, 1e-3)
        assert one["lr"] == 1e-3 and {id(p) for p in one["params"]} == everything
        rest, own = param_groups(model, 1e-3, 10.0)
        assert (rest["lr"], own["lr"]) == (1e-3, pytest.approx(1e-2))
        names = {id(p): name for name, p in model.named_parameters()}
        own_names = {names[id(p)] for p in own["params"]}
        assert own_names and all(
            any(part in n for part in ("policy.", "fine_aggregation.", "level_embed")) for n in own_names
        )
        assert not any("policy." in names[id(p)] for p in rest["params"])
        assert {id(p) for p in rest["params"]} | {id(p) for p in own["params"]} == everything
        assert not {id(p) for p in rest["params"]} & {id(p) for p in own["params"]}
