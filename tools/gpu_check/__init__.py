"""The GPU check: one run on one GPU that exercises and measures the whole stack in a fixed
time and prints one summary table. Run it through ``bash tools/gpu_check.sh`` (which installs
the carried megatron-core wheel when the machine lacks it); ``--smoke`` runs tiny shapes on any
device. Modules: ``cli`` (flags, header, main), ``stages`` (scheduler, setup and training),
``decode`` (the decode stages), ``bitwise`` (generator vs trainer log-probs bit for bit, with
batch_invariant_mode off and on), ``processes`` (a process per stage group), ``budget`` (stage
minimums and deadlines), ``faults`` (test hooks), ``report``, ``shapes``, ``models``,
``environment``."""
