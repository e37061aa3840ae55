"""Running a command's work by rank partition: in this process, in ``-j N`` local processes, or on a
Dask cluster (``--engine dask``, ``--cluster ADDRESS``).

Ranks are independent in every replay, so a command splits its ranks into contiguous parts of about
equal log bytes, runs one function per part and joins the answers in rank order: the same answer
whatever ran it. The function, its arguments and its answer must pickle. Dask workers must see the
run's files at the same paths (docs/scale.md).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import ctypes
import logging
import multiprocessing
import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

from trainrec.replay.discover import RunInfo
from trainrec.replay.index_summary import quick_rank
from trainrec.replay.run import Run
from trainrec.replay.summary import summarize, summarize_rank
from trainrec.schema.errors import ConfigError, TrainrecError

from .progress import Progress

__all__ = [
    "add_jobs_arguments", "check_engine", "partition_ranks", "pool_context", "quick_ranks", "quick_run", "rank_bytes",
    "run_parts", "sub_info", "summarize_ranks", "summarize_run",
]

ENGINES = ("local", "dask")
log = logging.getLogger(__name__)
# glibc's mallopt parameters (malloc.h), for the workers' heap: see _steady_heap
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3


def pool_context():
    """Worker start method: fork (fast, nothing to re-import) when this process has no other thread."""
    if threading.active_count() == 1 and "fork" in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("fork")
    return multiprocessing.get_context("spawn")



def add_jobs_arguments(parser: argparse.ArgumentParser, engine: bool = False) -> None:
    """``-j N`` (and with ``engine``: ``--engine``, ``--cluster``)."""
    parser.add_argument("-j", "--jobs", type=positive_int, default=1, metavar="N",
                        help="processes, by rank partition (default 1; the answer is the same)")
    if engine:
        parser.add_argument("--engine", choices=ENGINES, default="local",
                            help="where the parts run: local processes (-j), or a Dask cluster (the dask extra)")
        parser.add_argument("--cluster", metavar="ADDRESS", default=None,
                            help="the Dask scheduler to use (e.g. tcp://host:8786; implies --engine dask); "
                                 "without it --engine dask starts a local cluster of -j processes")


def positive_int(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, not {n}")
    return n


def check_engine(args: argparse.Namespace) -> str:
    """The engine the arguments ask for; a ConfigError when Dask is asked for and not installed."""
    engine = "dask" if getattr(args, "cluster", None) else getattr(args, "engine", "local")
    if engine == "dask":
        try:
            import distributed  # noqa: F401
        except ImportError:
            raise ConfigError("--engine dask needs Dask: pip install 'trainrec[dask]'", key="--engine") from None
    return engine


def rank_bytes(run: Run, rank: int) -> int:
    total = 0
    for path in run.files(rank):
        try:
            total += os.path.getsize(path)
        except OSError:
            pass
    return total


def partition_ranks(run: Run, ranks: Sequence[int], parts: int) -> list[list[int]]:
    """Contiguous groups of ``ranks`` (at most ``parts``) of about equal log bytes, in rank order."""
    ranks = list(ranks)
    if not ranks:
        return []
    parts = max(1, min(parts, len(ranks)))
    sizes = [max(1, rank_bytes(run, r)) for r in ranks]
    target = sum(sizes) / parts
    out: list[list[int]] = [[]]
    acc = 0.0
    for i, (r, size) in enumerate(zip(ranks, sizes, strict=True)):
        left = len(ranks) - i
        if out[-1] and (acc + size / 2 > target * len(out) or left <= parts - len(out)) and len(out) < parts:
            out.append([])
        out[-1].append(r)
        acc += size
    return out


def sub_info(run: Run, ranks: Sequence[int]) -> RunInfo:
    """The launch reduced to some ranks (what a part's process opens)."""
    info = run.info
    return type(info)(run_id=info.run_id, files={r: list(info.files[r]) for r in ranks})


def run_parts(fn: Callable[..., Any], parts: Sequence[tuple], weights: Sequence[int], jobs: int, label: str,
              engine: str = "local", cluster: str | None = None, progress: bool | None = None) -> list[Any]:
    """``[fn(*args) for args in parts]``, run by ``engine`` with ``jobs`` processes; answers in part order.
    ``weights`` (log bytes per part) drive the progress bar."""
    bar = Progress(sum(weights), len(parts), label, enabled=progress)
    try:
        if engine == "dask":
            return _run_dask(fn, parts, weights, jobs, cluster, bar)
        if jobs <= 1 or len(parts) <= 1:
            out = []
            for args, w in zip(parts, weights, strict=True):
                out.append(fn(*args))
                bar.advance(w, task_done=True)
            return out
        results: list[Any] = [None] * len(parts)
        with cf.ProcessPoolExecutor(max_workers=min(jobs, len(parts)), mp_context=pool_context(),
                                    initializer=_steady_heap) as pool:
            futures = {pool.submit(fn, *args): i for i, args in enumerate(parts)}
            for fut in cf.as_completed(futures):
                i = futures[fut]
                results[i] = fut.result()
                bar.advance(weights[i], task_done=True)
        return results
    finally:
        bar.close()


def _steady_heap() -> None:
    """Let a worker's malloc keep its heap (glibc; elsewhere nothing), so each block's numpy temporaries
    reuse it instead of growing, trimming and faulting the heap in again block after block
    (benchmarks/RESULTS.md, "Replay at scale: step records, frame loop, `-j` workers' heap")."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # (not glibc, or no C library to ask)
        return
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt(_M_MMAP_THRESHOLD, 32 << 20)  # (a fixed threshold: glibc's dynamic one stays low in a worker)
    mallopt(_M_TRIM_THRESHOLD, 64 << 20)


def _run_dask(fn, parts, weights, jobs: int, cluster: str | None, bar: Progress) -> list[Any]:
    from distributed import Client, LocalCluster, as_completed

    local = None
    if not log.isEnabledFor(logging.INFO):  # (-v shows Dask's own log lines)
        logging.getLogger("distributed").setLevel(logging.ERROR)
    try:
        if cluster:
            client = Client(cluster, timeout=30)
        else:
            local = LocalCluster(n_workers=jobs, threads_per_worker=1, processes=True, dashboard_address=":0",
                                 silence_logs=logging.ERROR)
            client = Client(local)
    except (OSError, TimeoutError) as exc:
        raise TrainrecError(f"cannot reach the Dask scheduler {cluster or '(local cluster)'}: {exc}") from exc
    try:
        futures = [client.submit(fn, *args, pure=False) for args in parts]
        index = {f.key: i for i, f in enumerate(futures)}
        results: list[Any] = [None] * len(parts)
        for fut in as_completed(futures):
            i = index[fut.key]
            results[i] = fut.result()
            bar.advance(weights[i], task_done=True)
        return results
    finally:
        client.close()
        if local is not None:
            local.close()


# ---------------------------------------------------------------------------------------- inspect, check
def summarize_ranks(info: RunInfo, ranks: Sequence[int]) -> list:
    """The :class:`~trainrec.replay.summary.RankSummary` of some ranks (a part's work)."""
    run = Run(info)
    return [summarize_rank(run, r) for r in ranks]


def quick_ranks(info: RunInfo, ranks: Sequence[int]) -> list:
    """The :class:`~trainrec.replay.index_summary.QuickRank` of some ranks (a part's work)."""
    run = Run(info)
    return [quick_rank(run, r) for r in ranks]


def quick_run(run: Run, jobs: int) -> list:
    """:func:`~trainrec.replay.index_summary.quick_rank` of every rank of ``run``, by ``jobs`` processes."""
    groups = partition_ranks(run, run.ranks, len(run.ranks) if jobs <= 1 else jobs * 4)
    weights = [sum(rank_bytes(run, r) for r in g) for g in groups]
    parts = run_parts(quick_ranks, [(sub_info(run, g), g) for g in groups], weights, jobs, "inspect")
    return [q for part in parts for q in part]


def summarize_run(run: Run, jobs: int, label: str):
    """:func:`~trainrec.replay.summary.summarize` of ``run``, its ranks read by ``jobs`` processes."""
    groups = partition_ranks(run, run.ranks, len(run.ranks) if jobs <= 1 else jobs * 4)
    weights = [sum(rank_bytes(run, r) for r in g) for g in groups]
    parts = run_parts(summarize_ranks, [(sub_info(run, g), g) for g in groups], weights, jobs, label)
    return summarize(run, [rs for part in parts for rs in part])
