"""Planning the iteration before it runs (ReaLHF): memory per stage (:mod:`.memory`), the
dataflow graph of an RLHF iteration (:mod:`.graph`), its cost model (:mod:`.cost`) and the
search over per-call layouts (:mod:`.search`)."""
