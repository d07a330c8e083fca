"""SLURM shims (``bin/sbatch``, ``bin/srun``, ``bin/scontrol``) and a harness that submits
the real ``examples/`` scripts with them on this machine (tests/e2e/test_slurm_scripts.py)."""
