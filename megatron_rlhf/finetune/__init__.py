"""The stages around RLHF: supervised fine-tuning (SFT), reward-model training on
preference pairs (Bradley-Terry) and direct preference optimisation (DPO)."""
