"""Whole-graph completion: every op's layout for a captured forward (and loss), chosen by total cost.

    plan = complete(model, DistSpec(mesh, [Replicate()], (8, 16)), annotations={"fc1.weight": "[S(1)]"})
    print(plan.listing())                  # per op: placements in and out, the collectives it causes
    with plan.pinned():                    # execution with these layouts (dispatch asks no rule)
        out = model(x)

The steps, in order (one module each):

1. **capture** (``graph_capture``) runs the forward on spec-only tensors through dispatch (like ``ap.trace``)
   and records, per op, the rule call (spec arguments and attributes), where each input comes from (an op
   output, a model input, a parameter, a constant) and the sublayer that ran it.
2. **propagate** (``propagation``): forward rules (input layouts -> output layouts) and reverse rules (output ->
   inputs) run to a fixpoint from the user's annotations; every unknown tensor gets the first layout inferred.
3. **candidates** (``candidate_layouts``): for each op, the distinct rule results over input placements with one
   "driver" per mesh dim (one input sharded on one dim or partial, all others replicated), plus the propagated
   and the eager (greedy) result. Any rule result is a valid layout of the op: the runtime reshards its inputs
   to what the result requires.
4. **annotations are hard where they describe compute**: an annotated parameter is stored and consumed in its
   layout (a replicated one may still enter as Partial: that is local and free), an annotated layer output is
   produced in its layout; an op whose candidates all break some of these raises ``AnnotationConflictError``
   naming them. A model input's layout is where the data arrives: its first consumers may reshard it, at a price
   — unless it is hard (``hard_inputs``: a strategy's data parallelism).
5. **cost** (``cost``, and ``problem`` builds the discrete problem) (seconds, cluster alpha-beta): compute ``3 x
   FLOPs`` split over the mesh dims the op shards, forward reshards, their backward adjoints for tensors needing
   gradients, the gradient all-reduce of a replicated input of a split op, and gradient reductions of parameters
   (bucketed: bandwidth only). An unannotated parameter used once is stored in the layout its consumer requires
   (Partial stored as Replicate); one used more than once, or a free input used more than once, is a variable of
   its own.
6. **solve** exactly (``solver``, knobs in ``options.SolverOptions``): variables with at most two neighbours are
   eliminated by dynamic programming (chains and trees vanish completely, series-parallel graphs too); what
   remains, where the graph branches, is an integer program (scipy's HiGHS ``milp``, local-polytope formulation,
   exact with integral choices).

``plan`` holds the result (``CompletedPlan``); ``api`` runs the steps in order.
"""

from autoparallel.graph.completion.api import complete, complete_graph
from autoparallel.graph.completion.candidate_layouts import candidates, feasible
from autoparallel.graph.completion.cost import CostModel, split_dims, use_cost
from autoparallel.graph.completion.errors import AnnotationConflictError, MissingRuleError
from autoparallel.graph.completion.graph_capture import capture
from autoparallel.graph.completion.options import SolverOptions
from autoparallel.graph.completion.plan import CompletedPlan
from autoparallel.graph.completion.problem import Problem, build_problem
from autoparallel.graph.completion.propagation import propagate
from autoparallel.graph.completion.solver import exhaustive, solve
from autoparallel.graph.completion.sources import Source, source_needs_grad

__all__ = ["AnnotationConflictError", "MissingRuleError", "Source", "capture", "propagate", "candidates", "feasible",
           "complete_graph", "SolverOptions", "split_dims", "use_cost", "source_needs_grad",
           "CostModel", "Problem", "solve", "exhaustive", "complete", "CompletedPlan", "build_problem"]
