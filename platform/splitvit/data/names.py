"""The built-in datasets' names (``data.name``), without torch: read by the checks that
run before torch loads (:mod:`splitvit.train.names`) and by the registry itself."""

DATASET_NAMES = (
    "synthetic",
    "cluttered-fashion-mnist",
    "cluttered-fashion-mnist-seg",
    "imagefolder",
    "ade20k",
    "parquet",
    "fashion-det",
    "coco",
)
#: The datasets whose targets are objects (boxes, labels 1..K, masks): what
#: ``model.task: detection`` needs, and what no other task reads.
DETECTION_DATASETS = ("fashion-det", "coco")
#: Datasets that hold any task's items (parquet shards): what they hold is known only by
#: reading them, which the preflight does (``cluster.preflight.check_data``).
ANY_TASK_DATASETS = ("parquet",)
