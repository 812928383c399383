"""grain input pipeline: seeded global shuffle, sharded by JAX process, resumable position.

Order of operations: source -> shuffle(seed) -> repeat(num_epochs) -> shard -> batch. Each epoch is
reshuffled (grain folds the epoch into the seed); shard `i` of `n` takes elements i, i+n, ... of the
global stream, so processes see disjoint examples; batches are Python lists of example dicts.
`make_stream` is the same global stream with random access (what the trainer reads: each process
loads only the stream positions of the rows it feeds).
"""

from __future__ import annotations

import grain

# Elements are small dicts made on the fly: one reader thread with a short queue is plenty and
# keeps the host cores for the reward workers and JAX.
_READ_OPTIONS = grain.ReadOptions(num_threads=1, prefetch_buffer_size=16)


def make_iterator(
    source,
    *,
    seed: int,
    batch_size: int,
    shard_index: int | None = None,
    shard_count: int | None = None,
    num_epochs: int | None = None,
    shuffle: bool = True,
    drop_remainder: bool = True,
) -> grain.DatasetIterator:
    """An iterator over batches (lists of `batch_size` examples) of this process's shard.

    Args:
      source: random-access examples (`len`, `[i]`), e.g. from `data.load_task`.
      seed: shuffle seed in [0, 2**32); the same seed gives the same stream on every run.
      shard_index, shard_count: this shard; default `jax.process_index()`, `jax.process_count()`.
      num_epochs: passes over the data (None: forever).
      shuffle, drop_remainder: as named; with `drop_remainder` every shard yields the same number
        of batches (the stream is trimmed to a multiple of shard_count * batch_size).

    `it.get_state()` is a small JSON-serialisable dict; `it.set_state(state)` on an iterator made
    with the same arguments resumes exactly after the last batch returned.
    """
    if shard_index is None or shard_count is None:
        import jax

        shard_index = jax.process_index() if shard_index is None else shard_index
        shard_count = jax.process_count() if shard_count is None else shard_count
    if not 0 <= shard_index < shard_count:
        raise ValueError(f"shard_index={shard_index} is not in [0, shard_count={shard_count}).")
    if batch_size < 1:
        raise ValueError(f"batch_size is {batch_size}; use an integer >= 1.")
    ds = grain.MapDataset.source(source)
    if len(ds) == 0:
        raise ValueError("the source is empty; check the data path and split.")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    if num_epochs != 1:
        ds = ds.repeat(num_epochs)
    if num_epochs is not None and drop_remainder:
        per_step = shard_count * batch_size
        ds = ds[: len(ds) // per_step * per_step]
    ds = ds[shard_index::shard_count]
    ds = ds.batch(batch_size, drop_remainder=drop_remainder, batch_fn=list)
    return iter(ds.to_iter_dataset(read_options=_READ_OPTIONS))


def make_stream(source, *, seed: int, shuffle: bool = True) -> grain.MapDataset:
    """The global example stream with random access: `stream[k]` is example number k.

    Element k equals the k-th example of `make_iterator(source, seed=seed, batch_size=1,
    shard_index=0, shard_count=1, shuffle=shuffle)` (same shuffle, epochs reshuffled, endless),
    so a reader that keeps its own position (an int) resumes exactly and any process can load
    any slice of a global batch without reading the rest.
    """
    ds = grain.MapDataset.source(source)
    if len(ds) == 0:
        raise ValueError("the source is empty; check the data path and split.")
    if shuffle:
        ds = ds.shuffle(seed=seed)
    return ds.repeat(None)
