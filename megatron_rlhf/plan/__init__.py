"""Planning the iteration before it runs: memory per stage (:mod:`.memory`); later the dataflow graph, cost model and layout search (ReaLHF)."""
