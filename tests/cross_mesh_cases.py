"""Programs whose layers sit on meshes of different ranks, activations moved by ``ap.reshard`` (paddle's dygraph
pipeline form), and the same programs in one plain paddle process. Shared by tests/test_cross_mesh_grad.py
(simulated ranks) and dist_scripts/cross_mesh_worker.py (4 launched ranks).

``run(case, dist)`` trains two AdamW steps and returns ``{"losses": [...], "params": {name: list}}``: in the
distributed form each rank reports the losses whose mesh it is in and the parameters it holds (replicated: its
local value is the whole parameter; a sharded one is gathered on its mesh)."""
import numpy as np
import paddle
import paddle.nn.functional as F
from paddle import nn

import autoparallel as ap

D = 8
RNG = np.random.default_rng(7)
W = [(RNG.standard_normal((D, D)).astype("float32") * 0.3, RNG.standard_normal(D).astype("float32") * 0.1)
     for _ in range(4)]
X = [RNG.standard_normal((4, D)).astype("float32") for _ in range(2)]
Y = [RNG.standard_normal((4, D)).astype("float32") for _ in range(2)]
R, S0, S1 = ap.Replicate(), ap.Shard(0), ap.Shard(1)


def _linear(k):
    lin = nn.Linear(D, D)
    lin.weight.set_value(paddle.to_tensor(W[k][0]))
    lin.bias.set_value(paddle.to_tensor(W[k][1]))
    return lin


# case -> (meshes (rank lists), mesh of each layer, input placement, forward(layers, x, move), loss mesh index,
#          optimizer groups (layer indices), placement of layer 0's weight)
def _mlp(L, x, mv, pl=(S0,)):
    return L[1](mv(F.relu(L[0](x)), 1, pl))


def _chain(L, x, mv):
    return L[2](mv(F.tanh(L[1](mv(F.relu(L[0](x)), 1, (R,)))), 2, (R,)))


def _loop_back(L, x, mv):
    h = F.relu(L[0](x))
    return L[2](mv(F.tanh(L[1](mv(h, 1, (R,)))), 0, (R,))), (h * h).mean()


def _twice_and_unused(L, x, mv):
    h = F.relu(L[0](x))
    a, b = mv(h, 1, (R,)), mv(h, 1, (R,))      # the same tensor moved twice
    mv(F.tanh(h), 1, (R,))                      # received, never used
    return L[1](a) + L[2](b * 2.0)


CASES = {
    "mlp [0]/[1]": ([[0], [1]], [0, 1], (R,), lambda L, x, mv: _mlp(L, x, mv, (R,)), 1, [[0, 1]], None),
    "mlp [0,1]/[2,3] S(0)": ([[0, 1], [2, 3]], [0, 1], (S0,), _mlp, 1, [[0, 1]], None),
    "mlp S(0) -> R": ([[0, 1], [2, 3]], [0, 1], (S0,), lambda L, x, mv: _mlp(L, x, mv, (R,)), 1, [[0, 1]], None),
    "mlp R -> S(0)": ([[0, 1], [2, 3]], [0, 1], (R,), _mlp, 1, [[0, 1]], None),
    "mlp Partial -> R": ([[0, 1], [2, 3]], [0, 1], (S1,), lambda L, x, mv: L[1](F.relu(mv(L[0](x), 1, (R,)))), 1,
                         [[0, 1]], S0),
    "mlp [0,1] S(0) -> [2] R": ([[0, 1], [2]], [0, 1], (S0,), lambda L, x, mv: _mlp(L, x, mv, (R,)), 1, [[0, 1]],
                                None),
    "mlp [0] -> [1,2] R": ([[0], [1, 2]], [0, 1], (R,), lambda L, x, mv: _mlp(L, x, mv, (R,)), 1, [[0, 1]], None),
    "two models": ([[0], [1]], [0, 0, 1], (R,), lambda L, x, mv: L[2](mv(L[1](F.relu(L[0](x))), 1, (R,))), 1,
                   [[0, 1], [2]], None),
    "chain [0]->[1]->[2]": ([[0], [1], [2]], [0, 1, 2], (R,), _chain, 2, [[0, 1, 2]], None),
    "loop back, sender holds a loss term": ([[0], [1]], [0, 1, 0], (R,), _loop_back, 0, [[0, 1, 2]], None),
    "crosses twice, one received unused": ([[0], [1]], [0, 1, 1], (R,), _twice_and_unused, 1, [[0, 1, 2]], None),
}


def run(case, dist: bool, detach: bool = False, functional: bool = False):
    """Two steps of ``case``; ``detach``: the moves pass a detached tensor (the only form that ran on launched
    ranks before), a negative control; ``functional``: ``paddle.autograd.backward([loss])``."""
    meshes, where, xpl, fwd, loss_at, groups, w0 = CASES[case]
    paddle.seed(0)
    layers = [_linear(k) for k in range(len(where))]
    pm = [ap.ProcessMesh(m, dim_names=["x"]) for m in meshes] if dist else None
    if dist:
        def shard_w0(name, sub, mesh):
            sub.weight = ap.shard_tensor(sub.weight, mesh, [w0])

        for k, lin in enumerate(layers):
            ap.shard_layer(lin, pm[where[k]], shard_fn=shard_w0 if k == 0 and w0 is not None else None)

    def mv(t, i, placements):
        if not dist:
            return t
        return ap.reshard(t.detach() if detach else t, pm[i], list(placements))

    opts = [paddle.optimizer.AdamW(learning_rate=0.05, parameters=[p for k in g for p in layers[k].parameters()])
            for g in groups]
    if dist:
        opts = [ap.shard_optimizer(o) for o in opts]
    losses, kept = [], []               # kept: every step's tensors stay alive (and their moves' records)
    for step in range(2):
        x, y = paddle.to_tensor(X[step]), paddle.to_tensor(Y[step])
        if dist:
            x = ap.shard_tensor(x, pm[where[0]], list(xpl))
        out = fwd(layers, x, mv)
        kept.append(out)
        extra = None
        if isinstance(out, tuple):
            out, extra = out
        loss = F.mse_loss(out, y)
        if extra is not None:
            loss = loss + extra
        if functional:
            paddle.autograd.backward([loss])
        else:
            loss.backward()
        for o in opts:
            o.step()
            o.clear_grad()
        losses.append(_value(loss, pm[loss_at] if dist else None))
    return {"losses": [v for v in losses if v is not None], "params": _params(layers, dist)}


def _value(loss, mesh):
    if mesh is None:
        return float(loss)
    from autoparallel.comm.world import current_world

    if current_world().is_simulated or current_world().rank in mesh.process_ids:
        return float(loss)
    return None


def _params(layers, dist):
    from autoparallel.comm.world import current_world

    out = {}
    for k, lin in enumerate(layers):
        for n, p in lin.named_parameters():
            if not dist:
                out[f"{k}.{n}"] = p.numpy().tolist()
            elif current_world().is_simulated or current_world().rank in p.mesh.process_ids:
                out[f"{k}.{n}"] = p.full().numpy().tolist()
    return out


def run_gan(dist: bool):
    """Two backward passes per step: a generator on mesh [0] and a discriminator on [1]; the discriminator's
    loss reads the moved fake detached, the generator's reads it whole (its move's gradient must wait for the
    second backward, not go back as zeros at the first). Two optimizers."""
    paddle.seed(0)
    G, Dn = _linear(0), _linear(1)
    m0 = m1 = None
    if dist:
        m0, m1 = ap.ProcessMesh([0], dim_names=["x"]), ap.ProcessMesh([1], dim_names=["x"])
        ap.shard_layer(G, m0)
        ap.shard_layer(Dn, m1)
    opt_g = paddle.optimizer.AdamW(learning_rate=0.05, parameters=G.parameters())
    opt_d = paddle.optimizer.AdamW(learning_rate=0.05, parameters=Dn.parameters())
    if dist:
        opt_g, opt_d = ap.shard_optimizer(opt_g), ap.shard_optimizer(opt_d)
    losses = []
    for step in range(2):
        x, y = paddle.to_tensor(X[step]), paddle.to_tensor(Y[step])
        if dist:
            x = ap.shard_tensor(x, m0, [R])
        fake = F.tanh(G(x))
        if dist:
            fake = ap.reshard(fake, m1, [R])
        d_loss = F.mse_loss(Dn(fake.detach()), y)
        d_loss.backward()
        opt_d.step()
        opt_d.clear_grad()
        g_loss = (Dn(fake) ** 2).mean()
        g_loss.backward()
        opt_g.step()
        opt_g.clear_grad()
        opt_d.clear_grad()
        losses += [_value(d_loss, m1), _value(g_loss, m1)]
    return {"losses": [v for v in losses if v is not None], "params": _params([G, Dn], dist)}


def run_retained(dist: bool):
    """``loss.backward(retain_graph=True)`` then ``loss.backward()``: every gradient twice, the moved one too
    (the move is sent back at both backward passes)."""
    paddle.seed(0)
    L = [_linear(0), _linear(1)]
    x = paddle.to_tensor(X[0])
    mv = (lambda t: t) if not dist else None
    if dist:
        m0, m1 = ap.ProcessMesh([0], dim_names=["x"]), ap.ProcessMesh([1], dim_names=["x"])
        ap.shard_layer(L[0], m0)
        ap.shard_layer(L[1], m1)
        x = ap.shard_tensor(x, m0, [R])
        mv = lambda t: ap.reshard(t, m1, [R])          # noqa: E731
    loss = F.mse_loss(L[1](mv(F.relu(L[0](x)))), paddle.to_tensor(Y[0]))
    loss.backward(retain_graph=True)
    loss.backward()
    from autoparallel.comm.world import current_world

    out = {}
    for k, lin in enumerate(L):
        if not dist or current_world().is_simulated or current_world().rank in lin.weight.mesh.process_ids:
            out[f"{k}.weight"] = lin.weight.grad.numpy().tolist()          # replicated: the local is whole
    return out
