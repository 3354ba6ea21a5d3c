"""``paddle.nn.LSTM`` / ``GRU`` / ``SimpleRNN`` on distributed tensors (see composites.py).

paddle runs these layers as one fused ``rnn`` C op, which has no spmd rule. Its own python fallback (the
layers of ``RNN`` / ``BiRNN`` cells the layer already holds) does not run on paddle 3.3 for GRU and SimpleRNN
(``split_states`` unstacks the one-state tuple it builds) and does not zero the outputs past a sequence's
length, which the fused op does. So the decomposition here loops over time with the layer's own cells
(``LSTMCell`` / ``GRUCell`` / ``SimpleRNNCell``: matmuls, splits and activations, each with a rule) and
mirrors what one process runs: zero initial states, a state kept past ``sequence_length`` (and the output
zeroed there when one process takes the fused op), the
backward direction reversed over the whole padded sequence (a padded step keeps the initial state, so this
equals reversing each sequence within its length), dropout between layers, final states stacked as
``[num_layers * num_directions, batch, size]``.

Any layout the rules support runs: a batch split over data-parallel ranks keeps every step local (the
weights' gradients are reduced as for any replicated parameter). Dropout between layers (``dropout > 0`` in
training) draws its masks with ``F.dropout``, as the python path does, not with the fused kernel's generator:
the same distribution, other masks than one process's fused run."""
from __future__ import annotations

from spmd_rules.composites import _F, _p, gshape


def rnn_layer_forward(self, inputs, initial_states=None, sequence_length=None):
    paddle, F = _p(), _F()
    comps, dirs = self.state_components, self.num_directions
    x = inputs if self.time_major else paddle.transpose(inputs, [1, 0, 2])        # [time, batch, features]
    states = _initial_states(self, inputs, initial_states)
    mask = None
    if sequence_length is not None:
        steps = paddle.arange(gshape(x)[0], dtype=sequence_length.dtype).unsqueeze(1)
        mask = (steps < sequence_length.unsqueeze(0)).astype(x.dtype).unsqueeze(-1)    # [time, batch, 1]
    finals = [[] for _ in range(comps)]
    for i, layer in enumerate(self):
        if i > 0:
            x = F.dropout(x, self.dropout, training=self.training, mode="upscale_in_train")
        cells = [layer.cell] if dirs == 1 else [layer.cell_fw, layer.cell_bw]
        outs = []
        for d, cell in enumerate(cells):
            start = [s[i * dirs + d] for s in states]
            out, last = _run_cell(cell, x, start, mask, reverse=d == 1, zero_past=self.could_use_cudnn)
            outs.append(out)
            for c in range(comps):
                finals[c].append(last[c])
        x = outs[0] if dirs == 1 else paddle.concat(outs, axis=-1)
    out = x if self.time_major else paddle.transpose(x, [1, 0, 2])
    final = [paddle.stack(f, axis=0) for f in finals]
    return out, (tuple(final) if comps == 2 else final[0])


def _initial_states(self, inputs, given):
    """One ``[num_layers * num_directions, batch, size]`` tensor per state component (h, and c for LSTM)."""
    paddle = _p()
    comps = self.state_components
    if given is None:
        batch = gshape(inputs)[1 if self.time_major else 0]
        sizes = [self.proj_size or self.hidden_size, self.hidden_size][:comps]
        return [paddle.zeros([self.num_layers * self.num_directions, batch, s], dtype=inputs.dtype) for s in sizes]
    given = [given] if isinstance(given, paddle.Tensor) else list(given)
    if len(given) != comps:
        raise ValueError(f"paddle.nn.{type(self).__name__}: initial_states must be {comps} tensor(s) "
                         f"({'(h, c)' if comps == 2 else 'h'}), got {len(given)}")
    return given


def _run_cell(cell, x, start, mask, reverse: bool, zero_past: bool):
    """``cell`` over the time steps of ``x`` (forwards or backwards); (stacked outputs, final state parts).
    ``zero_past``: outputs past a sequence's length are zeros (the fused op) or the cell's output on the kept
    state (paddle's python path, which one process takes when the fused op cannot hold the weights: LSTM's
    ``proj_size``, a bias turned off)."""
    paddle = _p()
    state = tuple(start) if len(start) == 2 else start[0]
    steps = range(gshape(x)[0])
    outs = {}
    for t in (reversed(steps) if reverse else steps):
        out, new = cell(x[t], state)
        if mask is not None:
            m = mask[t]
            out = out * m if zero_past else out
            new = _keep_past_length(state, new, m)
        outs[t], state = out, new
    parts = list(state) if isinstance(state, (tuple, list)) else [state]
    return paddle.stack([outs[t] for t in steps], axis=0), parts


def _keep_past_length(old, new, m):
    if isinstance(new, (tuple, list)):
        return type(new)(_keep_past_length(o, n, m) for o, n in zip(old, new))
    return new * m + old * (1.0 - m)


COMPOSITES = {"paddle.nn.layer.rnn.RNNBase.forward": rnn_layer_forward}
