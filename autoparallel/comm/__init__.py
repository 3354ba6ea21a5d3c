"""Communication: autograd-aware collectives over paddle.distributed, the backend capability table,
and the in-process simulated world."""
