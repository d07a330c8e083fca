"""Planning the iteration before it runs (ReaLHF): memory, dataflow graph, costs, layout search."""
