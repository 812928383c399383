"""A bounded replay buffer of whole groups for GVPO's off-policy updates (no importance weights)."""

from __future__ import annotations

import json

import numpy as np

# Arrays stored per group: [G, ...] slices of an update batch. Behaviour log-probs are not stored:
# GVPO recomputes log-probs under pi_theta and pi_theta' for replayed groups, which is all its
# theorem needs for any sampling distribution.
GROUP_KEYS = ("tokens", "attn_mask", "resp_mask", "rewards")


class ReplayBuffer:
    """Keeps up to `capacity` groups; `mode` is "fifo" (oldest out) or "reservoir" (uniform sample).

    Groups are stored as numpy arrays so the buffer can be checkpointed (`state_dict`) and restored
    bit-exactly (`load_state_dict`), including its random generator.
    """

    def __init__(self, capacity: int, *, mode: str = "fifo", seed: int = 0):
        if mode not in ("fifo", "reservoir"):
            raise ValueError(f"replay mode {mode!r} is unknown; use fifo or reservoir.")
        self.capacity = capacity
        self.mode = mode
        self._rng = np.random.default_rng(seed)
        self._groups: dict[str, np.ndarray] | None = None
        self._size = 0
        self._next = 0  # fifo write cursor
        self._seen = 0  # groups ever offered (reservoir sampling)

    def __len__(self) -> int:
        return self._size

    def add(self, batch: dict[str, np.ndarray], group_size: int) -> None:
        """Adds every group of `batch` (arrays with B = P*G rows, groups contiguous)."""
        num_groups = batch["rewards"].shape[0] // group_size
        grouped = {
            k: np.asarray(batch[k]).reshape(num_groups, group_size, *batch[k].shape[1:])
            for k in GROUP_KEYS
        }
        if self._groups is None:
            self._groups = {
                k: np.zeros((self.capacity, *v.shape[1:]), v.dtype) for k, v in grouped.items()
            }
        for g in range(num_groups):
            slot = self._slot()
            self._seen += 1
            if slot is None:
                continue
            for k in GROUP_KEYS:
                self._groups[k][slot] = grouped[k][g]

    def _slot(self) -> int | None:
        if self._size < self.capacity:
            self._size += 1
            self._next = self._size % self.capacity
            return self._size - 1
        if self.mode == "fifo":
            slot = self._next
            self._next = (self._next + 1) % self.capacity
            return slot
        j = int(self._rng.integers(0, self._seen + 1))
        return j if j < self.capacity else None

    def sample(self, num_groups: int) -> dict[str, np.ndarray]:
        """`num_groups` distinct groups (uniform), flattened back to [num_groups*G, ...] rows."""
        if num_groups > self._size:
            raise ValueError(f"replay buffer holds {self._size} groups, {num_groups} were asked.")
        idx = self._rng.choice(self._size, size=num_groups, replace=False)
        return {k: v[idx].reshape(-1, *v.shape[2:]) for k, v in self._groups.items()}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Numpy arrays only (for the checkpoint): the stored groups, counters and rng state."""
        state = {
            "counters": np.array([self._size, self._next, self._seen], np.int64),
            "rng": np.frombuffer(
                json.dumps(self._rng.bit_generator.state).encode(), np.uint8
            ).copy(),
        }
        if self._groups is not None:
            state.update({f"group_{k}": v[: self._size] for k, v in self._groups.items()})
        return state

    def load_state_dict(self, state: dict[str, np.ndarray]) -> None:
        self._size, self._next, self._seen = (int(x) for x in state["counters"])
        self._rng.bit_generator.state = json.loads(bytes(state["rng"]).decode())
        self._groups = None
        if self._size:
            self._groups = {}
            for k in GROUP_KEYS:
                v = np.asarray(state[f"group_{k}"])
                full = np.zeros((self.capacity, *v.shape[1:]), v.dtype)
                full[: self._size] = v
                self._groups[k] = full
