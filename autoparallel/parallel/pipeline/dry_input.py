"""The one-sample input of the dry runs that split and describe a model without embed()/head() (auto_split.py,
call_forms.py).

A language model takes token ids: ``[1, 2]`` int64 zeros. A model whose first layer with parameters is a
``Linear`` (an MLP regressor or classifier on feature vectors) takes float rows: ``[1, in_features]`` zeros of the
weight's dtype; a first convolution (``Conv1D/2D/3D``, a CNN) a float sample of ``in_channels`` channels and
``SIDE`` positions on each spatial axis, in the layer's data format (a model that needs another spatial size fails
its dry run, which then raises by name: auto_split.block_forms). The first layer the forward calls is found by a pre-hook on every layer that holds parameters of
its own (the model's forward runs until that layer, then stops). Any other first layer keeps the token ids.
"""
from __future__ import annotations

import paddle
from paddle import nn

from autoparallel import compat


class _First(Exception):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer


SIDE = 32          # spatial positions per axis of a convolution's dry sample


def ids():
    return paddle.zeros([1, 2], dtype="int64")


def dry_input(model):
    """The dry runs' input for ``model`` (module docstring)."""
    first = _first_layer(model)
    if isinstance(first, nn.Linear):
        return paddle.zeros([1, int(first.weight.shape[0])], dtype=first.weight.dtype)
    if isinstance(first, (nn.Conv1D, nn.Conv2D, nn.Conv3D)):
        spatial = [SIDE] * (first.weight.ndim - 2)
        channels_last, channels = compat.conv_input_layout(first)
        shape = [1, *spatial, channels] if channels_last else [1, channels, *spatial]
        return paddle.zeros(shape, dtype=first.weight.dtype)
    return ids()


def describe(sample) -> str:
    """What a dry sample is, for an error message."""
    return f"{str(sample.dtype).replace('paddle.', '')} zeros of shape {list(sample.shape)}"


def _first_layer(model):
    def stop(layer, _inputs):
        raise _First(layer)

    hooks = [layer.register_forward_pre_hook(stop) for _, layer in model.named_sublayers(include_self=False)
             if layer.parameters(include_sublayers=False)]
    rng = paddle.get_rng_state()
    try:
        with paddle.no_grad():
            model(ids())
    except _First as e:
        return e.layer
    except Exception:                       # noqa: BLE001 - the forward failed before any layer: keep the ids
        return None
    finally:
        paddle.set_rng_state(rng)
        for h in hooks:
            h.remove()
    return None
