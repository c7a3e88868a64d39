"""Ray job: run (or resume) a multi-objective sweep.

    ray job submit --working-dir . -- python jobs/sweep.py search_spaces/smoke.yaml \
        [--set key=value ...] [--name NAME] [--resume] [--json PATH]

Inside a Ray job ``RAY_ADDRESS`` is set and the sweep joins that cluster; run
directly, it starts a local Ray. Give the sweep storage every node reaches
(``--set storage.path=s3://bucket/prefix`` or a shared folder): a job's working
directory is a temporary copy. Everything else is ``splitvit sweep``: every trial runs the
space's recipe (``parameters: {recipe: ...}``) under its searched settings.
"""

import sys
from pathlib import Path

try:
    import splitvit  # noqa: F401  (installed in the cluster's environment)
except ImportError:  # a bare checkout: the package's source root is platform/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from splitvit.cli import main

if __name__ == "__main__":
    sys.exit(main(["sweep", *sys.argv[1:]]))
