"""Ray job: train one experiment.

    ray job submit --working-dir . -- python jobs/train.py jobs/configs/smoke.yaml [--set key=value ...] [--json PATH]

Inside a Ray job ``RAY_ADDRESS`` is set and training joins that cluster; run
directly, it starts a local Ray. Everything else is ``splitvit train``: the
config's recipe (its ``recipe:``, else its task's current one) lies under the file's
settings; ``--set recipe=none`` trains the library's plain defaults.
"""

import sys
from pathlib import Path

try:
    import splitvit  # noqa: F401  (installed in the cluster's environment)
except ImportError:  # a bare checkout: the package's source root is platform/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from splitvit.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
