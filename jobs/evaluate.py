"""Ray job: evaluate a training checkpoint (local folder or s3://).

    ray job submit --working-dir . -- python jobs/evaluate.py s3://bucket/runs/NAME/checkpoint_epoch0009 \
        [--thresholds 0.4,0.6] [--policy entropy] [--json PATH]

Everything is ``splitvit eval``.
"""

import sys
from pathlib import Path

try:
    import splitvit  # noqa: F401  (installed in the cluster's environment)
except ImportError:  # a bare checkout: the package's source root is platform/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from splitvit.cli import main

if __name__ == "__main__":
    sys.exit(main(["eval", *sys.argv[1:]]))
