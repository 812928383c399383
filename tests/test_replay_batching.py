"""Host-side batching: update layout, whole-group minibatches, the replay buffer and its state."""

import numpy as np
import pytest

from gvpo_jax import batch as batch_lib
from gvpo_jax.replay import ReplayBuffer


def _batch(num_groups, G, S=6, N=3, offset=0):
    B = num_groups * G
    rows = np.arange(B) + offset
    return {
        "tokens": np.tile(rows[:, None], (1, S)).astype(np.int32),
        "attn_mask": np.ones((B, S), np.float32),
        "resp_mask": np.ones((B, N), np.float32),
        "rewards": rows.astype(np.float32),
    }


def test_layout_left_pads_prompts_and_masks_responses():
    prompts = [[5, 6, 7], [8]]
    resp = np.array([[1, 2, 0], [3, 0, 0], [4, 4, 4], [9, 9, 0]], np.int32)
    mask = np.array([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 0]], np.float32)
    out = batch_lib.layout_batch(prompts, resp, mask, group_size=2, prompt_len=4, pad_id=0)
    np.testing.assert_array_equal(out["tokens"][0], [0, 5, 6, 7, 1, 2, 0])
    np.testing.assert_array_equal(out["tokens"][3], [0, 0, 0, 8, 9, 9, 0])
    np.testing.assert_array_equal(out["attn_mask"][1], [0, 1, 1, 1, 1, 0, 0])
    np.testing.assert_array_equal(out["attn_mask"][2], [0, 0, 0, 1, 1, 1, 1])
    # The slot before the first response token is always the prompt's last token.
    assert (out["tokens"][:, 3] == np.array([7, 7, 8, 8])).all()


@pytest.mark.parametrize("num_groups,num_mb", [(8, 1), (8, 2), (8, 4), (6, 3)])
def test_minibatches_never_split_a_group(num_groups, num_mb):
    G = 4
    batch = _batch(num_groups, G)
    parts = batch_lib.minibatch_groups(num_groups, num_mb, np.random.default_rng(0))
    seen = []
    for groups in parts:
        mb = batch_lib.select_groups(batch, groups, G)
        prompt_of_row = mb["rewards"].astype(int) // G
        # Contiguous runs of G rows share one prompt, and each prompt appears in one run only.
        runs = prompt_of_row.reshape(-1, G)
        assert (runs == runs[:, :1]).all()
        seen += list(runs[:, 0])
    assert sorted(seen) == list(range(num_groups))


def test_minibatches_reject_uneven_split():
    with pytest.raises(ValueError, match="do not divide"):
        batch_lib.minibatch_groups(6, 4, np.random.default_rng(0))


def test_replay_fifo_keeps_newest_groups():
    buf = ReplayBuffer(3, mode="fifo", seed=0)
    for i in range(5):
        buf.add(_batch(1, 2, offset=10 * i), 2)
    assert len(buf) == 3
    got = buf.sample(3)
    firsts = sorted(set(got["rewards"][::2].astype(int)))
    assert firsts == [20, 30, 40]
    assert got["tokens"].shape == (6, 6)


def test_replay_reservoir_is_uniform_over_history():
    hits = np.zeros(20)
    for seed in range(300):
        buf = ReplayBuffer(5, mode="reservoir", seed=seed)
        for i in range(20):
            buf.add(_batch(1, 2, offset=2 * i), 2)
        for r in buf.sample(5)["rewards"][::2].astype(int) // 2:
            hits[r] += 1
    # Each of the 20 groups is kept with probability 5/20: expected 75 hits out of 300 runs.
    assert np.all(np.abs(hits - 75) < 30), hits


def test_replay_state_roundtrip_is_exact():
    buf = ReplayBuffer(4, mode="reservoir", seed=3)
    for i in range(7):
        buf.add(_batch(2, 2, offset=4 * i), 2)
    state = buf.state_dict()
    other = ReplayBuffer(4, mode="reservoir", seed=99)
    other.load_state_dict(state)
    a, b = buf.sample(3), other.sample(3)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k])
    buf.add(_batch(1, 2, offset=100), 2)
    other.add(_batch(1, 2, offset=100), 2)
    np.testing.assert_array_equal(
        buf.state_dict()["group_rewards"], other.state_dict()["group_rewards"]
    )


def test_replay_refuses_oversampling():
    buf = ReplayBuffer(4)
    buf.add(_batch(1, 2), 2)
    with pytest.raises(ValueError, match="holds 1 groups"):
        buf.sample(2)
