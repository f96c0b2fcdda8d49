"""Pure solvers over cost lists: the balance, costs, unequal devices' speeds and the rank order; no processes, no
modules."""
