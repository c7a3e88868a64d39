"""Ray job: run (or finish) the evidence study.

    ray job submit --working-dir . -- python jobs/study.py studies/study_fashion.yaml \
        [--scale gpu] [--set key=value ...] [--name NAME] [--json PATH]

Inside a Ray job ``RAY_ADDRESS`` is set and the study joins that cluster; run
directly, it starts a local Ray. Give the study storage every node reaches
(``--set storage.path=s3://bucket/prefix`` or a shared folder): a job's working
directory is a temporary copy. Everything else is ``splitvit study``.
"""

import sys
from pathlib import Path

try:
    import splitvit  # noqa: F401  (installed in the cluster's environment)
except ImportError:  # a bare checkout: the package's source root is platform/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from splitvit.cli import main

if __name__ == "__main__":
    sys.exit(main(["study", *sys.argv[1:]]))
