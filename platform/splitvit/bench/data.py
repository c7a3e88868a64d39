"""The data benchmark (``splitvit bench data``): parquet shards on S3 against local copies.

One run writes a small synthetic image set three ways: parquet shards in a local
folder, the same shards pushed to S3 (a local moto endpoint started here, or a given
``s3://`` prefix), and an image folder (one PNG per image). It then reads one epoch
of each through the project's own path (``ParquetShards`` with the training
sampler, ``ImageFolderDataset`` with a random shuffle) in a DataLoader and reports,
side by side:

* **read amplification**: bytes actually read from storage during the epoch over the
  dataset's bytes (the shard files' sizes). Reads are counted by a filesystem that
  wraps the real one (:class:`CountingFileSystem`), so S3 and the local folder are
  counted alike. The target is at most 1.5.
* **images/s** of each path (reading, decoding, batching).

With ``global_shuffle`` the old path (a ``DistributedSampler`` over all items, so
every item may need its own row-group read) is measured too, for comparison.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import shutil
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, Sampler

from ..data import ImageFolderDataset, ParquetShards, SyntheticObjects, write_shards
from ..data.parquet import training_sampler
from ..jsontypes import JsonObject
from ..storage import filesystem_for, is_s3, join_uri, upload_dir
from ..train.console import environment

log = logging.getLogger(__name__)

#: Bytes read over dataset bytes that a path must stay within.
AMPLIFICATION_TARGET = 1.5


# ---------------------------------------------------------------------- counting reads
class _CountingReader:
    """A file object over a pyarrow input file that adds what it reads to shared counters."""

    def __init__(self, inner: pa.NativeFile, counters: Any) -> None:
        self.inner, self.counters = inner, counters
        self.closed = False

    def read(self, nbytes: int = -1) -> bytes:
        data = self.inner.read() if nbytes is None or nbytes < 0 else self.inner.read(nbytes)
        with self.counters.get_lock():
            self.counters[0] += len(data)
            self.counters[1] += 1
        return data

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.inner.seek(offset, whence)

    def tell(self) -> int:
        return self.inner.tell()

    def size(self) -> int:
        return self.inner.size()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def writable(self) -> bool:
        return False

    def close(self) -> None:
        self.closed = True
        self.inner.close()


class CountingFileSystem(pafs.FileSystemHandler):
    """A ``pyarrow.fs`` handler over another filesystem that counts the bytes (and read
    calls) of every file opened for reading. Use through :meth:`filesystem`.

    The counters live in shared memory, so DataLoader worker processes started by fork
    add to the same totals as this process.
    """

    def __init__(self, inner: pafs.FileSystem, counters: Any = None) -> None:
        self.inner = inner
        self.counters = counters if counters is not None else multiprocessing.Array("q", 2)

    def filesystem(self) -> pafs.PyFileSystem:
        """This handler as a pyarrow filesystem."""
        return pafs.PyFileSystem(self)

    @property
    def bytes_read(self) -> int:
        return int(self.counters[0])

    @property
    def reads(self) -> int:
        return int(self.counters[1])

    def reset(self) -> None:
        with self.counters.get_lock():
            self.counters[0] = self.counters[1] = 0

    # reading: counted
    def open_input_file(self, path: str) -> pa.PythonFile:
        return pa.PythonFile(_CountingReader(self.inner.open_input_file(path), self.counters), mode="r")

    def open_input_stream(self, path: str) -> pa.PythonFile:
        return pa.PythonFile(_CountingReader(self.inner.open_input_stream(path), self.counters), mode="r")

    # everything else: the inner filesystem's
    def get_type_name(self) -> str:
        return f"counting+{self.inner.type_name}"

    def equals(self, other: Any) -> bool:
        return isinstance(other, CountingFileSystem) and self.inner.equals(other.inner)

    def normalize_path(self, path: str) -> str:
        return self.inner.normalize_path(path)

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(paths)

    def get_file_info_selector(self, selector: pafs.FileSelector) -> list[pafs.FileInfo]:
        return self.inner.get_file_info(selector)

    def create_dir(self, path: str, recursive: bool) -> None:
        self.inner.create_dir(path, recursive=recursive)

    def delete_dir(self, path: str) -> None:
        self.inner.delete_dir(path)

    def delete_dir_contents(self, path: str, missing_dir_ok: bool = False) -> None:
        self.inner.delete_dir_contents(path, missing_dir_ok=missing_dir_ok)

    def delete_root_dir_contents(self) -> None:
        self.inner.delete_dir_contents("/", accept_root_dir=True)

    def delete_file(self, path: str) -> None:
        self.inner.delete_file(path)

    def move(self, src: str, dest: str) -> None:
        self.inner.move(src, dest)

    def copy_file(self, src: str, dest: str) -> None:
        self.inner.copy_file(src, dest)

    def open_output_stream(self, path: str, metadata: Any = None) -> pa.NativeFile:
        return self.inner.open_output_stream(path, metadata=metadata)

    def open_append_stream(self, path: str, metadata: Any = None) -> pa.NativeFile:
        return self.inner.open_append_stream(path, metadata=metadata)


# ---------------------------------------------------------------------- settings, result
@dataclass
class DataBenchSettings:
    """What ``splitvit bench data`` writes and reads.

    ``s3_uri``: an ``s3://bucket/prefix`` to push the shards to (endpoint and
    credentials from the environment; a fresh sub-prefix is used and removed after);
    None starts a moto S3 server on 127.0.0.1 for the run. ``local_dir``: where the
    local copies go (default: a temporary folder, removed after).
    """

    s3_uri: str | None = None
    local_dir: str | None = None
    samples: int = 2048
    image_size: int = 64
    rows_per_shard: int = 512
    row_group_size: int = 16
    batch_size: int = 32
    num_workers: int = 0
    cache_row_groups: int = 4
    seed: int = 0
    global_shuffle: bool = False
    imagefolder: bool = True

    def check(self) -> None:
        """Raise ``ValueError`` naming a setting out of range."""
        for name in ("samples", "image_size", "rows_per_shard", "row_group_size", "batch_size", "cache_row_groups"):
            if getattr(self, name) < 1:
                raise ValueError(f"bench data: {name} must be >= 1, got {getattr(self, name)}")
        if self.num_workers < 0:
            raise ValueError(f"bench data: num_workers must be >= 0, got {self.num_workers}")
        if self.s3_uri is not None and not is_s3(self.s3_uri):
            raise ValueError(f"bench data: expected s3://bucket/prefix, got {self.s3_uri!r}")


@dataclass
class PathFigures:
    """One path's epoch: what it read and how fast."""

    name: str
    images: int
    seconds: float
    images_per_s: float
    bytes_read: int | None
    reads: int | None
    dataset_bytes: int
    amplification: float | None


@dataclass
class DataBenchResult:
    """The run: the data set's shape and each path's figures."""

    settings: DataBenchSettings
    rows: int
    shards: int
    row_groups: int
    dataset_bytes: int
    s3_endpoint: str
    paths: list[PathFigures] = field(default_factory=list)

    def path(self, name: str) -> PathFigures:
        """The figures of path ``name``."""
        for p in self.paths:
            if p.name == name:
                return p
        raise KeyError(f"no path {name!r}; have {[p.name for p in self.paths]}")

    @property
    def passed(self) -> bool:
        """The S3 path stays within the read-amplification target."""
        amp = self.path("s3 parquet").amplification
        return amp is not None and amp <= AMPLIFICATION_TARGET

    def to_dict(self) -> JsonObject:
        """The JSON ``--json`` writes: the fields (the settings as given), the target and the verdict."""
        out = asdict(self)
        out.update(target=AMPLIFICATION_TARGET, passed=self.passed)
        return out


# ---------------------------------------------------------------------- running it
@contextlib.contextmanager
def local_s3() -> Iterator[str]:
    """A moto S3 server on 127.0.0.1 for the block, with the AWS environment pointed
    at it (and put back after); yields the endpoint URL."""
    try:
        from moto.server import ThreadedMotoServer
    except ImportError:
        raise RuntimeError(
            "bench data: no S3 URI given and moto is not installed to start a local endpoint "
            "(pip install 'moto[server]', or pass --uri s3://bucket/prefix)"
        ) from None
    logging.getLogger("werkzeug").setLevel(logging.WARNING)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    env: dict[str, str | None] = {
        "AWS_ENDPOINT_URL": endpoint,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        # unset: variables that would send requests elsewhere or mix in other credentials
        **dict.fromkeys(("AWS_ENDPOINT_URL_S3", "AWS_SESSION_TOKEN", "AWS_PROFILE", "AWS_REGION")),
    }
    try:
        with environment(env):
            yield endpoint
    finally:
        server.stop()


def run_data_benchmark(settings: DataBenchSettings) -> DataBenchResult:
    """Write the data set, push it to S3, read one epoch of each path; see the module."""
    settings.check()
    work = Path(settings.local_dir or tempfile.mkdtemp(prefix="splitvit-bench-data-"))
    try:
        with contextlib.ExitStack() as stack:
            if settings.s3_uri is None:
                endpoint = stack.enter_context(local_s3())
                s3_base = f"s3://splitvit-bench-{uuid.uuid4().hex[:8]}/data"
                _make_bucket(s3_base)
            else:
                endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL") or "AWS"
                s3_base = join_uri(settings.s3_uri, f"bench-data-{uuid.uuid4().hex[:8]}")
            stack.callback(_remove_prefix, s3_base)
            return _run(settings, work, s3_base, endpoint)
    finally:
        if settings.local_dir is None:
            shutil.rmtree(work, ignore_errors=True)


def _make_bucket(s3_uri: str) -> None:
    from ..storage import s3_client, split_s3_uri

    s3_client().create_bucket(Bucket=split_s3_uri(s3_uri)[0])


def _remove_prefix(s3_uri: str) -> None:
    """Delete what the benchmark pushed (best effort: a failure leaves a log line)."""
    fs, path = filesystem_for(s3_uri)
    try:
        fs.delete_dir_contents(path, missing_dir_ok=True)
    except OSError as exc:
        log.warning("bench data: could not remove %s: %s", s3_uri, exc)


def _run(settings: DataBenchSettings, work: Path, s3_base: str, endpoint: str) -> DataBenchResult:
    source = SyntheticObjects(settings.samples, image_size=settings.image_size, seed=settings.seed)
    local_shards = work / "parquet"
    written = write_shards(
        source,
        str(local_shards),
        settings.rows_per_shard,
        row_group_size=settings.row_group_size,
        overwrite=True,
    )
    upload_dir(local_shards, s3_base)
    result = DataBenchResult(
        settings=replace(settings),  # a copy: the run's settings as they were
        rows=written.rows,
        shards=len(written.shards),
        row_groups=0,
        dataset_bytes=written.bytes,
        s3_endpoint=endpoint,
    )
    s3_data, s3_counter = _counted_shards(s3_base, settings)
    result.row_groups = s3_data.num_row_groups
    result.paths.append(_epoch("s3 parquet", s3_data, _sampler(s3_data, settings), settings, s3_counter))
    local_data, local_counter = _counted_shards(str(local_shards), settings)
    result.paths.append(_epoch("local parquet", local_data, _sampler(local_data, settings), settings, local_counter))
    if settings.imagefolder:
        folder = _write_imagefolder(local_shards, work / "images")
        images = ImageFolderDataset(folder, "train", image_size=settings.image_size)
        sampler = RandomSampler(images, generator=_generator(settings.seed))
        result.paths.append(_epoch("local imagefolder", images, sampler, settings, None, written.bytes))
    if settings.global_shuffle:
        old, old_counter = _counted_shards(s3_base, settings)
        sampler = DistributedSampler(old, num_replicas=1, rank=0, shuffle=True, seed=settings.seed, drop_last=True)
        result.paths.append(_epoch("s3 parquet, global shuffle (old)", old, sampler, settings, old_counter))
    return result


def _counted_shards(uri: str, settings: DataBenchSettings) -> tuple[ParquetShards, CountingFileSystem]:
    counter = CountingFileSystem(filesystem_for(uri)[0])
    data = ParquetShards(uri, image_size=settings.image_size, cache_row_groups=settings.cache_row_groups)
    # the same dataset, reading through the counting filesystem (the footers are read already)
    data.filesystem = counter.filesystem()
    return data, counter


def _sampler(data: ParquetShards, settings: DataBenchSettings) -> Sampler:
    """The sampler training uses for these shards (one rank)."""
    return training_sampler(
        data,
        seed=settings.seed,
        drop_last=True,
        batch_size=settings.batch_size,
        loader_workers=settings.num_workers,
    )


def _generator(seed: int) -> Any:
    import torch

    return torch.Generator().manual_seed(seed)


def _write_imagefolder(shards: Path, out: Path) -> str:
    """The shards' images as ``out/train/class_NN/NNNNNN.png`` (the PNG bytes as stored)."""
    for path in sorted(shards.glob("*.parquet")):
        table = pq.read_table(path, columns=["image", "label", "index"]).to_pydict()
        for png, label, index in zip(table["image"], table["label"], table["index"], strict=True):
            folder = out / "train" / f"class_{label:03d}"
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{index:06d}.png").write_bytes(png)
    return str(out)


def _epoch(
    name: str,
    dataset: Any,
    sampler: Sampler,
    settings: DataBenchSettings,
    counter: CountingFileSystem | None,
    dataset_bytes: int | None = None,
) -> PathFigures:
    """Read one epoch of ``dataset`` in ``sampler``'s order; count its reads."""
    if isinstance(sampler, DistributedSampler):
        sampler.set_epoch(0)
    loader = DataLoader(
        dataset,
        batch_size=settings.batch_size,
        sampler=sampler,
        num_workers=settings.num_workers,
        drop_last=True,
    )
    if counter is not None:
        counter.reset()
    start = time.perf_counter()
    images = sum(len(batch[0]) for batch in loader)
    seconds = time.perf_counter() - start
    size = dataset_bytes if dataset_bytes is not None else _dataset_bytes(dataset)
    read = counter.bytes_read if counter is not None else None
    figures = PathFigures(
        name=name,
        images=images,
        seconds=seconds,
        images_per_s=images / seconds if seconds > 0 else float("inf"),
        bytes_read=read,
        reads=counter.reads if counter is not None else None,
        dataset_bytes=size,
        amplification=read / size if read is not None and size else None,
    )
    log.info("bench data: %s", figures)
    return figures


def _dataset_bytes(dataset: ParquetShards) -> int:
    """The shard files' total size (the manifest's, which ``write_shards`` took from the files)."""
    return sum(s.bytes for s in dataset.manifest.shards) if dataset.manifest else 0


def format_data_report(result: DataBenchResult) -> str:
    """The report: the data set, a table of paths, the ratio lines and the target."""
    mb = result.dataset_bytes / 1e6
    lines = [
        f"data benchmark: {result.rows} images {result.settings.image_size}px, {result.shards} shards, "
        f"{result.row_groups} row groups of {result.settings.row_group_size}, {mb:.2f} MB; "
        f"batch {result.settings.batch_size}, {result.settings.num_workers} loader workers; "
        f"S3 at {result.s3_endpoint}",
        f"{'path':<34}{'bytes read':>14}{'read/data':>11}{'reads':>8}{'images/s':>11}",
    ]
    for p in result.paths:
        read = "-" if p.bytes_read is None else f"{p.bytes_read:,}"
        amp = "-" if p.amplification is None else f"{p.amplification:.2f}"
        reads = "-" if p.reads is None else str(p.reads)
        lines.append(f"{p.name:<34}{read:>14}{amp:>11}{reads:>8}{p.images_per_s:>11.0f}")
    s3 = result.path("s3 parquet")
    local = result.path("local parquet")
    verdict = "ok" if result.passed else "MISSED"
    lines.append(
        f"s3 parquet: bytes read per epoch / dataset bytes = {s3.amplification:.2f} "
        f"(target <= {AMPLIFICATION_TARGET}): {verdict}"
    )
    lines.append(f"s3 parquet / local parquet images/s = {s3.images_per_s / local.images_per_s:.2f}")
    if any(p.name == "local imagefolder" for p in result.paths):
        folder = result.path("local imagefolder")
        lines.append(f"s3 parquet / local imagefolder images/s = {s3.images_per_s / folder.images_per_s:.2f}")
    return "\n".join(lines)
