"""Asynchronous, atomic TensorStore checkpoints of a pytree of (sharded) ``jax.Array``.

Layout under the run's ``checkpoints/`` directory (local path or ``gs://``; the folder names
and the commit marker are ``trainer/rundir.py``'s, which the operators read too)::

    step-000001200/
        arrays/<leaf>/          zarr3 array per leaf, global shape, chunked by shard
        process-00003.done      each process, once its shards are durable
        commit.json             written last by process 0 once every process is done

A checkpoint exists only once ``commit.json`` does (atomic on both POSIX rename and GCS object
writes), so a kill at any moment leaves either the previous checkpoint or the new one. Deleting
removes ``commit.json`` first for the same reason.

Saving: the caller's thread copies this process's shards to host memory (``replica_id == 0``
only, so replicated leaves are written once), then a single background thread writes them while
training continues. The copy is all the training loop waits for: on CPU a memcpy into staging
buffers reused from save to save (~10 ms for a 135 MiB state), on accelerators overlapped
device-to-host transfers. At most one save is in flight; the next save (or ``wait``) joins it,
so host memory holds one host copy of the state (the staging buffers), whatever the number of
saves.

Temporary checkpoints roll (the newest ``keep`` survive); permanent ones are never deleted.
"""

from __future__ import annotations

import json
import re
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import fsspec
import jax
import numpy as np
import tensorstore as ts

from tokenstore.store import _kvstore  # the one place that maps paths to TensorStore kvstores
from trainer.rundir import COMMIT, STEP_DIR_RE, committed_steps, step_dir

MAX_CHUNK_BYTES = 64 << 20


def _fs(path: str):
    return fsspec.core.url_to_fs(path)


def leaf_key(path) -> str:
    key = jax.tree_util.keystr(path)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", key.replace("[", ".").replace("]", "")).strip("._")


def _chunk_shape(shape: tuple[int, ...], shard: tuple[int, ...], itemsize: int) -> list[int]:
    """Chunks align with shards (no two processes ever write one chunk); big ones are split."""
    chunk = [max(1, s) for s in shard] or [1]
    if not shape:
        return []
    while np.prod(chunk) * itemsize > MAX_CHUNK_BYTES:
        axis = int(np.argmax(chunk))
        if chunk[axis] % 2:
            break
        chunk[axis] //= 2
    return chunk


def _spec(path: str, shape, dtype: np.dtype, chunk) -> dict[str, Any]:
    return {
        "driver": "zarr3",
        "kvstore": _kvstore(path),
        "metadata": {
            "shape": list(shape),
            "data_type": np.dtype(dtype).name,
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk) or []}},
            "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}],
        },
        "create": True,
        "open": True,
    }


def latest_step(root: str) -> int | None:
    steps = committed_steps(root)
    return steps[-1][0] if steps else None


Staged = list[tuple[str, tuple, np.dtype, tuple, list]]


def _host_shards(tree, buffers: dict | None = None) -> Staged:
    """(key, global shape, dtype, shard shape, [(index, host copy)]) for each leaf: the shards
    this process writes (``replica_id == 0``, so replicated leaves are written once).

    The copies must be real: the train step donates the state's buffers, so the next step
    overwrites them while the background thread is still writing. On CPU the device buffer is
    host memory and ``np.asarray`` a zero-copy view; the copy goes into ``buffers`` (reused from
    save to save: a copy into warm memory runs at memcpy speed, ~15 GB/s here, where a fresh
    allocation pays a page fault per 4 KiB, ~3 GB/s). On accelerators every device-to-host
    transfer is started first (``copy_to_host_async``) so they overlap, and ``np.asarray``
    returns a fresh host array."""
    reuse = {} if buffers is None else buffers
    staged: Staged = []
    selected = []
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        x = x if isinstance(x, jax.Array) else jax.numpy.asarray(x)
        shards = [s for s in x.addressable_shards if s.replica_id == 0]
        selected.append((leaf_key(path), x, shards))
    on_host = all(s.data.device.platform == "cpu" for _, _, sh in selected for s in sh)
    if not on_host:
        for _, _, shards in selected:
            for s in shards:
                s.data.copy_to_host_async()
    used: dict = {}
    for key, x, shards in selected:
        parts = []
        for i, s in enumerate(shards):
            if on_host:
                src = np.asarray(s.data)
                buf = reuse.get((key, i))
                if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
                    buf = np.empty(src.shape, src.dtype)
                np.copyto(buf, src)
                used[(key, i)] = buf
            else:
                buf = np.asarray(s.data)
            parts.append((s.index, buf))
        staged.append(
            (key, tuple(x.shape), np.dtype(x.dtype), x.sharding.shard_shape(x.shape), parts)
        )
    if buffers is not None:  # keep only this tree's buffers: bounded by one copy of the state
        buffers.clear()
        buffers.update(used)
    return staged


def has_array(root: str, step: int, key: str) -> bool:
    """Whether checkpoint ``step`` holds the leaf ``key`` (a zarr3 array: its ``zarr.json``), for
    readers that accept checkpoints written before a leaf existed."""
    fs, base = _fs(f"{step_dir(root, step)}/arrays/{key}/zarr.json")
    return fs.exists(base)


class Checkpointer:
    def __init__(
        self,
        root: str,
        *,
        keep: int = 1,
        async_save: bool = True,
        process_index: int | None = None,
        process_count: int | None = None,
        commit_timeout_s: float = 600.0,
        write_threads: int | None = None,
    ) -> None:
        self.root = root.rstrip("/")
        self.keep = keep
        self.async_save = async_save
        self.process_index = jax.process_index() if process_index is None else process_index
        self.process_count = jax.process_count() if process_count is None else process_count
        self.commit_timeout_s = commit_timeout_s
        # TensorStore's copy and file-I/O threads for the background write (None = its default,
        # one per core): on a CPU-only run every core the writer takes is one the step loses
        self._write_context: dict[str, Any] = {"cache_pool": {"total_bytes_limit": 0}}
        if write_threads:
            limit = {"limit": int(write_threads)}
            self._write_context |= {"data_copy_concurrency": limit, "file_io_concurrency": limit}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending: Future | None = None
        self._lock = threading.Lock()
        # host staging buffers, reused by every save (only the previous save's write reads
        # them, and ``save`` joins it first): one host copy of this process's shards
        self._buffers: dict = {}
        self.last_save_s = 0.0  # wall time of the last completed write (background)
        self.last_host_copy_s = 0.0  # training-thread time of the last save (the copy)
        self.last_wait_s = 0.0  # training-thread time the last save waited for the previous one

    # -- saving --------------------------------------------------------------------------

    def save(self, step: int, tree, *, permanent: bool = False, meta: dict | None = None) -> None:
        """Copy this process's shards of ``tree`` to host (the only part on the caller's
        critical path) and write them in the background (or here, if not ``async_save``)."""
        t0 = time.perf_counter()
        self.wait()  # one save in flight at most: bounded host memory, and the buffers are free
        t1 = time.perf_counter()
        leaves = _host_shards(tree, self._buffers)
        self.last_wait_s, self.last_host_copy_s = t1 - t0, time.perf_counter() - t1
        job = (step, leaves, permanent, dict(meta or {}))
        if self.async_save:
            self._pending = self._pool.submit(self._write, *job)
        else:
            self._write(*job)

    def discard_unfinished(self) -> list[int]:
        """Delete the folders of saves that never committed (a kill mid-save), before this run
        saves anything: re-saving into one would reopen its arrays, which fails when the mesh
        or the chunking changed since, and its old ``process-*.done`` markers would let
        process 0 commit before the other processes rewrote their shards. Process 0 calls it
        before every process passes a barrier. Returns the steps deleted."""
        fs, base = _fs(self.root)
        if not fs.exists(base):
            return []
        committed = {s for s, _ in committed_steps(self.root)}
        gone = []
        for entry in fs.ls(base, detail=False):
            match = STEP_DIR_RE.fullmatch(entry.rstrip("/").rsplit("/", 1)[-1])
            if match and int(match.group(1)) not in committed:
                fs.rm(entry.rstrip("/"), recursive=True)
                gone.append(int(match.group(1)))
        return sorted(gone)

    def wait(self) -> None:
        if self._pending is not None:
            pending, self._pending = self._pending, None
            pending.result()  # re-raises a failed background save

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._pool.shutdown(wait=True)

    def _write(self, step: int, leaves, permanent: bool, meta: dict) -> None:
        t0 = time.perf_counter()
        d = step_dir(self.root, step)
        fs, base = _fs(d)
        if self.process_index == 0 and fs.exists(f"{base}/{COMMIT}"):
            fs.rm(f"{base}/{COMMIT}")  # re-saving a step (after a resume): invalidate first
        ctx = ts.Context(self._write_context)
        futures = []
        opened = []
        for key, shape, dtype, shard_shape, parts in leaves:
            chunk = _chunk_shape(shape, tuple(shard_shape), dtype.itemsize)
            arr = ts.open(_spec(f"{d}/arrays/{key}", shape, dtype, chunk), context=ctx).result()
            opened.append(arr)
            for index, data in parts:
                futures.append(arr[index].write(data) if shape else arr.write(data))
        for f in futures:
            f.result()
        del futures, opened, leaves  # release the host copy before the (slow) commit wait
        fs.makedirs(base, exist_ok=True)
        with fs.open(f"{base}/process-{self.process_index:05d}.done", "w") as f:
            f.write("ok\n")
        if self.process_index == 0:
            self._commit(fs, base, step, permanent, meta)
        self.last_save_s = time.perf_counter() - t0

    def _commit(self, fs, base: str, step: int, permanent: bool, meta: dict) -> None:
        deadline = time.monotonic() + self.commit_timeout_s
        for p in range(self.process_count):
            while not fs.exists(f"{base}/process-{p:05d}.done"):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"checkpoint {base}: process {p} never finished")
                time.sleep(0.05 if "file" in fs.protocol else 0.5)  # gentle on GCS
        record = {"step": step, "permanent": permanent, "time": time.time(), **meta}
        tmp = f"{base}/{COMMIT}.tmp"
        with fs.open(tmp, "w") as f:
            json.dump(record, f)
        fs.mv(tmp, f"{base}/{COMMIT}")  # rename: atomic locally; object stores write whole
        self._prune(fs, step)

    def _prune(self, fs, newest: int) -> None:
        temporaries = [s for s, rec in committed_steps(self.root) if not rec.get("permanent")]
        for s in temporaries[: max(0, len(temporaries) - self.keep)]:
            if s == newest:
                continue
            _, base = _fs(step_dir(self.root, s))
            fs.rm(f"{base}/{COMMIT}")  # invisible first, then gone
            fs.rm(base, recursive=True)

    # -- restoring ----------------------------------------------------------------------

    def restore(self, step: int, target, prefix: str = ""):
        """Read checkpoint ``step`` into the structure, shapes and shardings of ``target``
        (a pytree of ``jax.Array`` or ``jax.ShapeDtypeStruct`` with ``.sharding``). ``prefix``
        selects a subtree: ``restore(step, params_target, "params.")`` reads only parameters."""
        d = step_dir(self.root, step)
        ctx = ts.Context({"cache_pool": {"total_bytes_limit": 0}})
        flat, treedef = jax.tree_util.tree_flatten_with_path(target)
        out = []
        for path, t in flat:
            spec = {"driver": "zarr3", "kvstore": _kvstore(f"{d}/arrays/{prefix}{leaf_key(path)}")}
            arr = ts.open(spec, open=True, read=True, context=ctx).result()
            if tuple(arr.shape) != tuple(t.shape):
                raise ValueError(f"{leaf_key(path)}: checkpoint shape {arr.shape} != {t.shape}")
            out.append(
                jax.make_array_from_callback(
                    tuple(t.shape),
                    t.sharding,
                    lambda idx, arr=arr, dt=t.dtype: np.asarray(arr[idx].read().result(), dt),
                )
            )
        return jax.tree_util.tree_unflatten(treedef, out)
