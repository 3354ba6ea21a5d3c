"""A user model module that captures paddle ops at import and at build, in every form a model library uses
(tests/test_captured_ops.py imports it in a fresh process before autoparallel installs dispatch, then compares
each form distributed with one process)."""
import functools

import paddle
import paddle.nn.functional as F
from paddle import nn

act_partial = functools.partial(F.gelu, approximate=True)
mm = paddle.matmul
TABLE = {"silu": F.silu}
ACT_LIST = [F.softsign]
ACT_TUPLE = (F.tanhshrink,)


def make_closure():
    fn = F.silu

    def f(x):
        return fn(x)
    return f


closure_act = make_closure()


def default_arg(x, act=F.tanh):
    return act(x)


def kwonly_default(x, *, act=F.softplus):
    return act(x)


class Holder:
    """A plain (non-Layer) object holding an op."""
    def __init__(self):
        self.fn = F.elu


HOLDER = Holder()


def _fn(h, w, pact):
    """Each form: ``h`` a DistTensor activation, ``w`` a sharded DistParameter."""
    return {
        "partial": lambda: act_partial(h),
        "module alias": lambda: mm(h, w),
        "closure": lambda: closure_act(h),
        "default argument": lambda: default_arg(h),
        "keyword-only default": lambda: kwonly_default(h),
        "layer attribute partial": lambda: pact(h),
        "dict table": lambda: TABLE["silu"](h),
        "module list": lambda: ACT_LIST[0](h),
        "module tuple": lambda: ACT_TUPLE[0](h),
        "plain object attribute": lambda: HOLDER.fn(h),
        "partial on a sharded parameter": lambda: h + act_partial(w).sum(0),
        "closure on a sharded parameter": lambda: h * closure_act(w).sum(),
    }


FORMS = list(_fn(None, None, None))


class Net(nn.Layer):
    def __init__(self, form):
        super().__init__()
        self.form = form
        self.fc1, self.fc2 = nn.Linear(6, 8), nn.Linear(8, 4)
        self.fn = F.silu
        self.pact = functools.partial(F.gelu, approximate=True)
        self.w = self.create_parameter([8, 8])

    def act(self, h, k=F.sigmoid):
        if self.form == "method default":
            return k(h)
        if self.form == "layer attribute":
            return self.fn(h)
        return _fn(h, self.w, self.pact)[self.form]()

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


ALL_FORMS = FORMS + ["method default", "layer attribute"]
