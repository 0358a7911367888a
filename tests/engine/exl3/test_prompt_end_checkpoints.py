"""The prompt-end checkpoint inside a single-pass prefill (``glm53.engine.exl3.prefill``), on CPU with fakes of exllamav3's pieces.

The fakes keep exllamav3's layouts (a conv window per slot, two state rows per slot, a pass that carries both
through its slot) with a token-by-token recurrence, so a pass split in two computes exactly what one pass does,
and the state copied at the split is exactly the state of a pass over the tokens before it.
"""

from __future__ import annotations

import pytest
import torch

from glm53.engine.exl3 import prefill
from glm53.engine.exl3.prefill import PROMPT_END_FLAG, PromptEndCheckpoints, checkpoint_settings, split_point

PAGE = 256
DIM, CDIM, HEADS, K, V = 6, 4, 2, 3, 3


def fake_conv(mixed_qkv, conv_state, recurrent_slots, conv1d_weight, conv1d_bias, history=False, params=None,
              token_major=False, incremental=False):
    """exllamav3's causal conv over (bsz, dim, seq) or (bsz, seq, dim); keeps the last CDIM inputs per slot."""
    x = mixed_qkv.transpose(1, 2) if token_major else mixed_qkv  # (bsz, dim, seq)
    out = []
    for b, slot in enumerate(recurrent_slots.tolist()):
        window = torch.cat([conv_state[slot, :, :CDIM], x[b]], dim=-1)
        conv_state[slot, :, :CDIM] = window[:, -CDIM:]
        taps = torch.stack([window[:, t + 1 : t + 1 + CDIM] for t in range(x.shape[-1])], dim=0)  # (seq, dim, CDIM)
        out.append(torch.nn.functional.silu((taps * conv1d_weight).sum(-1)))
    return torch.stack(out)  # (bsz, seq, dim)


def fake_scan(mixed_qkv, beta, g, recurrent_state, recurrent_slots, history, save_state, num_k_heads, num_v_heads, k_dim, v_dim,
              k_head_dim, v_head_dim, params=None, channelwise_g=False, slots_in=None):
    """A gated linear recurrence token by token, reading and writing the pass's state row."""
    out = torch.empty(mixed_qkv.shape[0], mixed_qkv.shape[1], HEADS, V, dtype=mixed_qkv.dtype)
    for b, row in enumerate(recurrent_slots.tolist()):
        s = recurrent_state[row, 0].clone()  # (HEADS, K, V)
        for t in range(mixed_qkv.shape[1]):
            q, k, v = mixed_qkv[b, t].view(3, HEADS, K)
            s = s * torch.sigmoid(g[b, t]).unsqueeze(-1) + beta[b, t].view(HEADS, 1, 1) * k.unsqueeze(-1) * v.unsqueeze(-2)
            out[b, t] = torch.einsum("hk,hkv->hv", q, s)
        recurrent_state[row, 0] = s
    return out


class Layer:
    def __init__(self, slots: int):
        self.conv_state = torch.zeros(slots, DIM * 3, CDIM + 2, dtype=torch.float64)
        self.recurrent_state = torch.zeros(2 * slots, 1, HEADS, K, V, dtype=torch.float64)


class Cache:
    def __init__(self, layers: int = 2, slots: int = 2):
        self.layers = {(i, 0): Layer(slots) for i in range(layers)}

    def get_all_recurrent_layers(self):
        return self.layers


class State:
    def __init__(self, cache: Cache, slot: int, position: int, parity: int = 1):
        self.cache, self.slot, self.position, self.parity = cache, slot, position, parity

    def base_row(self):
        return 2 * self.slot + self.parity


def layer_forward(cache, state, layer_key, x, weight, token_major, conv, scan):
    """What the recurrent layer's forward does with the two functions (shapes as in gated_delta_net.py)."""
    layer = cache.layers[layer_key]
    params = {"recurrent_states": [state]}
    slots = torch.tensor([state.slot])
    mixed = x if token_major else x.transpose(1, 2).contiguous()
    conv_out = conv(mixed_qkv=mixed, conv_state=layer.conv_state, recurrent_slots=slots, conv1d_weight=weight, conv1d_bias=None,
                    history=False, params=params, token_major=token_major, incremental=False)
    beta = torch.sigmoid(x[..., :HEADS])  # (1, seq, HEADS): per token, as the layer's gates are
    g = x[..., HEADS : HEADS + HEADS * K].reshape(1, x.shape[1], HEADS, K)
    return scan(mixed_qkv=conv_out, beta=beta, g=g, recurrent_state=layer.recurrent_state, recurrent_slots=torch.tensor([state.base_row()]),
                slots_in=None, history=False, save_state=True, num_k_heads=HEADS, num_v_heads=HEADS, k_dim=HEADS * K, v_dim=HEADS * V,
                k_head_dim=K, v_head_dim=V, params=params, channelwise_g=True)


@pytest.mark.parametrize("position,length,cut", [(0, 300, 256), (256, 1000, 768), (512, 256, 0), (512, 100, 0), (700, 100, 68), (0, 255, 0)])
def test_the_split_falls_on_the_last_page_boundary_inside_the_forward(position, length, cut):
    assert split_point(position, length, PAGE) == cut


def test_checkpoint_settings_are_the_budget_in_bytes_and_a_checkpoint_every_page():
    assert checkpoint_settings(4.0, PAGE) == {"recurrent_cache_size": 4_000_000_000, "recurrent_checkpoint_interval": PAGE}
    assert checkpoint_settings(0, PAGE)["recurrent_cache_size"] == 0


@pytest.mark.parametrize("token_major", [False, True])
def test_a_split_pass_computes_the_unsplit_one_and_captures_the_state_at_the_boundary(token_major):
    torch.manual_seed(0)
    position, seq = 200, 120  # tokens 200..319: the boundary 256 is 56 tokens in
    x = torch.randn(1, seq, DIM * 3, dtype=torch.float64)
    weight = torch.randn(DIM * 3, CDIM, dtype=torch.float64)
    start_conv, start_state = torch.randn(DIM * 3, CDIM, dtype=torch.float64), torch.randn(HEADS, K, V, dtype=torch.float64)

    def cache_at_start():
        cache = Cache()
        for layer in cache.layers.values():
            layer.conv_state[1, :, :CDIM] = start_conv
            layer.recurrent_state[3, 0] = start_state  # slot 1, parity 1
        return cache

    stock = cache_at_start()
    expected = layer_forward(stock, State(stock, 1, position), (0, 0), x, weight, token_major, fake_conv, fake_scan)
    prefix = cache_at_start()
    layer_forward(prefix, State(prefix, 1, position), (0, 0), x[:, :56], weight, token_major, fake_conv, fake_scan)

    cache = cache_at_start()
    capture = PromptEndCheckpoints(PAGE)
    setattr(cache, PROMPT_END_FLAG, capture)
    state = State(cache, 1, position)
    conv, scan = prefill._split_conv(fake_conv, PAGE), prefill._split_scan(fake_scan, PAGE)
    got = layer_forward(cache, state, (0, 0), x, weight, token_major, conv, scan)

    assert torch.equal(got, expected)
    assert torch.equal(cache.layers[0, 0].recurrent_state, stock.layers[0, 0].recurrent_state)
    assert torch.equal(cache.layers[0, 0].conv_state, stock.layers[0, 0].conv_state)
    entry = capture.pending[id(state)]
    assert entry["position"] == 256 and set(entry["conv"]) == set(entry["scan"]) == {(0, 0)}
    assert torch.equal(entry["scan"][0, 0], prefix.layers[0, 0].recurrent_state[3:4])
    assert torch.equal(entry["conv"][0, 0], prefix.layers[0, 0].conv_state[1, :, :CDIM])


def test_without_the_flag_or_a_boundary_the_stock_functions_run_alone():
    calls = []

    def original(*args):
        calls.append(args[0].shape)
        return torch.zeros(1)

    cache = Cache()
    conv = prefill._split_conv(original, PAGE)
    x = torch.zeros(1, 300, DIM * 3)
    conv(x, cache.layers[0, 0].conv_state, torch.tensor([0]), torch.zeros(DIM * 3, CDIM), None, False,
         {"recurrent_states": [State(cache, 0, 0)]}, True, False)  # no flag on the cache
    setattr(cache, PROMPT_END_FLAG, PromptEndCheckpoints(PAGE))
    conv(x[:, :256], cache.layers[0, 0].conv_state, torch.tensor([0]), torch.zeros(DIM * 3, CDIM), None, False,
         {"recurrent_states": [State(cache, 0, 0)]}, True, False)  # ends on the boundary
    conv(x, cache.layers[0, 0].conv_state, torch.tensor([0]), torch.zeros(DIM * 3, CDIM), None, True,
         {"recurrent_states": [State(cache, 0, 0)]}, True, False)  # a speculative pass
    assert calls == [(1, 300, DIM * 3), (1, 256, DIM * 3), (1, 300, DIM * 3)]


class Page:
    def __init__(self, phash, kv_position=PAGE):
        self.phash, self.kv_position = phash, kv_position


class Sequence:
    def __init__(self, kv_position):
        self.kv_position = kv_position
        self.allocated_pages = [Page(f"h{i}") for i in range(kv_position // PAGE)] + [Page("partial", kv_position % PAGE)]


class Paired:
    def __init__(self, target):
        self.target, self.draft = target, None


class Job:
    def __init__(self, state, kv_position, last=None):
        self.recurrent_state = Paired(state)
        self.sequences = [Sequence(kv_position)]
        self.last_recurrent_checkpoint_pos = last


class RecurrentCache:
    """Records what exllamav3's RecurrentCache.put is given (its LRU and budget are exllamav3's)."""

    def __init__(self):
        self.put_calls = []

    def put(self, key, state):
        self.put_calls.append((key, state.checkpoint_size, state.stash()))


def host_copy(t):
    return t.clone()


def capture_for(state, position, layers):
    capture = PromptEndCheckpoints(PAGE)
    for key in layers:
        capture.note(state, position, "conv", key, torch.ones(DIM * 3, CDIM))
        capture.note(state, position, "scan", key, torch.full((1, 1, HEADS, K, V), 2.0))
    return capture


def test_commit_stashes_the_capture_under_the_hash_of_the_page_ending_at_the_boundary():
    cache = Cache()
    state = State(cache, 0, 700)  # a forward over 300..700 was split at its last boundary, 512
    job = Job(state, 700, last=256)
    capture = capture_for(state, 512, cache.layers)
    rc = RecurrentCache()
    capture.commit([job], rc, cache.layers, host_copy)
    (key, size, stashed), = rc.put_calls
    per_layer = DIM * 3 * CDIM * 4 + HEADS * K * V * 4  # float32 test tensors, measured
    assert key == "h1" and size == 2 * per_layer == stashed["checkpoint_size"] == stashed["target"]["checkpoint_size"]
    assert stashed["position"] == stashed["target"]["position"] == 512
    s, c = stashed["target"][(1, 0)]
    assert s.shape == (1, 1, HEADS, K, V) and c.shape == (DIM * 3, CDIM)
    assert job.last_recurrent_checkpoint_pos == 512 and (capture.made, capture.dropped, capture.pending) == (1, 0, {})


def test_commit_drops_a_capture_missing_a_layer_and_any_left_over():
    cache = Cache()
    state, other = State(cache, 0, 0), State(cache, 1, 0)
    capture = capture_for(state, 256, [(0, 0)])  # layer (1, 0) missing
    capture.note(other, 256, "conv", (0, 0), torch.ones(1))  # a sequence whose job is gone
    rc = RecurrentCache()
    capture.commit([Job(state, 300)], rc, cache.layers, host_copy)
    assert rc.put_calls == [] and (capture.made, capture.dropped, capture.pending) == (0, 2, {})
