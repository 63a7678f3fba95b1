"""An exact distributed sampler: every sample once per epoch across all ranks, resumable mid-epoch.

``ExactDistributedSampler`` takes the arguments of
``torch.utils.data.DistributedSampler`` (``num_replicas``, ``rank``,
``shuffle``, ``seed``, ``drop_last``, ``set_epoch``) and, in its default
``order="random"``, yields exactly the indices that sampler yields. What it
adds:

* **An explicit remainder policy.** When the dataset size ``n`` is not a
  multiple of the number of ranks, every rank still needs the same number of
  samples (DDP steps in lockstep). ``drop_last=False`` pads by repeating the
  first ``num_padded`` samples of the epoch's permutation;
  ``drop_last=True`` leaves out the last ``num_dropped``. Both numbers are
  attributes, and ``describe()`` says them in words, so an epoch is exactly
  ``n`` samples or differs by a stated amount.
* **Exact mid-epoch resume.** ``state_dict()`` is ``{"epoch", "position"}``
  (plus the settings it depends on); ``load_state_dict`` continues with the
  very next index. ``torchdata.stateful_dataloader.StatefulDataLoader`` calls
  both itself, at the batch it last yielded, so its checkpoints resume
  exactly, with any number of workers.
* **Elastic resume.** A state saved by any rank of a job of N ranks loads on
  any rank of a job of M ranks: ranks move in lockstep, so one rank's position
  says what every rank of the old job consumed, and the rest of the epoch is
  exactly the samples not consumed yet, each once, split between the M ranks
  (padded or cut to an equal share as ``drop_last`` says: ``resume_padded`` and
  ``resume_dropped`` count them, ``describe()`` says them). A job resumed so
  saves the jobs before it in its state, so it can be resumed elastically again.
* **An optional shard-aware order** (``order="shards"``) for node-local disks
  and cold page caches: the epoch's sequence is the shards in a seeded random
  order, each rank takes a contiguous block of it, and shuffles it within
  windows of about ``shards_at_once`` shards, so a rank reads from only a few
  shards at a time.
* **Node-local sampling** (``order="nodes"``, ``nodes=N``) for packs staged
  from object storage: each epoch the shards, in a seeded order, are split
  into ``nodes`` contiguous blocks of ``ranks per node x num_samples``
  samples, one per node (ranks ``node * R .. node * R + R - 1``, torchrun's
  numbering). A node's ranks take turns over its block, shuffled within
  windows of ``shards_at_once`` shards, so they move through the same few
  shards together, and the node stages about ``1/nodes`` of the shards per
  epoch (plus at most one shard it shares with each neighbouring node when
  the shards' sizes do not fall on the split). The seed reassigns shards to
  nodes every epoch. The cost is shuffle quality: a batch mixes samples of
  about ``shards_at_once`` shards only (and the global batch those of
  ``nodes x shards_at_once``), where ``order="random"`` draws every batch
  from the whole dataset. With a class-sorted pack (ImageFolder order) a
  shard holds few classes, so pack with more, smaller shards and raise
  ``shards_at_once`` as far as the cache allows (docs/design.md).

With a pack in object storage (``LMDBFolder(url, cache_dir=...)``), the
sampler tells the pack's staging cache, at the start of each epoch, the order
in which this rank will read the shards, so they are fetched ahead of need
in that order and evicted when no rank on the node needs them any more.

It is a ``torch.utils.data.DistributedSampler`` (a subclass, with its
attributes), because frameworks that manage samplers look for one: PyTorch
Lightning's Trainer replaces any other sampler of a distributed job with its own
wrapper, which would split this sampler's part between the ranks once more
(every rank trained on half of its share). Hugging Face Accelerate's
``prepare(loader)`` shards any loader's batches again: see
docs/distributed.md, "With PyTorch Lightning or Accelerate".

Ranks need no communication: the order is a function of (seed, epoch,
dataset size, shard offsets, number of ranks), computed identically in every
rank from torch's seeded CPU generator (the same torch version everywhere).
"""

from __future__ import annotations

import copy
import hashlib
import itertools
import math
import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Iterator, Sequence, Sized, TypedDict

from lmdbfolder.errors import MissingDependencyError

try:
    import torch
    import torch.distributed as dist
    from torch.utils.data import DistributedSampler
except ImportError as exc:  # a core-only install: say what to install
    raise MissingDependencyError("lmdbfolder.sampler (ExactDistributedSampler)", "torch", "torch") from exc

if TYPE_CHECKING:
    from typing_extensions import Unpack

__all__ = ["ExactDistributedSampler", "ORDERS"]

ORDERS = ("random", "shards", "nodes")
_STATE_VERSION = 1
#: A state that carries the earlier jobs of its epoch (an elastic resume): older
#: readers, which would ignore them, refuse it by its version.
_ELASTIC_STATE_VERSION = 2
#: Settings of the job that saved a state that may differ from the job that loads it.
_JOB_SETTINGS = ("num_replicas", "nodes")
#: Settings a saved state must share with the sampler that loads it.
_SETTINGS = ("num_replicas", "dataset_len", "shuffle", "seed", "drop_last", "order", "window", "nodes")
#: The value of a setting that states saved before it existed meant.
_SETTING_DEFAULTS = {"nodes": 1}


class _OrderKeywords(TypedDict, total=False):
    """The keywords of ``ExactDistributedSampler`` that say the order (``SampleOrder``'s fields)."""

    order: str
    shards_at_once: int
    window: int | None
    shard_offsets: Sequence[int] | None
    nodes: int | None


@dataclass(frozen=True)
class SampleOrder:
    """How ``ExactDistributedSampler`` orders an epoch and lays it over the ranks: its
    keyword arguments, as one value (see the class for each field)."""

    order: str = "random"
    shards_at_once: int = 2
    window: int | None = None
    shard_offsets: Sequence[int] | None = None
    nodes: int | None = None

    @classmethod
    def from_keywords(cls, keywords: dict[str, Any]) -> SampleOrder:
        """The order the keywords ask for; TypeError for a keyword that is none of the fields."""
        known = {f.name for f in fields(cls)}
        for name in keywords:
            if name not in known:
                raise TypeError(f"ExactDistributedSampler() got an unexpected keyword argument {name!r}")
        return cls(**keywords)


def _shard_offsets_of(dataset: Sized) -> list[int] | None:
    for obj in (dataset, getattr(dataset, "reader", None)):
        offsets = getattr(obj, "shard_offsets", None)
        if offsets is not None:
            return [int(x) for x in offsets]
    return None


def _resolve_ranks(num_replicas: int | None, rank: int | None) -> tuple[int, int]:
    """``(num_replicas, rank)``, from ``torch.distributed`` where not given; ValueError when
    they cannot be known or do not fit together."""
    if num_replicas is None or rank is None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("pass num_replicas and rank, or initialise torch.distributed first")
        num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        rank = dist.get_rank() if rank is None else rank
    if num_replicas < 1 or not 0 <= rank < num_replicas:
        raise ValueError(f"rank must be in 0..num_replicas-1, got rank={rank}, num_replicas={num_replicas}")
    return num_replicas, rank


def _checked_offsets(dataset: Sized, shard_offsets: Sequence[int] | None, n: int) -> list[int]:
    """The first index of each shard, then ``n``: as given, else the dataset's, else one shard."""
    offsets = list(shard_offsets) if shard_offsets is not None else _shard_offsets_of(dataset)
    if offsets is None:
        offsets = [0, n]
    if offsets[0] != 0 or offsets[-1] != n or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise ValueError(f"shard_offsets must rise from 0 to len(dataset)={n}, got {offsets[:3]}...{offsets[-2:]}")
    return offsets


def _resolve_nodes(order: str, nodes: int | None, num_replicas: int) -> int | None:
    """The number of nodes of ``order="nodes"`` (from ``LOCAL_WORLD_SIZE`` when not given),
    checked; for the other orders ``nodes`` as given (None or 1)."""
    if order == "nodes":
        if nodes is None:
            local = os.environ.get("LOCAL_WORLD_SIZE", "")
            if not local.isdigit() or int(local) < 1:
                raise ValueError("order='nodes' needs nodes=N (or LOCAL_WORLD_SIZE, which torchrun sets)")
            nodes = max(1, num_replicas // int(local))
        if isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1 or num_replicas % nodes:
            raise ValueError(
                f"nodes must divide num_replicas={num_replicas} (every node runs as many ranks), got {nodes!r}"
            )
    elif nodes not in (None, 1):
        raise ValueError(f"nodes is for order='nodes', not order={order!r}")
    return nodes


def _staging_of(dataset: Sized) -> Any:
    for obj in (dataset, getattr(dataset, "reader", None)):
        staging = getattr(obj, "staging", None)
        if staging is not None:
            return staging
    return None


def _derived_seed(*parts: int) -> int:
    digest = hashlib.sha256("/".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


class ExactDistributedSampler(DistributedSampler[int]):
    """Split each epoch's seeded permutation into disjoint, equal parts, one per rank.

    Args:
        dataset: anything with ``len()``; for ``order="shards"`` an
            ``LMDBFolder``/``Reader`` of a sharded pack (its ``shard_offsets``
            are used) or pass ``shard_offsets``.
        num_replicas: number of ranks (default: ``torch.distributed``'s world size).
        rank: this rank (default: ``torch.distributed``'s rank).
        shuffle: permute the samples each epoch (seeded by ``seed + epoch``).
        seed: the same in every rank.
        drop_last: the remainder policy. False: pad by repeating
            ``num_padded`` samples; True: leave out ``num_dropped`` samples.
        order: ``"random"`` (the order of torch's DistributedSampler),
            ``"shards"`` (shard-aware) or ``"nodes"`` (node-local: each node's
            ranks read their own part of the shards; see the module docs).
        shards_at_once: for ``order="shards"`` and ``"nodes"``: the shuffle
            window is this many average shards long, so a rank reads from at
            most ``shards_at_once + 1`` shards at a time.
        nodes: for ``order="nodes"``: the number of nodes; ranks
            ``k * R .. k * R + R - 1`` are node ``k`` (``R = num_replicas //
            nodes``, torchrun's numbering). Default: ``num_replicas //
            LOCAL_WORLD_SIZE`` (set by torchrun).
        window: the shuffle window in samples (overrides ``shards_at_once``).
        shard_offsets: first index of each shard, then the total (``num_shards + 1``
            values); by default taken from ``dataset``, else one shard.

    Example:
        >>> from torchdata.stateful_dataloader import StatefulDataLoader
        >>> sampler = ExactDistributedSampler(dataset, seed=0)  # doctest: +SKIP
        >>> loader = StatefulDataLoader(dataset, batch_size=256, sampler=sampler, num_workers=8)  # doctest: +SKIP
        >>> print(sampler.describe())  # doctest: +SKIP
        1,281,167 samples on 8 ranks: 160,146 per rank, 1 sample repeated each epoch (drop_last=False)
        >>> for epoch in range(start_epoch, epochs):  # doctest: +SKIP
        ...     sampler.set_epoch(epoch)
        ...     for batch in loader: ...  # loader.state_dict() resumes mid-epoch exactly
    """

    def __init__(
        self,
        dataset: Sized,
        num_replicas: int | None = None,
        rank: int | None = None,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = False,
        **order_keywords: Unpack[_OrderKeywords],
    ) -> None:
        # The keyword-only arguments (order, shards_at_once, window, shard_offsets,
        # nodes) are one value, SampleOrder: the settings of the order travel together.
        layout = SampleOrder.from_keywords(dict(order_keywords))
        order, shards_at_once, window = layout.order, layout.shards_at_once, layout.window
        num_replicas, rank = _resolve_ranks(num_replicas, rank)
        if order not in ORDERS:
            raise ValueError(f"order must be one of {ORDERS}, got {order!r}")
        n = len(dataset)
        if n < 1:
            raise ValueError("the dataset is empty")
        offsets = _checked_offsets(dataset, layout.shard_offsets, n)
        if shards_at_once < 1 or (window is not None and window < 1):
            raise ValueError("shards_at_once and window must be positive")
        nodes = _resolve_nodes(order, layout.nodes, num_replicas)
        # torch's own attributes first (ours below are the same names, set our way): it only
        # takes len() of the dataset, and its arguments are resolved and checked above.
        super().__init__(dataset, num_replicas, rank, shuffle, seed, drop_last)  # type: ignore[arg-type]
        self.nodes = nodes or 1
        self.ranks_per_node = num_replicas // self.nodes
        self._dataset = dataset  # its staging cache (a pack in object storage) follows the order
        self.dataset_len = n
        self.num_replicas = num_replicas
        self.rank = rank
        self.shuffle = shuffle
        self.seed = seed
        self.drop_last = drop_last
        self.order = order
        self.shard_offsets = offsets
        num_shards = len(offsets) - 1
        self.window = window if window is not None else shards_at_once * math.ceil(n / num_shards)
        self.num_samples, self.total_size = _split_sizes(n, num_replicas, drop_last)
        if self.num_samples < 1:
            raise ValueError(f"{n} samples cannot give each of {num_replicas} ranks one sample with drop_last=True")
        self.epoch = 0
        self._position = 0
        self._resume_at: int | None = None
        #: The jobs that ran part of this epoch before this one (an elastic resume),
        #: as saved in their states; empty: this job runs the epoch from its start.
        self._earlier: list[dict[str, int]] = []
        self._plan_cache: tuple[Any, list[list[int]], int, int] | None = None

    # -- the policy, in numbers ----------------------------------------------------
    @property
    def remainder(self) -> str:
        """``"pad"`` (drop_last=False) or ``"drop"`` (drop_last=True)."""
        return "drop" if self.drop_last else "pad"

    @property
    def num_padded(self) -> int:
        """Samples seen twice (or more) per epoch across all ranks, to even out the ranks."""
        return 0 if self.drop_last else self.total_size - self.dataset_len

    @property
    def num_dropped(self) -> int:
        """Samples left out of each epoch (a different random set each epoch when shuffling)."""
        return self.dataset_len - self.total_size if self.drop_last else 0

    def describe(self) -> str:
        """The split in words: samples per rank and what happens to the remainder."""
        text = f"{self.dataset_len:,} samples on {self.num_replicas} ranks: {self.num_samples:,} per rank"
        if self.num_padded:
            text += f", {self.num_padded:,} sample{'s' if self.num_padded > 1 else ''} repeated each epoch"
        elif self.num_dropped:
            text += f", {self.num_dropped:,} sample{'s' if self.num_dropped > 1 else ''} left out each epoch"
        else:
            text += ", every sample exactly once"
        text = f"{text} (drop_last={self.drop_last})"
        if self._earlier:
            left = self._resumed_plan()
            jobs = " then ".join(f"{job['num_replicas']} ranks" for job in self._earlier)
            text += (
                f"; epoch {self.epoch} resumed after {jobs}: {len(left):,} indices left for this rank"
                f" ({self.resume_padded:,} repeated, {self.resume_dropped:,} left out across the ranks)"
            )
        return text

    @property
    def resume_padded(self) -> int:
        """Samples repeated (across all ranks) to split the rest of an elastically resumed epoch evenly."""
        return self._resumed_split()[1] if self._earlier else 0

    @property
    def resume_dropped(self) -> int:
        """Samples left out of the rest of an elastically resumed epoch (``drop_last=True``)."""
        return self._resumed_split()[2] if self._earlier else 0

    # -- the order -------------------------------------------------------------------
    def global_order(self, epoch: int | None = None) -> list[int]:
        """The epoch's sequence over all ranks, after the remainder policy (``total_size`` indices)."""
        epoch = self.epoch if epoch is None else epoch
        n = self.dataset_len
        if self.order == "random":
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                indices = torch.randperm(n, generator=g).tolist()
            else:
                indices = list(range(n))
        elif self.order == "nodes":
            offsets = self.shard_offsets
            shard_order = list(range(len(offsets) - 1))
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                shard_order = torch.randperm(len(shard_order), generator=g).tolist()
            # No rotation: the nodes' blocks start on shard boundaries wherever
            # the sizes allow, so a node stages only its own shards.
            indices = [i for s in shard_order for i in range(offsets[s], offsets[s + 1])]
            if self.drop_last:
                return indices[: self.total_size]
            # Padding repeats the end of the sequence: samples of the last node's
            # own shards, so padding makes no node stage another node's shard.
            padding = self.total_size - n
            repeated = indices * math.ceil(padding / n) if padding else []
            return indices + repeated[len(repeated) - padding :]
        else:
            offsets = self.shard_offsets
            shard_order = list(range(len(offsets) - 1))
            rotate = 0
            if self.shuffle:
                g = torch.Generator()
                g.manual_seed(self.seed + epoch)
                shard_order = torch.randperm(len(shard_order), generator=g).tolist()
                rotate = int(torch.randint(n, (1,), generator=g).item())
            indices = [i for s in shard_order for i in range(offsets[s], offsets[s + 1])]
            # Rotating moves the block boundaries between ranks every epoch, so
            # a rank does not see the same shards' samples epoch after epoch.
            indices = indices[rotate:] + indices[:rotate]
        if self.drop_last:
            return indices[: self.total_size]
        padding = self.total_size - n
        if padding <= n:
            return indices + indices[:padding]
        return indices + (indices * math.ceil(padding / n))[:padding]

    def indices(self, epoch: int | None = None, rank: int | None = None) -> list[int]:
        """The ``num_samples`` indices rank ``rank`` (default: this rank) gets in ``epoch``, in order."""
        epoch = self.epoch if epoch is None else epoch
        rank = self.rank if rank is None else rank
        if not 0 <= rank < self.num_replicas:
            raise ValueError(f"rank must be in 0..{self.num_replicas - 1}, got {rank}")
        order = self.global_order(epoch)
        if self.order == "random":
            return order[rank : self.total_size : self.num_replicas]
        if self.order == "nodes":
            node, local = divmod(rank, self.ranks_per_node)
            size = self.ranks_per_node * self.num_samples
            block = order[node * size : (node + 1) * size]
            if self.shuffle:
                # The same shuffle in every rank of the node; the ranks then take
                # turns, so they read the same window of shards at the same time.
                g = torch.Generator()
                g.manual_seed(_derived_seed(self.seed, epoch, node, self.nodes))
                shuffled: list[int] = []
                for start in range(0, len(block), self.window):
                    part = block[start : start + self.window]
                    shuffled.extend(part[j] for j in torch.randperm(len(part), generator=g).tolist())
                block = shuffled
            return block[local :: self.ranks_per_node]
        block = order[rank * self.num_samples : (rank + 1) * self.num_samples]
        if not self.shuffle:
            return block
        g = torch.Generator()
        g.manual_seed(_derived_seed(self.seed, epoch, rank))
        out: list[int] = []
        for start in range(0, len(block), self.window):
            part = block[start : start + self.window]
            out.extend(part[j] for j in torch.randperm(len(part), generator=g).tolist())
        return out

    # -- elastic resume: the rest of an epoch that other jobs began -----------------
    def _job(self, job: dict[str, int]) -> ExactDistributedSampler:
        """This sampler as a rank of the job ``job`` (its number of ranks and nodes)."""
        other = copy.copy(self)
        other.num_replicas = job["num_replicas"]
        other.nodes = job.get("nodes", 1)
        other.ranks_per_node = other.num_replicas // other.nodes
        other.num_samples, other.total_size = _split_sizes(self.dataset_len, other.num_replicas, self.drop_last)
        other._earlier = []
        return other

    def _resumed_split(self) -> tuple[list[list[int]], int, int]:
        """Every rank's indices for the rest of the epoch after ``self._earlier``, and
        the samples repeated and left out to make the shares equal."""
        key = (self.epoch, tuple(tuple(sorted(job.items())) for job in self._earlier))
        if self._plan_cache is not None and self._plan_cache[0] == key:
            return self._plan_cache[1:]  # type: ignore[return-value]
        first = self._job(self._earlier[0])
        shares = [first.indices(self.epoch, r) for r in range(first.num_replicas)]
        padded = dropped = 0
        for k, job in enumerate(self._earlier):
            rest = _not_consumed(shares, job["position"])
            ranks = self._earlier[k + 1]["num_replicas"] if k + 1 < len(self._earlier) else self.num_replicas
            shares, padded, dropped = _share(rest, ranks, self.drop_last, strided=self.order == "random")
        self._plan_cache = (key, shares, padded, dropped)
        return shares, padded, dropped

    def _resumed_plan(self) -> list[int]:
        return self._resumed_split()[0][self.rank]

    # -- the Sampler protocol ----------------------------------------------------
    def __iter__(self) -> Iterator[int]:
        start = 0 if self._resume_at is None else self._resume_at
        self._resume_at = None
        self._position = start
        indices = self._resumed_plan() if self._earlier else self.indices()
        follower, events = self._follow(indices, start)
        for index in itertools.islice(indices, start, None):
            self._position += 1
            if self._position in events:
                follower.advance(self._position)
            yield index

    def shard_schedule(self, indices: Sequence[int], start: int = 0) -> list[tuple[int, int]]:
        """``(shard, position of its last use)`` for the shards ``indices[start:]``
        reads, in the order of their first use (what a staging cache fetches ahead)."""
        import numpy as np

        idx = np.asarray(indices[start:], dtype=np.int64)
        if not len(idx):
            return []
        shard = np.searchsorted(np.asarray(self.shard_offsets, dtype=np.int64), idx, side="right") - 1
        shards, first = np.unique(shard, return_index=True)
        last = len(shard) - 1 - np.unique(shard[::-1], return_index=True)[1]
        order = np.argsort(first, kind="stable")
        return [(int(shards[j]), int(last[j]) + start) for j in order]

    def _follow(self, indices: list[int], start: int) -> tuple[Any, set[int]]:
        """Hand the dataset's staging cache (a pack in object storage) this rank's
        shard order; the positions at which to tell it how far the rank has got."""
        staging = _staging_of(self._dataset)
        if staging is None or staging.num_shards != len(self.shard_offsets) - 1:
            return None, set()
        schedule = self.shard_schedule(indices, start)
        linger = min(self.window, self.num_samples)
        follower = staging.follow(schedule, linger=linger)
        follower.advance(start)
        events = {last + 1 for _, last in schedule} | {last + 1 + linger for _, last in schedule}
        return follower, events

    def __len__(self) -> int:
        return self.num_samples

    def set_epoch(self, epoch: int) -> None:
        """Use the permutation of ``epoch`` (call it before each epoch, as with DistributedSampler).

        A position loaded with ``load_state_dict`` for the same epoch is kept;
        for another epoch, iteration starts at the beginning.
        """
        if epoch != self.epoch:
            self._resume_at = None
            self._position = 0
            self._earlier = []
        self.epoch = epoch
        self._tell_dataset()

    def _tell_dataset(self) -> None:
        # A dataset with replayable augmentation (LMDBFolder(..., seed=S)) draws the
        # epoch's random numbers: the sampler knows the epoch, so the user need not say it twice.
        set_epoch = getattr(self._dataset, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(self.epoch)

    # -- resume ------------------------------------------------------------------------
    @property
    def position(self) -> int:
        """Indices of the current epoch already handed out by this rank's iterator."""
        return self._position if self._resume_at is None else self._resume_at

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "position"}`` and the settings they mean something with.

        With a plain DataLoader, ``position`` runs ahead of training by the
        batches its workers prefetch; ``StatefulDataLoader`` records it at the
        batch it last yielded. Any rank's state fits every rank (all ranks
        take the same number of steps).
        """
        state: dict[str, Any] = {"version": _STATE_VERSION, "epoch": self.epoch, "position": self.position}
        state.update({name: getattr(self, name) for name in _SETTINGS})
        if self._earlier:
            state["version"] = _ELASTIC_STATE_VERSION
            state["earlier_jobs"] = [dict(job) for job in self._earlier]
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Continue at ``state_dict``'s epoch and position (the next index is the one that was next).

        The state may come from any rank of a job of another number of ranks
        (or nodes): the rest of the epoch is then the samples that job had not
        consumed, each once, split between this job's ranks (see the module
        docs, "Elastic resume"); the next epoch is this job's own split.

        A state saved at the end of its epoch, loaded after ``set_epoch`` chose
        a later epoch, leaves that epoch to start at its beginning:
        ``StatefulDataLoader`` loads the state when iteration starts, after the
        loop's ``set_epoch``, so an end-of-epoch checkpoint saved with
        ``epoch + 1`` resumes with the next epoch.

        Raises ValueError when the state was saved with other settings (dataset
        size, seed, shuffle, drop_last, order, and the window of the shard-aware
        orders): with them the remaining samples would not be the ones the
        interrupted run had left.
        """
        version = state_dict.get("version") if isinstance(state_dict, dict) else None
        if version not in (_STATE_VERSION, _ELASTIC_STATE_VERSION):
            raise ValueError(f"not a state of ExactDistributedSampler (version {_STATE_VERSION}): {state_dict!r}")
        # The random order does not depend on the window (nor on the shards it is made of).
        settings = [
            name
            for name in _SETTINGS
            if name not in _JOB_SETTINGS and not (name == "window" and self.order == "random")
        ]
        differ = [
            f"{name} {state_dict.get(name, _SETTING_DEFAULTS.get(name))!r} -> {getattr(self, name)!r}"
            for name in settings
            if state_dict.get(name, _SETTING_DEFAULTS.get(name)) != getattr(self, name)
        ]
        if differ:
            raise ValueError("the saved sampler state does not fit this sampler: " + "; ".join(differ))
        saved_job = _saved_job(state_dict)
        earlier = _earlier_jobs(state_dict) if version == _ELASTIC_STATE_VERSION else []
        epoch, position = state_dict.get("epoch"), state_dict.get("position")
        same_job = saved_job == {"num_replicas": self.num_replicas, "nodes": self.nodes}
        # How many indices each rank of the saving job had in its part of the epoch.
        saved = copy.copy(self)
        saved._earlier = earlier
        if not same_job:
            saved = self._job(saved_job)
            saved._earlier = earlier
        if isinstance(epoch, int) and not isinstance(epoch, bool):
            saved.epoch = epoch
        # (every rank of a job has a share of the same length)
        share = len(saved._resumed_split()[0][0]) if earlier and isinstance(epoch, int) else saved.num_samples
        if not isinstance(epoch, int) or not isinstance(position, int) or not 0 <= position <= share:
            raise ValueError(
                f"bad epoch/position in the saved sampler state: epoch {epoch!r}, position {position!r} "
                f"(a position counts the indices this rank has used in the epoch: 0..{share})"
            )
        if position == share and epoch < self.epoch:
            # Nothing of the saved epoch is left, and the epoch set since is after it.
            self._resume_at = None
            self._position = 0
            self._earlier = []
            return
        self.epoch = epoch
        self._tell_dataset()
        if same_job:
            self._earlier = earlier
            self._resume_at = position
        else:
            self._earlier = [*earlier, {**saved_job, "position": position}]
            self._resume_at = 0
        self._position = self._resume_at


def _split_sizes(n: int, num_replicas: int, drop_last: bool) -> tuple[int, int]:
    """(indices per rank, indices in all) of an epoch of ``n`` samples on ``num_replicas`` ranks."""
    per_rank = n // num_replicas if drop_last and n % num_replicas else math.ceil(n / num_replicas)
    return per_rank, per_rank * num_replicas


def _saved_job(state: dict[str, Any]) -> dict[str, int]:
    """The number of ranks and nodes of the job that saved ``state``."""
    found = {name: state.get(name, _SETTING_DEFAULTS.get(name)) for name in _JOB_SETTINGS}
    job = {name: v for name, v in found.items() if isinstance(v, int) and not isinstance(v, bool) and v >= 1}
    if len(job) != len(found) or job["num_replicas"] % job["nodes"]:
        raise ValueError(f"bad num_replicas/nodes in the saved sampler state: {found!r}")
    return job


def _earlier_jobs(state: dict[str, Any]) -> list[dict[str, int]]:
    """The jobs that ran the saved epoch before the one that saved ``state``, checked."""
    jobs = state.get("earlier_jobs")
    if not isinstance(jobs, list) or not jobs or len(jobs) > 1000:
        raise ValueError(f"bad earlier_jobs in the saved sampler state: {str(jobs)[:200]}")
    out = []
    for job in jobs:
        if not isinstance(job, dict) or set(job) != {*_JOB_SETTINGS, "position"}:
            raise ValueError(f"bad earlier_jobs in the saved sampler state: {str(job)[:200]}")
        position = job["position"]
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"bad position in the saved sampler state's earlier_jobs: {position!r}")
        out.append({**_saved_job(job), "position": position})
    return out


def _not_consumed(shares: list[list[int]], position: int) -> list[int]:
    """The indices of ``shares`` (every rank's part of an epoch, in order) that no rank
    had used at ``position`` (all ranks move in lockstep), each once, in the order the
    ranks would have used them."""
    seen = set()
    for share in shares:
        seen.update(share[:position])
    rest = []
    for k in range(position, max((len(s) for s in shares), default=0)):
        for share in shares:
            if k < len(share) and share[k] not in seen:
                seen.add(share[k])
                rest.append(share[k])
    return rest


def _share(rest: list[int], ranks: int, drop_last: bool, *, strided: bool) -> tuple[list[list[int]], int, int]:
    """``rest`` split into ``ranks`` equal parts (every ``ranks``-th index for the random
    order, contiguous blocks for the shard-aware ones, which keep a rank on few shards),
    padded by repeating its first indices or cut as ``drop_last`` says; with the number
    of indices repeated and left out."""
    per_rank, total = _split_sizes(len(rest), ranks, drop_last) if rest else (0, 0)
    if total <= len(rest):
        seq, padded, dropped = rest[:total], 0, len(rest) - total
    else:
        padded = total - len(rest)
        seq, dropped = rest + (rest * math.ceil(padded / len(rest)))[:padded], 0
    if strided:
        return [seq[r::ranks] for r in range(ranks)], padded, dropped
    return [seq[r * per_rank : (r + 1) * per_rank] for r in range(ranks)], padded, dropped
