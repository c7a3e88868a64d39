"""Ray job: the forward or the training benchmark.

    ray job submit --working-dir . -- python jobs/bench.py forward [--json PATH] [options]
    ray job submit --working-dir . -- python jobs/bench.py train --json /abs/path/train.json [--storage s3://bucket/bench]

Everything is ``splitvit bench KIND`` (forward, train or data). Inside a Ray job
``RAY_ADDRESS`` is set, so the training benchmark's Ray run joins that cluster and
its plain loop shares the machine with Ray's idle processes (the report says so);
part A and the plain loop run in the job's driver process. On a multi-node cluster
give ``--storage`` a path every node reaches (``s3://...``): the driver reads the
worker's per-epoch figures from there. A relative ``--json`` lands in Ray's
temporary copy of the working directory: pass an absolute path.
"""

import sys
from pathlib import Path

try:
    import splitvit  # noqa: F401  (installed in the cluster's environment)
except ImportError:  # a bare checkout: the package's source root is platform/
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from splitvit.cli import main

if __name__ == "__main__":
    sys.exit(main(["bench", *sys.argv[1:]]))
